r"""Eq. 5 evaluation (scores xi + log p_n over all labels, exact top-k): label order vs leaf order.

  python -m benchmarks.tree_eval --size=full --out_dir=results/benchmarks
  python -m benchmarks.tree_eval --size=small

One query chunk (N = 256 queries, h = 128, top-100, row blocks of 4,096) of the chunked retrieval
(`snm_jax.mining.retrieval.make_top_k_retrieval`) on a random tree (`adversarial.random_tree`,
PCA width 16) and a random class table, 1-device mesh, timed interleaved (`common.time_interleaved`):
  * label_order: blocks of consecutive label ids, each label's log p_n walked root to leaf
    (`tree.log_prob_shared`: O(C k log C) per query; the evaluation before the leaf order);
  * leaf_order: the table permuted into the tree's leaf order (`evaluate.leaf_order_rows`), each
    block a whole subtree expanded level by level (`TreeTrainingSampler.log_prob_leaf_block`,
    O((r + log C) k) per block: what `train/evaluate.py` does now);
  * permute_table: that permutation, paid once per evaluation.
Before timing, both must return the same ids (the fraction equal is recorded) and scores within 1e-3.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from snm_jax import adversarial, sharding
from snm_jax.adversarial import tree as tree_lib
from snm_jax.mining.retrieval import make_top_k_retrieval
from snm_jax.train.core.evaluate import leaf_order_rows

SIZES = {"small": dict(ks=(10**4,), reps=5), "full": dict(ks=(10**5, 10**6), reps=10)}
N, H, PCA, TOP_K, ROW_BLOCK = 256, 128, 16, 100, 4096


def run_c(num_labels: int, reps: int) -> dict:
  tree = adversarial.random_tree(0, num_labels, PCA)
  rng = np.random.default_rng(0)
  mesh = sharding.make_mesh((1, 1), devices=jax.devices()[:1])
  table = jax.device_put(rng.normal(size=(num_labels, H)).astype(np.float32),
                         sharding.named(mesh, sharding.TABLE))
  q = jnp.asarray(rng.normal(size=(N, H)).astype(np.float32))
  x = jnp.asarray(rng.normal(size=(N, PCA)).astype(np.float32))

  def label_bias(xx, ids):
    valid = ids < num_labels
    return jnp.where(valid, tree_lib.log_prob_shared(tree, xx, jnp.where(valid, ids, 0)), -jnp.inf)

  row_labels, block = leaf_order_rows(np.asarray(tree.label_of_leaf_L), 1, ROW_BLOCK)
  rows = jnp.asarray(np.maximum(row_labels, 0))
  permute = jax.jit(lambda t, r: jnp.take(t, r, axis=0), out_shardings=sharding.named(mesh, sharding.TABLE))
  table_leaf = permute(table, rows)
  sampler = adversarial.TreeTrainingSampler(tree=tree, num_samples=1)
  label_order = make_top_k_retrieval(mesh, k=TOP_K, num_labels=num_labels, row_block=ROW_BLOCK,
                                     bias_fn=label_bias)
  leaf_order = make_top_k_retrieval(mesh, k=TOP_K, num_labels=len(row_labels), row_block=block,
                                    bias_fn=sampler.log_prob_leaf_block)
  old, new = label_order(q, table, x), leaf_order(q, table_leaf, x)
  new_ids = np.where(np.asarray(new[1]) >= 0, row_labels[np.maximum(np.asarray(new[1]), 0)], -1)
  same = float(np.mean(np.asarray(old[1]) == new_ids))
  score_diff = float(np.max(np.abs(np.asarray(old[0]) - np.asarray(new[0]))))
  if score_diff > 1e-3:
    raise AssertionError(f"label and leaf order disagree at C = {num_labels}: scores differ by {score_diff}")
  times = common.time_interleaved({"label_order": lambda: label_order(q, table, x),
                                   "leaf_order": lambda: leaf_order(q, table_leaf, x),
                                   "permute_table": lambda: permute(table, rows)}, reps=reps)
  out = {"C": num_labels, "L": int(tree.num_leaves), "leaf_block": block, "ids_equal": same,
         "max_abs_score_diff": score_diff}
  for name, t in times.items():
    out[f"{name}_ms"] = 1e3 * t["median_s"]
  out["speedup"] = out["label_order_ms"] / out["leaf_order_ms"]
  return out


def run(size: str = "small", out_dir: str | None = None) -> dict:
  cfg = SIZES[size]
  load = [round(v, 2) for v in os.getloadavg()]
  rows = [run_c(c, cfg["reps"]) for c in cfg["ks"]]
  return common.report(
      "tree_eval", size, {"N": N, "h": H, "pca_dim": PCA, "top_k": TOP_K, "row_block": ROW_BLOCK, **cfg},
      rows, ["C", "L", "label_order_ms", "leaf_order_ms", "permute_table_ms", "speedup", "ids_equal",
             "max_abs_score_diff"], None, out_dir=out_dir,
      extra={"load_average": {"before": load, "after": [round(v, 2) for v in os.getloadavg()]}})


def main(argv):
  del argv
  run(common.SIZE.value, common.OUT_DIR.value)


if __name__ == "__main__":
  common.run_main(main)
