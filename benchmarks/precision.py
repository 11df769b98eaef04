r"""float32 vs bfloat16 train steps (model.dtype, table.dtype), timed interleaved, with the loss
agreement on the same inputs and the class table's memory.

  python -m benchmarks.precision --size=full --reps=60 --out_dir=results/benchmarks
  python -m benchmarks.precision --size=small   # seconds: a smaller d, K and B, the same code

Workload: `benchmarks.peers.Workload` (issue 17's): N = 256 rows of nnz = 64 features out of
d = 200,000, the SNM tower EmbeddingBag(d -> 512) -> ReLU -> Dense(512 -> 128) -> L2 with the
sparse input table, L2-normalised class rows (h = 128) of K = 10^5 and 10^6 labels, B = 4,096
shared uniform negatives, the top-16 BOWL hinge, SGD (tower 0.1, table 0.5); (1, 1) mesh, state
donated. Contestants, all from the same initial parameters (`peers.initial_params`; a bfloat16
table holds them rounded to nearest) on the same batch and keys:

  * float32            model.dtype=float32,  table.dtype=float32 (the default);
  * bf16_compute       model.dtype=bfloat16, table.dtype=float32;
  * bf16_table         model.dtype=float32,  table.dtype=bfloat16, stochastic rounding;
  * bf16_both          model.dtype=bfloat16, table.dtype=bfloat16, stochastic rounding;
  * bf16_both_nearest  the same with round-to-nearest (what stochastic rounding costs);
  * matmul: the float32 4096^3 matmul of `benchmarks.common`, the machine's peak in the same rounds.

Loss agreement: each contestant's first-step loss against float32's on the same batch, key and
parameters, next to the bound 2 x 2^-7 (x logit_scale = 1: cosine scores; see tests/test_bf16.py
for the derivation; the tower's own rounding adds to it), and after the `reps` timed steps (each
contestant training on its own trajectory). Memory: the class table's bytes and XLA's buffer
assignment of the compiled step (`common.compiled_memory`). Times: medians of `reps` steps, one
step of each contestant per round in rotating order (`common.time_interleaved`), so the ratios
hold on a loaded machine; the load average is recorded. On this CPU (AVX-512-BF16) bfloat16 compute
measured at parity with float32 and the bfloat16 table ~1.1x (its merged float32 update): the
memory halving of the table is the point on CPU (benchmarks/RESULTS.md, "bf16").
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import optax
from absl import flags

from benchmarks import common
from benchmarks.peers import Workload, initial_params, loss_spec
from snm_jax import sharding
from snm_jax.mining.samplers import StratifiedSampler
from snm_jax.models import precision
from snm_jax.models.towers import SNMTower
from snm_jax.train.core import row_optimizers
from snm_jax.train.core.input_table import InputTable
from snm_jax.train.core.step import SparseInputTrainState, make_train_step

SIZES = {
    "small": dict(workload=Workload(num_features=20_000, b=1024), ks=(10**4,), reps=10),
    "full": dict(workload=Workload(), ks=(10**5, 10**6), reps=20),
}
# name -> (model.dtype, the table's storage dtype (uint16: bfloat16 bits, precision.STORAGE), table.rounding)
CONTESTANTS = {
    "float32": (jnp.float32, jnp.float32, "nearest"),
    "bf16_compute": (jnp.bfloat16, jnp.float32, "nearest"),
    "bf16_table": (jnp.float32, jnp.uint16, "stochastic"),
    "bf16_both": (jnp.bfloat16, jnp.uint16, "stochastic"),
    "bf16_both_nearest": (jnp.bfloat16, jnp.uint16, "nearest"),
}
LOSS_BOUND = 2 * 2.0 ** -7  # scores-only bound at logit_scale 1 (module docstring)


class Step:
  """The project step of one contestant on a (1, 1) mesh, with the sparse input table."""

  def __init__(self, w: Workload, num_labels: int, params: dict, compute, table_dtype, rounding):
    mesh = sharding.make_mesh((1, 1), devices=jax.devices()[:1])
    kw = {} if compute == jnp.float32 else {"dtype": compute}
    tower = SNMTower(num_features=w.num_features, hidden=w.hidden, out=w.h, **kw)
    tx = optax.sgd(w.tower_lr)
    in_table = InputTable(mesh=mesh, row_opt=row_optimizers.sgd(), lr=lambda _: w.tower_lr)
    dense = {"params": {"proj": {"kernel": params["proj_kernel"], "bias": params["proj_bias"]}}}
    rep = sharding.named(mesh, sharding.REPLICATED)
    put = lambda x: jax.device_put(x, rep)  # noqa: E731
    self.state = jax.device_put(SparseInputTrainState.create(
        params=jax.tree.map(put, dense), opt_state=tx.init(dense),
        table=put(precision.to_storage(jnp.asarray(params["class_table"]), table_dtype)), table_state={},
        input_table=put(params["input_table"]), input_table_state={}), rep)
    self.step = make_train_step(
        tower_apply=tower.apply, tx=tx, row_opt=row_optimizers.sgd(), table_lr=lambda _: w.table_lr,
        sampler=StratifiedSampler(num_labels, w.b, num_strata=w.num_strata),
        loss=loss_spec(w, num_labels), mesh=mesh, normalize_classes=True, donate=True,
        input_table=in_table, compute_dtype=compute, table_rounding=rounding)
    self.put = lambda b: {k: jax.device_put(v, sharding.named(mesh, jax.P(sharding.DATA)))  # noqa: E731
                          for k, v in b.items()}
    self.table_bytes = int(self.state.table.nbytes)

  def memory(self, batch, key) -> dict:
    return common.compiled_memory(self.step.lower(self.state, batch, key).compile())

  def free(self):
    jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) and not x.is_deleted() else None,
                 self.state)


def run_k(w: Workload, num_labels: int, reps: int) -> tuple[list, dict]:
  params = initial_params(w, num_labels)
  raw = common.random_batch(w, num_labels)
  steps, fns, first, batches = {}, {}, {}, {}
  key = jax.random.key(1)
  for name, (compute, table_dtype, rounding) in CONTESTANTS.items():
    s = Step(w, num_labels, params, compute, table_dtype, rounding)
    batch = s.put(raw)
    mem = s.memory(batch, key)
    s.state, metrics = s.step(s.state, batch, key)  # the first step: same parameters, batch, key
    first[name] = float(metrics["loss"])
    steps[name], batches[name] = (s, mem), batch

    def run(s=s, batch=batch, step_key=jax.random.key(2)):
      s.state, m = s.step(s.state, batch, step_key)
      s.last_loss = m["loss"]
      return s.state.table
    fns[name] = run
  fns["matmul"], mm_flops = common.matmul_fn()
  times = common.time_interleaved(fns, reps=reps)
  peak = common.peak_from_times(times.pop("matmul"), mm_flops)
  base = times["float32"]["median_s"]
  rows = []
  for name, t in times.items():
    s, mem = steps[name]
    compute, table_dtype, rounding = CONTESTANTS[name]
    rows.append({
        "contestant": name, "K": num_labels, "model_dtype": jnp.dtype(compute).name,
        "table_dtype": "bfloat16" if table_dtype == jnp.uint16 else "float32", "rounding": rounding,
        "time_ms": 1e3 * t["median_s"], "min_ms": 1e3 * t["min_s"], "max_ms": 1e3 * t["max_s"],
        "over_float32": t["median_s"] / base, "min_over_float32": t["min_s"] / times["float32"]["min_s"],
        "reps": t["reps"],
        "first_loss": first[name], "first_loss_abs_diff": abs(first[name] - first["float32"]),
        "last_loss": float(s.last_loss), "table_mb": s.table_bytes / 2**20,
        "step_peak_mb": mem.get("peak_bytes", 0) / 2**20, "step_temp_mb": mem.get("temp_bytes", 0) / 2**20})
  for s, _ in steps.values():
    s.free()
  return rows, peak


def run(size: str = "small", out_dir: str | None = None, reps: int = 0) -> dict:
  cfg = {**SIZES[size], **({"reps": reps} if reps else {})}
  w = cfg["workload"]
  load_before = [round(x, 2) for x in os.getloadavg()]
  rows, peaks = [], {}
  for k in cfg["ks"]:
    r, peaks[k] = run_k(w, k, cfg["reps"])
    rows += r
  summary = {}
  for k in cfg["ks"]:
    by = {r["contestant"]: r for r in rows if r["K"] == k}
    summary[f"K{k}"] = {
        "bf16_both_over_float32": by["bf16_both"]["over_float32"],
        "bf16_compute_over_float32": by["bf16_compute"]["over_float32"],
        "bf16_table_over_float32": by["bf16_table"]["over_float32"],
        "stochastic_over_nearest": by["bf16_both"]["time_ms"] / by["bf16_both_nearest"]["time_ms"],
        "table_mb": {"float32": by["float32"]["table_mb"], "bfloat16": by["bf16_table"]["table_mb"]},
        "max_first_loss_abs_diff": max(r["first_loss_abs_diff"] for r in by.values()),
        "loss_bound_scores_only": LOSS_BOUND}
  notes = ["bfloat16 compute buys no time on this CPU (the step is not matmul-bound); the bfloat16 "
           "table halves the table's memory for its merged float32 update"]
  return common.report(
      "precision", size, {**dataclasses.asdict(w), "ks": cfg["ks"], "reps": cfg["reps"],
                          "contestants": {n: [jnp.dtype(c).name, jnp.dtype(t).name, r]
                                          for n, (c, t, r) in CONTESTANTS.items()}},
      rows, ["contestant", "K", "time_ms", "over_float32", "first_loss", "first_loss_abs_diff",
             "last_loss", "table_mb", "step_temp_mb"],
      {"gflops": min(p["gflops"] for p in peaks.values()), "per_K": peaks,
       "source": "the matmul timed in the same rounds"}, notes, out_dir,
      extra={"summary": summary,
             "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]}})


def main(argv):
  del argv
  payload = run(common.SIZE.value, common.OUT_DIR.value, flags.FLAGS.reps)
  print("summary:", payload["summary"], "load average:", payload["load_average"])


if __name__ == "__main__":
  # Defined here, not at import: other benchmark modules define a "reps" flag of their own.
  flags.DEFINE_integer("reps", 0, "Timed rounds per K (0: the size's default).")
  common.run_main(main)
