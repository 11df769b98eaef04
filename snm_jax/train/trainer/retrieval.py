"""The retrieval task (config.task="retrieval"): an embedding tower trained on
class-balanced batches with SOPRC or another AUPRC / metric-learning loss
(`snm_jax.auprc.losses`), as a `snm_jax.train.core.task.Task` for the one loop.

Data: `snm_jax.data.retrieval_tasks` (bibtex | synthetic, config.dataset.name).
Batches: `snm_jax.auprc.ClassBalancedSampler` (G classes x M items, batch `t` a
function of (seed, t) only), this process's rows as global arrays sharded over
the mesh's data axis. State: the tower's params and optimiser state, SOPRC's
auxiliary vectors (one row per class; carried by every method so the state has
one shape) and the non-finite counters. Evaluation: mAUPRC and Recall@k of the
test points querying each other (`snm_jax.metrics.embedding_retrieval_metrics`).

The SOPRC step follows Algorithm 1 of Wen et al. (NeurIPS 2022) by default
(config.auprc.soprc.aux_update="before_gradient"): the batch's within-class
scores at the current parameters w_t update the aux vector v_t -> v_{t+1}
(Eq. 10), and the gradient of Eq. 8 at w_t uses v_{t+1}. "after_gradient" is
the order of the first experiment (issue 7): the gradient uses v_t and v is
updated afterwards from the same scores. Both orders cost one forward pass.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from snm_jax import sharding
from snm_jax.auprc.aux_vector import init_aux_vector, update_aux_vector, within_group_targets
from snm_jax.auprc.losses import batch_loss, class_priors, uses_aux_vector
from snm_jax.auprc.sampling import ClassBalancedSampler
from snm_jax.data.pipeline import process_data_slice
from snm_jax.data.retrieval_tasks import make_task
from snm_jax.metrics import embedding_retrieval_metrics
from snm_jax.models.towers import EmbeddingTower
from snm_jax.train.config import builders, validation
from snm_jax.train.trainer.classification import GlobalBatches
from snm_jax.train.runtime.host import to_host
from snm_jax.train.core.nonfinite import all_finite, keep_if_finite, nonfinite_counters
from snm_jax.train.core.step import limit_traces
from snm_jax.train.core.task import Task

SCORE_RANGE = (-1.0, 1.0)  # cosine scores of the L2-normalised tower


@flax.struct.dataclass
class RetrievalState:
  step: jax.Array
  params: Any            # the embedding tower (replicated), optax-updated
  opt_state: Any
  aux: Any               # snm_jax.auprc.AuxVectorState: (C, num_aux) aux vectors, (C,) counts
  nonfinite_steps: Any = 0
  first_nonfinite_step: Any = -1

  def fingerprint_leaves(self):
    """The trained leaves, in the order `task.state_fingerprint` hashes them."""
    return (self.params, self.aux, self.opt_state)

  @classmethod
  def create(cls, *, params, opt_state, aux) -> "RetrievalState":
    return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, aux=aux,
               nonfinite_steps=jnp.zeros((), jnp.int32),
               first_nonfinite_step=jnp.full((), -1, jnp.int32))


class ClassBalancedRows(ClassBalancedSampler):
  """The sampler's batches as this process's rows {"x": (b, d), "label": (b,)}; resumable
  by the sampler's get_state / set_state."""

  def __init__(self, x_train, y_train, mesh, **sampler_kwargs):
    super().__init__(y_train, **sampler_kwargs)
    self.x_train, self.y_train = x_train, y_train
    index, count = process_data_slice(mesh)
    rows = self.batch_size // count
    self._rows = slice(index * rows, (index + 1) * rows)

  def __next__(self) -> dict:
    idx_B, _ = super().__next__()
    idx = idx_B[self._rows]
    return {"x": self.x_train[idx], "label": self.y_train[idx]}

  @property
  def stats(self) -> dict:
    return {}


