r"""Negative-mining throughput: sample + gather + score + top-k, in queries/s.

  python -m benchmarks.mining --size=small --out_dir=/tmp/snm_jax_bench
  python -m benchmarks.mining --size=full

For a chunk of n L2-normalised queries (n, h=128) and a class table (K, h):
  1. draw B ids with `StratifiedSampler` (V=8 strata; one shared set, or B per
     example as in Algorithm 1 of Reddi et al. 2019);
  2. gather and L2-normalise the B rows;
  3. score them (shared: one (n, h) @ (h, B) matmul; per-example: n batched
     (B, h) @ (h,) products -- memory-bound);
  4. drop accidental hits of the label set (width 4) and take the k largest
     (`snm_jax.losses.masked_top_k`), mapping positions back to label ids.
Shared sampling uses n = 1024 queries per call. Per-example sampling
materialises n x B x h gathered floats, so its chunk is the largest power of
two <= 1024 with n B h 4 bytes <= 16 MiB (n = 32 at B = 1024, 1 at B = 32768):
on this machine buffers above glibc's 32 MiB mmap threshold are fresh pages on
every call and cost ~3x more per byte (see RESULTS.md). The reported FLOP rate
counts the scoring only (2 n B h).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from snm_jax.losses import masked_top_k
from snm_jax.mining.samplers import StratifiedSampler
from snm_jax.models.towers import l2_normalize, normalized_row_scores

SIZES = {
    "small": dict(num_labels=10**5, ks=(1, 16), bs=(1024, 4096), reps=10),
    "full": dict(num_labels=10**6, ks=(1, 16, 64, 256), bs=(1024, 4096, 32768), reps=10),
}
H, NUM_STRATA, LABEL_WIDTH, SHARED_QUERIES = 128, 8, 4, 1024
PER_EXAMPLE_BYTES = 16 << 20


def per_example_chunk(b: int, h: int = H) -> int:
  n = SHARED_QUERIES
  while n > 1 and n * b * h * 4 > PER_EXAMPLE_BYTES:
    n //= 2
  return n


def make_miner(num_labels: int, b: int, k: int, per_example: bool):
  """jitted `mine(table (K, h), queries (n, h), label_set (n, L), key) -> (values, ids) (n, k)`."""
  sampler = StratifiedSampler(num_labels, b, num_strata=NUM_STRATA, per_example=per_example)
  strata = jnp.arange(NUM_STRATA, dtype=jnp.int32)

  @jax.jit
  def mine(table, queries, label_set, key):
    n = queries.shape[0]
    if per_example:
      ids_NxB, _ = sampler.sample_strata(key, strata, jnp.arange(n, dtype=jnp.int32))
      scores_NxB = normalized_row_scores(queries, jnp.take(table, ids_NxB, axis=0))  # as the step
    else:
      ids_B, _ = sampler.sample_strata(key, strata)
      rows_BxH = l2_normalize(jnp.take(table, ids_B, axis=0))
      scores_NxB = queries @ rows_BxH.T
      ids_NxB = jnp.broadcast_to(ids_B[None], scores_NxB.shape)
    hit = jnp.any(ids_NxB[:, :, None] == label_set[:, None, :], axis=-1)
    vals, _, pos = masked_top_k(scores_NxB, k, ~hit)
    return vals, jnp.take_along_axis(ids_NxB, pos, axis=-1)

  return mine


def run(size: str = "small", out_dir: str | None = None, peak: dict | None = None) -> dict:
  cfg = SIZES[size]
  peak = peak or common.matmul_peak()
  num_labels = cfg["num_labels"]
  table = common.hash_table(num_labels, H)
  rng = np.random.default_rng(0)
  rows = []
  for per_example in (False, True):
    for b in cfg["bs"]:
      n = per_example_chunk(b) if per_example else SHARED_QUERIES
      queries = l2_normalize(common.hash_table(n, H, seed=7))
      label_set = jnp.asarray(rng.integers(0, num_labels, (n, LABEL_WIDTH)).astype(np.int32))
      for k in cfg["ks"]:
        mine = make_miner(num_labels, b, k, per_example)
        compiled = mine.lower(table, queries, label_set, jax.random.key(0)).compile()
        key = jax.random.key(1)
        t = common.time_fn(lambda: compiled(table, queries, label_set, key), reps=cfg["reps"])
        rows.append({"variant": "per_example" if per_example else "shared", "B": b, "k": k,
                     "queries": n, "time_ms": 1e3 * t["median_s"], "min_ms": 1e3 * t["min_s"],
                     "queries_per_s": n / t["median_s"], "reps": t["reps"],
                     **common.gflops_row(2.0 * n * b * H, t, peak),
                     "temp_bytes": common.compiled_memory(compiled).get("temp_bytes")})
  return common.report(
      "mining", size, {**cfg, "h": H, "num_strata": NUM_STRATA, "label_width": LABEL_WIDTH,
                       "shared_queries": SHARED_QUERIES, "per_example_bytes": PER_EXAMPLE_BYTES},
      rows, ["variant", "B", "k", "queries", "time_ms", "queries_per_s", "gflops", "frac_of_peak"],
      peak, out_dir=out_dir)


def main(argv):
  del argv
  run(common.SIZE.value, common.OUT_DIR.value, common.peak_from_flags())


if __name__ == "__main__":
  common.run_main(main)
