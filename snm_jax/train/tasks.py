"""`build_task(config, mesh)`: the `Task` (`snm_jax.train.task`) that `config.task` names."""

from __future__ import annotations

from snm_jax.errors import ConfigError
from snm_jax.train import classification
from snm_jax.train.task import Task

BUILDERS = {
    "classification": classification.build,  # sampled-negative extreme classification
}


def build_task(config, mesh) -> Task:
  """The task `config.task` names (default "classification"), built on `mesh`."""
  kind = config.get("task", "classification")
  if kind not in BUILDERS:
    raise ConfigError("task", f"{kind!r} is not one of {sorted(BUILDERS)}")
  return BUILDERS[kind](config, mesh)