def make_retrieval_step(*, tower_apply, tx: optax.GradientTransformation, method: str, cfg,
                        prior_C, eps_C, samples_per_class: int, state_shardings=None,
                        donate: bool = True, max_traces: int | None = None):
  """`train_step(state, batch, rng) -> (state, {"loss"})`, jitted.

  batch: {"x": (B, d), "label": (B,)} of a class-balanced batch, group-major (G
  groups of M = samples_per_class). cfg: config.auprc. A non-finite loss or
  update keeps the last good state and is counted (`snm_jax.train.core.nonfinite`).
  state_shardings: the state's shardings, also those of the output state (one
  compilation for the run). max_traces: as `snm_jax.train.core.step.make_train_step`.
  """
  m = samples_per_class
  with_aux = uses_aux_vector(method)
  aux_first = cfg.soprc.aux_update == "before_gradient"

  def update_aux(aux, scores_BxB, labels_B):
    values, mask = within_group_targets(scores_BxB, labels_B.shape[0] // m, m)
    return update_aux_vector(aux, labels_B[::m], values, mask, beta=cfg.soprc.beta,
                             score_range=SCORE_RANGE,
                             init_from_first_batch=cfg.soprc.init_from_first_batch)

  def train_step(state: RetrievalState, batch, rng):
    del rng  # the step draws nothing
    labels = batch["label"]

    def loss_fn(params):
      e = tower_apply(params, batch["x"])
      scores = e @ e.T
      aux = update_aux(state.aux, scores, labels) if with_aux and aux_first else state.aux
      return batch_loss(method, cfg, scores, labels, aux, prior_C, eps_C, m - 1), (scores, aux)

    (loss, (scores, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    if with_aux and not aux_first:
      aux = update_aux(state.aux, scores, labels)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = all_finite(loss, params, opt_state, aux)
    new_state = state.replace(
        step=state.step + 1, params=keep_if_finite(finite, params, state.params),
        opt_state=keep_if_finite(finite, opt_state, state.opt_state),
        aux=keep_if_finite(finite, aux, state.aux), **nonfinite_counters(state, finite))
    return new_state, {"loss": loss}

  if max_traces is not None:
    train_step = limit_traces(train_step, max_traces)
  out_shardings = None if state_shardings is None else (state_shardings, None)
  return jax.jit(train_step, donate_argnums=(0,) if donate else (), out_shardings=out_shardings)


def build(config, mesh) -> Task:
  """Data -> sampler -> step -> state -> evaluators, for `config` on `mesh`."""
  validation.validate(config)
  task = make_task(config)
  a = config.auprc
  logging.info("retrieval task %s: %s", task.name, task.description)
  rows = ClassBalancedRows(task.x_train, task.y_train, mesh, samples_per_class=a.samples_per_class,
                           batch_size=config.train.batch_size, seed=config.seed,
                           class_weighting=a.class_weighting)
  tower = EmbeddingTower(config.model.hidden, config.model.out)
  tx = builders.make_tower_optimizer(config)
  replicated = sharding.named(mesh, sharding.REPLICATED)

  # Initialised on the host (as the first experiment did), then placed replicated.
  params = tower.init(jax.random.key(config.seed), jnp.zeros((1, task.x_train.shape[1])))
  state = RetrievalState.create(params=params, opt_state=tx.init(params),
                                aux=init_aux_vector(task.num_classes, a.soprc.num_aux, SCORE_RANGE))
  shardings = jax.tree.map(lambda _: replicated, state)
  state = jax.device_put(state, shardings)

  prior_C, eps_C = class_priors(task.y_train, task.num_classes, a.soprc.prior_mul)
  train_step = make_retrieval_step(
      tower_apply=tower.apply, tx=tx, method=a.method, cfg=a,
      prior_C=jax.device_put(prior_C, replicated), eps_C=jax.device_put(eps_C, replicated),
      samples_per_class=a.samples_per_class, state_shardings=shardings, max_traces=1)

  x_test = jax.device_put(task.x_test, replicated)
  embed = jax.jit(tower.apply)

  def evaluate_test(state) -> dict:
    emb = to_host(embed(state.params, x_test))
    return embedding_retrieval_metrics(emb, task.y_test, tuple(a.recall_ks))

  return Task(state=state, train_step=train_step,
              batches=GlobalBatches(rows, mesh),
              evaluators={"test": evaluate_test},
              info={"dataset": task.name, "description": task.description, "method": a.method,
                    "num_train": int(len(task.y_train)), "num_test": int(len(task.y_test)),
                    "num_train_classes": task.num_classes})
