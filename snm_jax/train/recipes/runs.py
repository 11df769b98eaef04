"""Running several configurations into sub-workdirs, reusing finished ones."""

from __future__ import annotations

from snm_jax.train.config import validation

from snm_jax.train.trainer import loop

from snm_jax.train.recipes import recipe as recipes, reuse


def train(config, workdir) -> dict:
  """One run: a recipe (config.recipe.name set: derived settings, candidates chosen on
  validation, `snm_jax.train.recipes.recipe`) or a plain `train_and_evaluate`. Every field is
  validated first (ConfigError), before any data is loaded."""
  validation.validate(config)
  if config.recipe.name:
    return recipes.run(config, workdir)
  return loop.train_and_evaluate(config, workdir)


def run_or_load(config, workdir, name: str = "") -> dict:
  """results.json of `workdir` if the run finished, else trains (resuming) and returns it."""
  return reuse.run_or_load(workdir, lambda: train(config, workdir), name, config=config)
