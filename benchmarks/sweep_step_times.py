r"""Step time of every point of a sweep, interleaved: the exchange rate of an equal-time budget.

  python -m benchmarks.sweep_step_times --sweep=experiments/sweeps/large_k.py:1e5 \
      --out=results/large_k/step_times_1e5.json

Builds each point's task (seed 0: data, sampler, state, step; the data is loaded once and shared,
and the adversarial tree is fitted with one re-assignment round, since a step's cost depends on
the tree's depth, not on how well it fits) and times one train step of each (its batch included,
as in the loop) round-robin, `--reps` rounds after `--warmup` steps, with the float32 matmul peak
measured in the same run. Writes the median ms per step of each point; `experiments/sweeps/large_k.py`
turns them into each method's number of steps.
"""

from __future__ import annotations

import json
import os
import time

from absl import flags, logging

from benchmarks import common
from experiments.sweeps.spec import apply_overrides, load_config, load_sweep
from snm_jax import sharding
from snm_jax.train.trainer import classification
from snm_jax.train.trainer.tasks import build_task

_SWEEP = flags.DEFINE_string("sweep", None, "experiments/sweeps/<name>.py[:arg]", required=True)
_OUT = flags.DEFINE_string("out", None, "JSON file to write.", required=True)
_REPS = flags.DEFINE_integer("reps", 20, "Timed rounds (one step of every point per round).")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps of each point first (compilation).")
_ONLY = flags.DEFINE_list("only", None, "Time only these points.")
_REFERENCE = flags.DEFINE_string(
    "reference", None, "Add --only points to the existing --out file: time them interleaved with this "
    "point (already in the file) and scale by its recorded time, ms = ms_file[ref] x t / t[ref]: a "
    "ratio measured in one run, so a later, busier run still fits the file's scale.")


def _shared_run_data():
  """Memoises `load_run_data` by the dataset section: every point of a sweep trains on the same data
  (a sweep's points differ in method, not data), and generating it per point would dominate."""
  load, cache = classification.load_run_data, {}

  def cached(config):
    key = config.dataset.to_json_best_effort(sort_keys=True)
    if key not in cache:
      cache[key] = load(config)
    return cache[key]

  return cached


def main(argv):
  del argv
  sweep = load_sweep(_SWEEP.value)
  wanted = set(_ONLY.value or ()) | ({_REFERENCE.value} if _REFERENCE.value else set())
  points = [p for p in sweep.points if not wanted or p.name in wanted]
  classification.load_run_data = _shared_run_data()
  steppers = {}
  for point in points:
    config = load_config(sweep.config)
    apply_overrides(config, {**sweep.run_overrides(point, 0), "adversarial.max_reassign_iters": 1,
                             "diagnostics.every": 0})
    mesh = sharding.make_mesh(config.mesh.shape)
    t0 = time.perf_counter()
    steppers[point.name] = common.train_stepper(build_task(config, mesh))
    logging.info("built %s in %.1fs", point.name, time.perf_counter() - t0)
  peak = common.matmul_peak()
  times = common.time_interleaved(steppers, reps=_REPS.value, warmup=_WARMUP.value)
  peak_after = common.matmul_peak()
  payload = {
      "sweep": sweep.name, "ms_per_step": {n: 1000 * t["median_s"] for n, t in times.items()},
      "times": times, "reps": _REPS.value, "warmup": _WARMUP.value,
      "matmul_peak_gflops_before": peak["gflops"], "matmul_peak_gflops_after": peak_after["gflops"],
      "load_average": os.getloadavg(), "machine": common.machine_description(),
      "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
  }
  if _REFERENCE.value:
    ref = _REFERENCE.value
    saved = json.loads(open(_OUT.value).read())
    scale = saved["ms_per_step"][ref] / payload["ms_per_step"][ref]
    added = {n: ms * scale for n, ms in payload["ms_per_step"].items() if n != ref}
    saved["ms_per_step"].update(added)
    saved.setdefault("added_by_reference", []).append({**payload, "reference": ref, "scale": scale,
                                                       "added": added})
    payload = saved
  out = common.write_json(os.path.dirname(_OUT.value) or ".", os.path.basename(_OUT.value)[:-5], payload)
  print(json.dumps(payload["ms_per_step"], indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  common.run_main(main)
