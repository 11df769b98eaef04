"""Reusing finished runs: a workdir holding results.json is read back instead of retrained.

The one implementation behind `runs.run_or_load` (demo, sweeps of whole configs)
and the recipes' candidates (`recipes.run`); it imports neither, so both can
import it.
"""

from __future__ import annotations

import json
from typing import Callable

from snm_jax.train.trainer import checkpointing
from snm_jax.train.runtime.workpath import workdir_path


def _say(message: str) -> None:
  print(message, flush=True)


def run_or_load(workdir, train: Callable[[], dict], name: str = "",
                log: Callable[[str], None] = _say, config=None) -> dict:
  """results.json of `workdir` if the run finished there, else `train()` (which resumes from the
  workdir's checkpoints). `log` gets one line saying which. With `config`, a finished run whose
  config.json differs from it in a field that changes results raises ConfigError
  (`checkpointing.check_finished_config`) instead of being reused."""
  workdir = workdir_path(workdir)
  done = workdir / "results.json"
  name = name or workdir.name
  if done.exists() and config is not None and (workdir / "config.json").exists():
    checkpointing.check_finished_config(json.loads((workdir / "config.json").read_text()),
                                        json.loads(config.to_json_best_effort()), workdir)
  if done.exists():
    log(f"[{name}] reusing {done}")
    return json.loads(done.read_text())
  log(f"[{name}] training -> {workdir}")
  return train()
