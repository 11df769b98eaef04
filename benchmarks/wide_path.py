r"""The wide path of the linear and wide-and-deep models: dense matmuls against a sparse gather.

  python -m benchmarks.wide_path --size=full --out_dir=results/benchmarks   # Delicious, ~1 min
  python -m benchmarks.wide_path --size=small                               # seconds

The question (issue 29): the linear part of the class table, scores x W^T and its gradient G^T x
for a batch x (N, d) of sparse rows, is most of a Delicious wide-and-deep step's FLOPs, while its
rows have 19 of 500 features set on average. Would a sparse formulation be faster?

  * dense: what the train step does (`towers.densify`, then two matmuls): the batch's padded
    (N, max_nnz) rows scattered into (N, d + 1) with the bias column, scores (N, d + 1) x (d + 1, K)
    and the table's gradient (K, N) x (N, d + 1). 4 N (d + 1) K FLOPs.
  * gather: the batch's nonzeros as one flat list (no padding past the batch's own count, rounded
    up to 1,024), each one's row of W^T gathered and scaled, summed per example
    (`jax.ops.segment_sum`), and the gradient summed per feature the same way. 4 nnz K FLOPs, and
    a gather and a scatter of nnz rows of K floats each.

Both are timed round-robin on the same 8 batches in turn (`common.time_interleaved`), the gather
variant checked equal to the dense one first. Rows: Delicious's training file when it is found
(`snm_jax.data`), else random rows with its shape (d = 500, K = 983, mean nnz 19, max 320).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from snm_jax.models import towers

BATCHES = 8  # batches cycled through, so no call reuses the previous one's inputs
FLAT_ROUND = 1024


@dataclasses.dataclass(frozen=True)
class Shape:
  n: int = 512           # batch (the recipe's on Delicious)
  d: int = 500
  k: int = 983
  max_nnz: int = 320
  mean_nnz: float = 19.0


SIZES = {"small": dict(shape=Shape(n=64, k=128), reps=10), "full": dict(shape=Shape(), reps=50)}


def _rows(shape: Shape, rng) -> list[np.ndarray]:
  """Feature ids of each row: Delicious's training rows if found, else random ones of its shape."""
  try:
    from snm_jax.data import datasets  # pylint: disable=g-import-not-at-top
    x = datasets.load_dataset("delicious", "train").features.tocsr()
    if x.shape[1] == shape.d:
      return [x.indices[x.indptr[i]:x.indptr[i + 1]] for i in range(x.shape[0])], "delicious train"
  except Exception:  # pylint: disable=broad-except  (no data here: the random rows below)
    pass
  nnz = rng.poisson(shape.mean_nnz, 4096).clip(1, shape.max_nnz)
  return [rng.choice(shape.d, m, replace=False) for m in nnz], "random rows of Delicious's shape"


def _batches(shape: Shape, rows, rng) -> list[dict]:
  out = []
  for _ in range(BATCHES):
    pick = [rows[i] for i in rng.integers(0, len(rows), shape.n)]
    counts = np.array([min(len(r), shape.max_nnz) for r in pick])
    ids = np.zeros((shape.n, shape.max_nnz), np.int32)
    vals = np.zeros((shape.n, shape.max_nnz), np.float32)
    for i, r in enumerate(pick):
      ids[i, :counts[i]] = r[:shape.max_nnz]
      vals[i, :counts[i]] = rng.random(counts[i])
    total = int(counts.sum())
    cap = -(-total // FLAT_ROUND) * FLAT_ROUND
    keep = np.arange(shape.max_nnz)[None, :] < counts[:, None]
    pad = cap - total  # padding entries: value 0 at (example 0, feature 0), adding nothing
    out.append({"ids": ids, "vals": vals,
                "row": np.r_[np.nonzero(keep)[0], np.zeros(pad)].astype(np.int32),
                "feat": np.r_[ids[keep], np.zeros(pad)].astype(np.int32),
                "val": np.r_[vals[keep], np.zeros(pad)].astype(np.float32), "nnz": total})
  return out


def _programs(shape: Shape):
  n, d = shape.n, shape.d

  @jax.jit
  def dense(w, g, ids, vals):
    """w (K, d + 1), g (N, K) -> scores (N, K), table gradient (K, d + 1)."""
    x = towers.densify(ids, vals, d, bias_column=True)
    return x @ w.T, g.T @ x

  @jax.jit
  def gather(w, g, row, feat, val):
    wt = w[:, :d].T                                                 # (d, K)
    scores = jax.ops.segment_sum(wt[feat] * val[:, None], row, num_segments=n) + w[:, d]
    grad = jax.ops.segment_sum(g[row] * val[:, None], feat, num_segments=d)   # (d, K)
    return scores, jnp.concatenate([grad.T, jnp.sum(g, 0)[:, None]], axis=1)

  return dense, gather


def run(size: str, out_dir: str | None = None, peak: dict | None = None) -> dict:
  cfg = SIZES[size]
  shape = cfg["shape"]
  rng = np.random.default_rng(0)
  rows, source = _rows(shape, rng)
  batches = _batches(shape, rows, rng)
  w = jnp.asarray(rng.normal(size=(shape.k, shape.d + 1)).astype(np.float32))
  g = jnp.asarray(rng.normal(size=(shape.n, shape.k)).astype(np.float32))
  dense, gather = _programs(shape)
  dense_args = [tuple(jnp.asarray(b[f]) for f in ("ids", "vals")) for b in batches]
  gather_args = [tuple(jnp.asarray(b[f]) for f in ("row", "feat", "val")) for b in batches]
  # Different batches may differ in flat capacity: each one compiles once, before timing.
  for da, ga in zip(dense_args, gather_args):
    want, got = dense(w, g, *da), gather(w, g, *ga)
    for a, b in zip(want, got):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-3)
  def cycling(fn, args):
    batches = itertools.cycle(args)
    return lambda: fn(w, g, *next(batches))

  times = common.time_interleaved({"dense": cycling(dense, dense_args),
                                   "gather": cycling(gather, gather_args)}, reps=cfg["reps"])
  mean_nnz = float(np.mean([b["nnz"] for b in batches]))
  rows_out = []
  for name, t in times.items():
    flops = 4.0 * shape.k * (shape.n * (shape.d + 1) if name == "dense" else mean_nnz)
    row = {"variant": name, "time_ms": 1e3 * t["median_s"], "min_ms": 1e3 * t["min_s"],
           "over_dense": t["median_s"] / times["dense"]["median_s"]}
    if peak:
      row.update(common.gflops_row(flops, t, peak))
    rows_out.append(row)
  config = {**dataclasses.asdict(shape), "rows": source, "mean_batch_nnz": mean_nnz,
            "batches": BATCHES, "reps": cfg["reps"]}
  return common.report("wide_path", size, config, rows_out,
                       ["variant", "time_ms", "min_ms", "over_dense", "gflops", "frac_of_peak"],
                       peak, out_dir=out_dir,
                       notes=[f"{source}; mean nonzeros per batch {mean_nnz:.0f} of "
                              f"{shape.n * shape.d} entries"])


def main(_):
  run(common.SIZE.value, common.OUT_DIR.value, common.peak_from_flags())


if __name__ == "__main__":
  common.run_main(main)
