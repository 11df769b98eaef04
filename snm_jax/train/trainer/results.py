"""results.json of a run: one builder for a single run (`loop.train_and_evaluate`) and for a member
of a candidate group (`group.CandidateGroup`), so both leave the same record."""

from __future__ import annotations

import jax

from snm_jax.train.core.task import state_fingerprint
from snm_jax.train.runtime import compile_cache


def selection_record(progress, step: int, select_metric: str, last_test: dict) -> dict:
  """results["selected"] with a validation split: the selected step and value, the last step and
  its test metrics, and whether training stopped early."""
  return {"step": progress.best_step, "metric": select_metric, "value": progress.best_value,
          "last_step": step, "last": {k: v for k, v in last_test.items() if isinstance(v, float)},
          "stopped_early": progress.stopped_early}


def run_results(*, info: dict, steps: int, train_seconds: float, wall_seconds: float,
                nonfinite_steps: int, truncation: dict, final: dict, selected: dict, history: list,
                mesh, startup_seconds: float, compile_seconds: float | None,
                steady_steps_per_second: float | None, state=None, **extra) -> dict:
  """The results.json record; `state` given: with its `state_fingerprint`. `extra` (e.g. a group's
  "group" entry) is added as it is."""
  results = {
      **info, "steps": steps, "train_seconds": train_seconds, "wall_seconds": wall_seconds,
      "seconds_per_step": train_seconds / max(steps, 1), "nonfinite_steps": nonfinite_steps,
      "truncation": truncation, "final": final, "selected": selected, "history": history,
      "mesh": dict(mesh.shape), "num_processes": jax.process_count(),
      "train_seconds_excludes_eval": True,
      # What the start cost next to the steady steps: start-up before the loop (data, state,
      # evaluators), compilation (the first step's wall time: its compile and one step), the steps
      # per second after it, and the persistent compilation cache's hits and misses.
      "startup_seconds": startup_seconds, "compile_seconds": compile_seconds,
      "steady_steps_per_second": steady_steps_per_second, "compilation_cache": compile_cache.stats(),
      **extra,
  }
  if state is not None:
    results["state_fingerprint"] = state_fingerprint(state)
  return results
