"""Ensembles of trained classification runs: the sum of their logits, by exact chunked top-k.

A member i scores label y as z_i(x, y) = s_i q_i(x) . w_iy: its tower's query q_i (n, h_i), its
logit scale s_i (`loss.logit_scale`), and its class row w_iy (L2-normalised when the member
normalises its classes, `builders.resolve_normalize_classes`) -- exactly the logit the member was
trained on. The ensemble of members 1..m scores

    z(x, y) = sum_i z_i(x, y) = [s_1 q_1, ..., s_m q_m](x) . [w_1y; ...; w_my],

one inner product of the CONCATENATED queries (n, sum h_i) with the concatenated class rows
(K_pad, sum h_i). It ranks labels as sum_i log softmax_y z_i(x, y) does (each member's
normaliser is a constant per query): a product of the members' softmax distributions. So the
library's exact chunked top-k retrieval (`mining/retrieval.py`, via `evaluate.make_evaluate`)
scores it as one model: no (n, K) score matrix, any K, the concatenated table row-sharded over
`model` like each member's.

`load_member` restores a finished run's selected state (`workdir/best`, the state its
`final` metrics are of); `make_ensemble` concatenates members; `make_evaluate` (as for any run)
turns the result into `evaluate(state) -> {metric: value}` on a split.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from snm_jax.errors import ConfigError
from snm_jax.models.towers import l2_normalize
from snm_jax.train.config import builders
from snm_jax.train.trainer.checkpointing import Checkpointer, abstract_like
from snm_jax.train.core.evaluate import make_evaluate
from snm_jax.train.trainer.tasks import build_task
from snm_jax.train.runtime.workpath import workdir_path


@dataclasses.dataclass(frozen=True)
class Member:
  """One trained model's logits z = scale * tower_apply(params, *inputs) @ rows.T, rows = table
  (K_pad, h), L2-normalised row-wise if `normalize` (the model's `resolve_normalize_classes`)."""
  tower_apply: Callable
  params: Any
  table: jax.Array
  scale: float = 1.0
  normalize: bool = False


@dataclasses.dataclass(frozen=True)
class EnsembleState:
  """What `evaluate.make_evaluate`'s evaluator reads from a train state: `tower_params()` and `table`."""
  params: tuple
  table: jax.Array

  def tower_params(self):
    return self.params


def check_member_config(config, field: str = "recipe.ensemble") -> None:
  """Raises ConfigError for a run whose scores are not logits the sum applies to: the retrieval
  task (SOPRC embeddings), or the adversarial loss with Eq. 5 bias removal (a per-label
  log p_n(y|x) added at prediction, which the concatenated inner product does not hold)."""
  if config.get("task", "classification") != "classification":
    raise ConfigError(field, f"ensembles sum classification logits; task={config.task!r}")
  if config.loss.kind == "adversarial_ns" and config.adversarial.debias_eval:
    raise ConfigError(field, "the adversarial loss's Eq. 5 bias removal is not an inner product: "
                      "ensembles of it are not supported")


def load_member(config, workdir, mesh, num_features: int) -> tuple[Member, dict]:
  """The selected state (`workdir/best`) of the finished run `config` trained in `workdir`
  (num_features: the data's d, which the tower is built for).

  Returns (member, {"max_nnz", "max_labels", "dense_inputs"}: how its evaluators batch a split).
  The tower is applied as the run's evaluators apply it (`classification.build`: through the
  sparse input table when the run has one)."""
  check_member_config(config)
  task = build_task(config, mesh)  # the state's structure and shardings, the batcher's widths
  best = Checkpointer(workdir_path(workdir) / "best", keep=1)
  try:
    restored = best.restore_latest(abstract_like(task.state), on_unreadable="fail")
  finally:
    best.close()
  if restored is None:
    raise FileNotFoundError(f"{workdir}/best holds no selected state (a run without validation?)")
  state = restored[1]
  tower, _ = builders.make_tower(config, num_features)
  input_table = builders.make_input_table(config, mesh)
  tower_apply = tower.apply if input_table is None else input_table.apply_fn(tower.apply)
  batcher = task.batches.batcher
  return (Member(tower_apply=tower_apply, params=state.tower_params(), table=state.table,
                 scale=float(config.loss.logit_scale),
                 normalize=builders.resolve_normalize_classes(config)),
          {"max_nnz": batcher.max_nnz, "max_labels": batcher.max_labels,
           "dense_inputs": builders.dense_inputs(config)})


def make_ensemble(members: Sequence[Member]) -> tuple[Callable, EnsembleState]:
  """(tower_apply(params, *inputs) -> (n, sum h_i) concatenated scaled queries, the state whose
  table (K_pad, sum h_i) concatenates the members' rows): q . row = sum_i z_i (module docstring)."""
  if not members:
    raise ValueError("an ensemble needs at least one member")
  rows = {m.table.shape[0] for m in members}
  if len(rows) != 1:
    raise ValueError(f"members' tables have different numbers of rows {sorted(rows)}")
  applies = tuple(m.tower_apply for m in members)
  scales = tuple(m.scale for m in members)

  def tower_apply(params, *inputs):
    return jnp.concatenate([s * f(p, *inputs) for f, s, p in zip(applies, scales, params)], axis=-1)

  normalize = tuple(m.normalize for m in members)

  def rows(tables):  # each member's rows as it scores them; along h, so the row sharding is kept
    return jnp.concatenate([l2_normalize(t) if n else t for t, n in zip(tables, normalize)], axis=1)

  table = jax.jit(rows, out_shardings=members[0].table.sharding)(tuple(m.table for m in members))
  return tower_apply, EnsembleState(params=tuple(m.params for m in members), table=table)


def make_ensemble_evaluate(config, run_data, split: str, members: Sequence[Member], batching: dict,
                           mesh, label_bias=None) -> Callable[[], dict]:
  """`evaluate() -> {metric: value}` of the ensemble of `members` on `split` ("validation" or
  "test"), with the metrics, propensities and chunking of `config` (a member's config).
  label_bias (K,): added to the summed logits of each label (`evaluate.make_evaluate`), e.g.
  Menon et al.'s post-hoc logit adjustment z(x, y) - tau log pi_y."""
  tower_apply, state = make_ensemble(members)
  # The members' scales and normalisation are in the concatenated queries and rows already; the
  # log-likelihood would need the evaluator's own logit scale, so it is not computed here.
  eval_config = config.copy_and_resolve_references()
  with eval_config.unlocked():
    eval_config.eval.log_likelihood = False
  evaluate = make_evaluate(eval_config, run_data, split, tower_apply=tower_apply, mesh=mesh,
                           normalize_classes=False, max_nnz=batching["max_nnz"],
                           max_labels=batching["max_labels"], dense_inputs=batching["dense_inputs"],
                           label_bias=label_bias)
  return lambda: evaluate(state)
