"""What the loop trains: a `Task` holds every method-specific piece of a run.

`snm_jax.train.trainer.loop.train_and_evaluate` is one loop for every method; it asks
`snm_jax.train.trainer.tasks.build_task(config, mesh)` for

  * `state`: the initial train state, a pytree with `step`, `nonfinite_steps`
    and `first_nonfinite_step` (int32 scalars; see `snm_jax.train.core.step.TrainState`),
    created with its shardings;
  * `train_step(state, batch, rng) -> (state, metrics)`: jitted, pure;
  * `batches`: an iterator of global batches with `get_state()` /
    `set_state(s)` (JSON-able, restored bit-exactly on resume) and `stats`;
  * `evaluators`: `{"test": fn, "validation": fn?}` with `fn(state) -> {metric: value}`;
  * `info`: extra `results.json` fields (dataset, number of labels, fit time);
  * `diagnostics`: optional `fn(state, step) -> {name: float}`, called every
    `diagnostics.every` steps and logged as `diag/...` (`snm_jax.train.core.diagnostics`).
  * `member_step`: optional, the unjitted `step(state, batch, rng, table_lr_scale)` that a
    candidate group vmaps over its members (`snm_jax.train.trainer.group`); None: the task's runs
    are trained one by one.

and does the rest the same way for all of them: restore, logging, evaluation and
model selection, checkpoints, non-finite handling, results.

Tasks: "classification" (extreme classification with sampled negatives:
SNM/S2M, negative sampling, sampled/full softmax, NCE, the adversarial tree
sampler; `snm_jax.train.trainer.classification`) and "retrieval" (SOPRC and the
other AUPRC losses on class-balanced embedding batches; `snm_jax.train.trainer.retrieval`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Protocol

import jax
import numpy as np

from snm_jax.train.runtime.host import to_host

TASKS = ("classification", "retrieval")  # config.task values; their builders: snm_jax.train.trainer.tasks


class Batches(Protocol):
  """A resumable iterator of global (mesh-sharded) batches."""

  def __next__(self) -> dict: ...

  def get_state(self) -> dict: ...

  def set_state(self, state: dict) -> None: ...

  @property
  def stats(self) -> dict: ...


@dataclasses.dataclass
class Task:
  state: Any
  train_step: Callable
  batches: Batches
  evaluators: dict[str, Callable]
  info: dict = dataclasses.field(default_factory=dict)
  diagnostics: Callable | None = None
  member_step: Callable | None = None


def state_fingerprint(state) -> str:
  """sha256 of every trained byte of `state`: equal fingerprints = bitwise-equal runs.

  A state may name its trained leaves by a `fingerprint_leaves()` method (the
  order is part of the fingerprint); otherwise all its leaves are hashed.
  """
  leaves = state.fingerprint_leaves() if hasattr(state, "fingerprint_leaves") else state
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(leaves):
    h.update(np.ascontiguousarray(to_host(leaf)).tobytes())
  return h.hexdigest()
