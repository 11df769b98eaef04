r"""The linear and wide-and-deep steps' class-table gradient in the table's own layout, before and after.

  python -m benchmarks.table_grad_layout --size=full --out_dir=results/benchmarks   # ~3 min
  python -m benchmarks.table_grad_layout --size=small                               # < 1 min

These models score queries q (N, h) against class rows (S, h) (the whole table with the full
sampler). Written as q @ rows.T, autodiff returns the rows' gradient as (h, S): the row optimiser's
update and the finiteness check then read it transposed, a strided pass over the whole table each.
The wide-and-deep step also sliced the rows into the columns of [x, 1] and those of the tower (two
copies of the table per step) and padded the two halves of the gradient back together.

  before  that product (`q @ rows.T`; for wide and deep the two products over the split columns),
          kept here as the reference;
  after   the shipped step: one dot_general contracting h (`precision.matmul_nt`, its rows'
          gradient (S, h)), and for wide and deep one product whose gradient rule differentiates the
          tower's columns only (`step._scores_constant_leading_columns`).

Each variant's whole train step is built from the same config (the recipe's candidate of that model kind,
its fields derived from the data: `step_config`) and timed round-robin with the other
(`common.time_interleaved`; every call a new batch and key), with the float32 matmul peak of the
same run. Datasets:
  delicious  Delicious's training file (d = 500, K = 983), found as the library finds it;
  xc_random  random XC-format rows shaped like EURLex-4K (15,539 points, d = 5,000, K = 3,993, 236
             nonzeros and 5.3 labels per point on average), written to a temporary folder: a
             moderate-d set, where the table is 20M floats ("small": d = 1,000, K = 500).
"""

from __future__ import annotations

import pathlib
import tempfile

import jax
import numpy as np
from benchmarks import common
from experiments.configs import xmc
from snm_jax import sharding
from snm_jax.models import precision
from snm_jax.train.config.overrides import with_overrides
from snm_jax.train.core import step as step_lib
from snm_jax.train.recipes import recipe
from snm_jax.train.trainer.run_data import load_run_data
from snm_jax.train.trainer.tasks import build_task

KINDS = ("linear", "wide_deep")
# (points, d, K, mean nonzeros, mean labels) of the random XC-format set, per --size.
XC_SHAPE = {"full": (15539, 5000, 3993, 236, 5.3), "small": (2048, 1000, 500, 40, 3.0)}
# Timed rounds: Delicious's steps take ~15 ms, the d = 5,000 set's ~0.4 s.
REPS = {"delicious": 60, "xc_random": {"full": 12, "small": 5}}


def _before(self, q, rows_Sxh):
  """`_Scorer.shared` before: q @ rows.T, the wide-and-deep columns as two products."""
  rows = self.class_rows(rows_Sxh)
  c = self.constant_columns
  if not c:
    return self.scale * precision.matmul(q, rows.T, self.dtype)
  return self.scale * (precision.matmul(jax.lax.stop_gradient(q[:, :c]), rows[:, :c].T, self.dtype)
                       + precision.matmul(q[:, c:], rows[:, c:].T, self.dtype))


VARIANTS = {"before": _before, "after": step_lib._Scorer.shared}  # pylint: disable=protected-access


def write_xc_set(folder: pathlib.Path, name: str, shape, seed: int = 0) -> None:
  """`<folder>/<name>/<name>_{train,test}.txt` in XC format: Zipf-distributed feature and label ids
  (exponents 0.9 and 1), Poisson counts per point, feature values uniform in (0, 1)."""
  n, d, k, nnz, labels = shape
  rng = np.random.default_rng(seed)
  p_feat = 1.0 / np.arange(1, d + 1) ** 0.9
  p_label = 1.0 / np.arange(1, k + 1)
  (folder / name).mkdir(parents=True, exist_ok=True)
  for split, points in (("train", n), ("test", max(n // 4, 1))):
    lines = [f"{points} {d} {k}"]
    for _ in range(points):
      feats = np.unique(rng.choice(d, max(int(rng.poisson(nnz)), 1), p=p_feat / p_feat.sum()))
      labs = np.unique(rng.choice(k, max(int(rng.poisson(labels)), 1), p=p_label / p_label.sum()))
      lines.append(",".join(map(str, labs)) + " "
                   + " ".join(f"{f}:{v:.4f}" for f, v in zip(feats, rng.random(len(feats)))))
    (folder / name / f"{name}_{split}.txt").write_text("\n".join(lines) + "\n")


def step_config(dataset: str, data_dir: str, kind: str):
  """The xmc recipe's candidate of `kind` on `dataset`: its fields derived from the data as the recipe
  derives them (`recipe.derive`), at the derived table learning rate."""
  config = with_overrides(xmc.get_config(dataset), {"dataset.data_dir": data_dir, "model.kind": kind})
  derived = recipe.derive(config, recipe.DataStats.of(load_run_data(config)))
  return with_overrides(config, {**derived, "recipe.name": "", "diagnostics.every": 0})


def time_case(dataset: str, data_dir: str, kind: str, reps: int) -> dict:
  steppers, original = {}, step_lib._Scorer.shared  # pylint: disable=protected-access
  try:
    for name, shared in VARIANTS.items():
      step_lib._Scorer.shared = shared  # pylint: disable=protected-access
      config = step_config(dataset, data_dir, kind)
      run = common.train_stepper(build_task(config, sharding.make_mesh(config.mesh.shape)))
      jax.block_until_ready(run())  # traced and compiled with this variant's product
      steppers[name] = run
  finally:
    step_lib._Scorer.shared = original  # pylint: disable=protected-access
  times = common.time_interleaved(steppers, reps=reps, warmup=2)
  row = {"dataset": dataset, "kind": kind}
  for name, t in times.items():
    row[f"{name}_ms"] = 1000 * t["median_s"]
  row["after_over_before"] = row["after_ms"] / row["before_ms"]
  return row


def run(size: str, out_dir: str | None, peak: dict) -> dict:
  rows = []
  with tempfile.TemporaryDirectory(prefix="snm_jax_xc_") as tmp:
    write_xc_set(pathlib.Path(tmp), "xc_random", XC_SHAPE[size])
    cases = [("xc_random", tmp)]
    if size == "full":
      cases.insert(0, ("delicious", ""))
    for dataset, data_dir in cases:
      for kind in KINDS:
        reps = REPS[dataset] if dataset == "delicious" else REPS[dataset][size]
        rows.append(time_case(dataset, data_dir, kind, reps))
  return common.report("table_grad_layout", size, {"xc_shape": XC_SHAPE[size], "reps": REPS}, rows,
                       ["dataset", "kind", "before_ms", "after_ms", "after_over_before"], peak,
                       out_dir=out_dir)


def main(_):
  run(common.SIZE.value, common.OUT_DIR.value, common.peak_from_flags())


if __name__ == "__main__":
  common.run_main(main)
