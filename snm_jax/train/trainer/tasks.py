"""`build_task(config, mesh)`: the `Task` (`snm_jax.train.core.task`) that `config.task` names."""

from __future__ import annotations

from snm_jax.errors import ConfigError
from snm_jax.train.trainer import classification, retrieval
from snm_jax.train.core.task import TASKS, Task

# config.task -> the module whose `build(config, mesh) -> Task` makes it.
BUILDERS = {
    "classification": classification,  # sampled-negative extreme classification
    "retrieval": retrieval,            # SOPRC and AUPRC baselines on class-balanced batches
}

assert set(BUILDERS) == set(TASKS), "every config.task value needs a builder"


def build_task(config, mesh) -> Task:
  """The task `config.task` names (default "classification"), built on `mesh`."""
  kind = config.get("task", "classification")
  if kind not in BUILDERS:
    raise ConfigError("task", f"{kind!r} is not one of {sorted(BUILDERS)}")
  return BUILDERS[kind].build(config, mesh)
