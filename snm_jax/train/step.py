"""The jitted train step of every trained loss (`snm_jax.losses.registry`) on a (data, model) mesh.

One step, for a minibatch of N examples and B sampled negatives:
  1. sample + gather (no gradient): every model shard draws its strata's share
     of the B negatives from its own rows (`snm_jax.mining.samplers`) and
     gathers those rows and the rows of the positives it owns;
  2. loss (differentiated w.r.t. the tower and the *gathered rows*, never the
     whole table): queries from the tower, local scores, distributed top-k
     mining and the per-example loss (`snm_jax.losses.registry` -> `snm_jax.losses.sampled`), then
     the minibatch reduction: mean, or S2M's average of the top-k' losses;
  3. update: optax on the tower; a row-wise optimiser on the touched rows of
     each table shard (`snm_jax.train.row_optimizers`), shard-locally, with
     its optional decoupled decay of those rows (lazy: untouched rows are not
     decayed) at the same learning rate `table_lr(step)`.
Tower dropout (if any) uses a key folded out of the step's rng, so the
sampler's draws do not depend on it.
The cost is O((N + B) h) for the table and O(N B h / M) for scoring; nothing
is O(K). Communication per step: an all-gather of N k candidates per shard,
psums of N-vectors, and the data-parallel sum of the B gathered rows' gradients.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax

from snm_jax.losses import registry as losses_registry
from snm_jax.mining.samplers import StratifiedSampler, uniform_log_expected_count
from snm_jax.models.towers import l2_normalize, normalized_row_scores
from snm_jax.sharding import DATA, MODEL
from snm_jax.train.row_optimizers import RowOptimizer, apply_row_update

P = jax.P

# The tower's dropout key is jax.random.fold_in(rng, DROPOUT_FOLD_IN) of the
# step's rng: the sampler keeps drawing from `rng` itself, so enabling dropout
# does not change which negatives are drawn.
DROPOUT_FOLD_IN = 0x0D50


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any            # dense tower (replicated), optax-updated
  opt_state: Any
  table: jax.Array       # (K_pad, h) class embeddings, row-sharded over `model`
  table_state: Any       # row-optimiser state, leading dim K_pad
  nonfinite_steps: Any = 0         # count of steps whose loss or gradients were NaN/inf (update dropped)
  first_nonfinite_step: Any = -1   # the first such step, numbered from 1 as the logs count; -1 if none

  @classmethod
  def create(cls, *, params, opt_state, table, table_state) -> "TrainState":
    """A state at step 0 with no non-finite step seen (jit-compatible)."""
    return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, table=table,
               table_state=table_state, nonfinite_steps=jnp.zeros((), jnp.int32),
               first_nonfinite_step=jnp.full((), -1, jnp.int32))


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """Static description of the per-example loss.

  kind: "bowl" | "powl" (SNM with weights vartheta) | "sampled_softmax" |
    "full_softmax" | "logistic_ns" (Bamler & Mandt Eq. 2) | "adversarial_ns"
    (their Eq. 6, with regulariser weight `lam`; needs the tree sampler) | "nce".
  head_minus_tail, tail: vartheta split as head (first k) + constant tail.
  phi: margin surrogate (callable).
  scale: scores are multiplied by it before the loss (a softmax temperature).
  reduction: "mean" or "s2m" (average of the top-`k_prime` per-example losses).
  dense_score_grad: SNM only. False (default): when vartheta has no tail the
    k selected scores are recomputed from their gathered rows and only they
    are differentiated (O(N k h) backward). True: the gradient flows through
    all N x S scores (two O(N S h) matmuls) -- the same gradient, kept as the
    reference the benchmarks compare with.
  """
  kind: str
  phi: Callable | None = None
  head_minus_tail: tuple = ()
  tail: float = 0.0
  scale: float = 1.0
  reduction: str = "mean"
  k_prime: int = 0
  lam: float = 0.0
  dense_score_grad: bool = False


def _avg_top_k(values, mask, k):
  """Mean of the k largest valid entries (S2M, Rawat et al. 2021)."""
  from snm_jax.losses import s2m_loss  # pylint: disable=g-import-not-at-top
  return s2m_loss(values, k, mask=mask)


def _shared_valid_count(ids, label_set, num_labels):
  """Per example, how many of the shared draws `ids` (S,) are valid negatives:
  real labels (< num_labels) that are not in its `label_set` (n, L), padded < 0.

  Equals `sum(valid, -1)` of the (n, S) mask, but costs O(S log S + n L log S)
  instead of another pass over n x S: the draws are sorted once and every
  label's number of occurrences among them found by binary search.
  """
  draws = jnp.sort(ids)
  hits = (jnp.searchsorted(draws, label_set, side="right")
          - jnp.searchsorted(draws, label_set, side="left"))
  # A label listed twice in a row must be counted once, as the mask does.
  col = jnp.arange(label_set.shape[1])
  repeat = jnp.any((label_set[:, :, None] == label_set[:, None, :]) & (col[None, :] < col[:, None])[None],
                   axis=-1)
  hits = jnp.where((label_set >= 0) & ~repeat, hits, 0)
  return jnp.sum(ids < num_labels) - jnp.sum(hits, axis=-1)


def _module_has_dropout(module) -> bool:
  rates = (getattr(module, "dropout", 0.0), getattr(module, "feature_dropout", 0.0))
  return any(isinstance(r, (int, float)) and r > 0 for r in rates)


def make_train_step(*, tower_apply: Callable, tx: optax.GradientTransformation,
                    row_opt: RowOptimizer, table_lr: Callable, sampler: StratifiedSampler,
                    loss: LossSpec, mesh, normalize_classes: bool,
                    stratum_cdf: jax.Array | None = None, donate: bool = True,
                    table_rows: int | None = None, dropout: bool | None = None):
  """Builds `train_step(state, batch, rng) -> (state, metrics)`, jitted.

  batch: dict with 'feat_ids' (N, nnz), 'feat_vals' (N, nnz), 'label' (N,),
    'label_set' (N, L) padded -1, 'valid' (N,) bool, 'example_id' (N,) -- all
    sharded over `data`.
  table_lr: step -> the row optimiser's learning rate (e.g.
    `builders.make_table_schedule(config)`); the row-wise weight decay of
    `row_opt` uses the same value.
  normalize_classes: a bool (`builders.resolve_normalize_classes(config)`),
    never the config's None ("auto").
  dropout: True: the step calls `tower_apply(params, ids, vals, train=True,
    rngs={"dropout": fold_in(rng, DROPOUT_FOLD_IN)})`; False: it calls
    `tower_apply(params, ids, vals)` and draws no extra key. None (default):
    True iff `tower_apply` is a bound `apply` of a module with a nonzero
    `dropout` or `feature_dropout` field (the models of `snm_jax.models`), so
    `tower_apply=tower.apply` needs nothing more; `builders.tower_has_dropout`
    gives the same answer from the config.
  """
  if normalize_classes is None:
    raise ValueError("normalize_classes=None (config 'auto'): pass "
                     "builders.resolve_normalize_classes(config)")
  if dropout is None:
    dropout = _module_has_dropout(getattr(tower_apply, "__self__", None))
  num_model = mesh.shape[MODEL]
  num_labels = sampler.num_labels
  table_rows = table_rows or sampler.padded_labels
  # Stratified samplers draw on each model shard from its own rows; a "global"
  # sampler (the adversarial tree) draws label ids for every example outside
  # the shard_map, and each shard then scores only the draws it owns.
  stratified = getattr(sampler, "stratified", True)
  if stratified:
    if sampler.num_strata % num_model:
      raise ValueError(f"mining.num_strata={sampler.num_strata} must be a multiple of the "
                       f"mesh's model size {num_model}")
    strata_per_shard = sampler.num_strata // num_model
  per_example = sampler.per_example
  has_cdf = stratum_cdf is not None

  if not stratified:  # ids (N, S) replicated over model; rows/ownership per shard
    ids_spec, rows_spec = P(DATA, None), P(MODEL, DATA, None, None)
  elif per_example:
    ids_spec, rows_spec = P(DATA, MODEL), P(DATA, MODEL, None)
  else:
    ids_spec, rows_spec = P(MODEL), P(MODEL, None)

  # ---- 1. sample + gather ---------------------------------------------------
  def sample_gather(table_l, labels_l, example_ids_l, key, *cdf_l):
    j = jax.lax.axis_index(MODEL)
    k_loc = table_l.shape[0]
    strata = j * strata_per_shard + jnp.arange(strata_per_shard)
    cdf = cdf_l[0].reshape(strata_per_shard, -1) if has_cdf else None
    ids, log_q = sampler.sample_strata(key, strata, example_ids_l, cdf)
    # In range by construction (a shard draws from its own rows), hence "clip":
    # it skips the out-of-range masking of the default mode.
    rows = jnp.take(table_l, ids - j * k_loc, axis=0, mode="clip")
    owned = (labels_l >= j * k_loc) & (labels_l < (j + 1) * k_loc)
    pos_rows = jnp.take(table_l, labels_l - j * k_loc, axis=0, mode="clip")
    pos_rows = jnp.where(owned[:, None], pos_rows, 0.0)
    return ids, log_q, rows, pos_rows[None], owned[None]

  in_specs = (P(MODEL, None), P(DATA), P(DATA), P()) + ((P(MODEL),) if has_cdf else ())
  sample_gather_sm = jax.shard_map(
      sample_gather, mesh=mesh, in_specs=in_specs,
      out_specs=(ids_spec, ids_spec, rows_spec, P(MODEL, DATA, None), P(MODEL, DATA)))

  def gather_owned(table_l, labels_l, ids_l):
    """Global-sampler variant: rows of the drawn ids this shard owns (zeros elsewhere)."""
    j = jax.lax.axis_index(MODEL)
    k_loc = table_l.shape[0]
    local = ids_l - j * k_loc
    mine = (local >= 0) & (local < k_loc)
    rows = jnp.where(mine[..., None], jnp.take(table_l, local, axis=0, mode="clip"), 0.0)
    owned = (labels_l >= j * k_loc) & (labels_l < (j + 1) * k_loc)
    pos_rows = jnp.take(table_l, labels_l - j * k_loc, axis=0, mode="clip")
    pos_rows = jnp.where(owned[:, None], pos_rows, 0.0)
    return rows[None], pos_rows[None], owned[None]

  gather_owned_sm = jax.shard_map(
      gather_owned, mesh=mesh, in_specs=(P(MODEL, None), P(DATA), P(DATA, None)),
      out_specs=(rows_spec, P(MODEL, DATA, None), P(MODEL, DATA)))

  # ---- 2. mined loss --------------------------------------------------------
  def class_rows(rows):
    return l2_normalize(rows) if normalize_classes else rows

  def per_example_scores(q, rows):
    """(n, h) x (n, S, h) -> (n, S)."""
    return normalized_row_scores(q, rows) if normalize_classes else jnp.einsum("nh,nsh->ns", q, rows)

  def rescorer(q, rows, shared: bool):
    """idx (n, k) -> scaled scores of those draws, from their gathered rows.
    The top-k loss then differentiates k rows per example instead of all S."""
    def score_at(idx):
      picked = (jnp.take(rows, idx, axis=0, mode="clip") if shared
                else jnp.take_along_axis(rows, idx[..., None], axis=1, mode="clip"))
      return loss.scale * per_example_scores(q, picked)
    return score_at

  def mined_loss(q_l, rows_l, pos_rows_l, ids_l, log_q_l, label_set_l, log_q_pos_l):
    pos = jax.lax.psum(jnp.sum(q_l * class_rows(pos_rows_l[0]), axis=-1), MODEL)
    if not stratified:
      j = jax.lax.axis_index(MODEL)
      scores = per_example_scores(q_l, rows_l[0])
      score_at = rescorer(q_l, rows_l[0], shared=False)
      ids, log_q = ids_l, log_q_l
      # A draw belongs to the shard whose row range holds it.
      rows_per_shard = table_rows // num_model
      mine = (ids >= j * rows_per_shard) & (ids < (j + 1) * rows_per_shard)
    elif per_example:
      scores = per_example_scores(q_l, rows_l)
      score_at = rescorer(q_l, rows_l, shared=False)
      ids, log_q = ids_l, log_q_l
      mine = True
    else:
      scores = q_l @ class_rows(rows_l).T
      score_at = rescorer(q_l, rows_l, shared=True)
      ids = jnp.broadcast_to(ids_l[None], scores.shape)
      log_q = jnp.broadcast_to(log_q_l[None], scores.shape)
      mine = True
    hit = jnp.any(ids[:, :, None] == label_set_l[:, None, :], axis=-1)
    valid = (ids < num_labels) & ~hit & mine
    if stratified and not per_example:
      n_valid = _shared_valid_count(ids_l, label_set_l, num_labels)
    else:
      n_valid = jnp.sum(valid, axis=-1)
    n_valid = jax.lax.psum(n_valid, MODEL)
    pos, scores = loss.scale * pos, loss.scale * scores
    per_ex, hardest = losses_registry.get_loss(loss.kind)(
        pos, scores, valid, log_q, log_q_pos_l, spec=loss, num_samples=getattr(sampler, "num_samples", None),
        axis_name=MODEL, score_at=score_at)
    if hardest is None:  # BOWL/POWL's top-k already holds the hardest negative
      hardest = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(jnp.where(valid, scores, -jnp.inf), -1)), MODEL)
    return per_ex, pos, hardest, n_valid

  mined_loss_sm = jax.shard_map(
      mined_loss, mesh=mesh,
      in_specs=(P(DATA, None), rows_spec, P(MODEL, DATA, None), ids_spec, ids_spec, P(DATA, None),
                P(DATA)),
      out_specs=(P(DATA), P(DATA), P(DATA), P(DATA)))

  # ---- 3. shard-local sparse table update -------------------------------------
  def update_table(table_l, tstate_l, ids_l, row_grads_l, pos_grads_l, owned_l, labels_l, lr):
    j = jax.lax.axis_index(MODEL)
    k_loc = table_l.shape[0]
    h = table_l.shape[1]
    if not stratified:
      row_grads_l = row_grads_l[0]
    if per_example:  # every data shard drew its own examples' negatives
      ids_l = jax.lax.all_gather(ids_l, DATA, tiled=True)
      row_grads_l = jax.lax.all_gather(row_grads_l, DATA, tiled=True)
    pos_grads = jax.lax.all_gather(pos_grads_l[0], DATA, tiled=True)
    owned = jax.lax.all_gather(owned_l[0], DATA, tiled=True)
    labels = jax.lax.all_gather(labels_l, DATA, tiled=True)
    local = ids_l - j * k_loc
    neg_ids = jnp.where((ids_l < num_labels) & (local >= 0) & (local < k_loc), local, k_loc).reshape(-1)
    pos_ids = jnp.where(owned, labels - j * k_loc, k_loc)
    row_ids = jnp.concatenate([neg_ids, pos_ids])
    grads = jnp.concatenate([row_grads_l.reshape(-1, h), pos_grads])
    return apply_row_update(table_l, tstate_l, row_ids, grads, lr, row_opt)

  def update_table_sm(table, tstate, ids, row_grads, pos_grads, owned, labels, lr):
    tstate_specs = jax.tree.map(lambda _: P(MODEL), tstate)
    return jax.shard_map(
        update_table, mesh=mesh,
        in_specs=(P(MODEL, None), tstate_specs, ids_spec, rows_spec, P(MODEL, DATA, None),
                  P(MODEL, DATA), P(DATA), P()),
        # Every data replica of a table shard applies the same all-gathered
        # update; all_gather results are typed "varying" over `data`, hence no
        # replication check here (this map is never differentiated).
        out_specs=(P(MODEL, None), tstate_specs), check_vma=False)(table, tstate, ids, row_grads, pos_grads,
                                                   owned, labels, lr)

  def reduce(per_ex, valid):
    if loss.reduction == "s2m":
      return _avg_top_k(per_ex, valid, loss.k_prime)
    w = valid.astype(per_ex.dtype)
    return jnp.sum(per_ex * w) / jnp.maximum(jnp.sum(w), 1.0)

  def train_step(state: TrainState, batch, rng):
    if stratified:
      cdf_args = (stratum_cdf,) if has_cdf else ()
      ids, log_q, rows, pos_rows, owned = sample_gather_sm(
          state.table, batch["label"], batch["example_id"], rng, *cdf_args)
      log_q_pos = (jnp.zeros(batch["label"].shape, jnp.float32) if has_cdf or sampler.full
                   else uniform_log_expected_count(sampler, batch["label"]))
    else:
      ids, log_q, log_q_pos = sampler.draw(rng, batch["feat_ids"], batch["feat_vals"], batch["label"])
      rows, pos_rows, owned = gather_owned_sm(state.table, batch["label"], ids)

    def loss_fn(params, rows, pos_rows):
      if dropout:
        q = tower_apply(params, batch["feat_ids"], batch["feat_vals"], train=True,
                        rngs={"dropout": jax.random.fold_in(rng, DROPOUT_FOLD_IN)})
      else:
        q = tower_apply(params, batch["feat_ids"], batch["feat_vals"])
      per_ex, pos, hardest, n_valid = mined_loss_sm(q, rows, pos_rows, ids, log_q, batch["label_set"],
                                                    log_q_pos)
      per_ex = jnp.where(batch["valid"], per_ex, 0.0)
      return reduce(per_ex, batch["valid"]), (per_ex, pos, hardest, n_valid)

    (loss_value, (per_ex, pos, hardest, n_valid)), (g_params, g_rows, g_pos) = jax.value_and_grad(
        loss_fn, argnums=(0, 1, 2), has_aux=True)(state.params, rows, pos_rows)
    # A non-finite loss or gradient drops the whole update (the table gets a zero
    # gradient and step, the tower and its optimiser state are kept), so the
    # state stays the last good one; the step is counted, and the loop stops
    # (on_nonfinite="stop") or goes on within train.max_skipped_steps ("skip").
    # The tower's gradient is checked through what it produces, the updated
    # parameters and optimiser state (a NaN/inf gradient makes them non-finite):
    # a reduction over the gradient itself changes how XLA fuses its computation,
    # and with it the bits of valid runs. With finite values every where() below
    # selects the update: same bits as without the check.
    updates, opt_state = tx.update(g_params, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss_value)
    for leaf in jax.tree.leaves((g_rows, g_pos, params, opt_state)):
      finite = finite & jnp.all(jnp.isfinite(leaf))
    if isinstance(opt_state, optax.ApplyIfFiniteState):  # train.on_nonfinite="skip" wraps the optimiser
      finite = finite & opt_state.last_finite  # it zeroed a non-finite tower gradient's update itself
    g_rows = jnp.where(finite, g_rows, 0.0)
    g_pos = jnp.where(finite, g_pos, 0.0)
    keep_if_bad = lambda new, old: jnp.where(finite, new, old)  # pylint: disable=unnecessary-lambda-assignment
    params = jax.tree.map(keep_if_bad, params, state.params)
    opt_state = jax.tree.map(keep_if_bad, opt_state, state.opt_state)
    table, table_state = update_table_sm(state.table, state.table_state, ids, g_rows, g_pos,
                                         owned, batch["label"],
                                         jnp.where(finite, table_lr(state.step), 0.0))
    valid = batch["valid"].astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(valid), 1.0)
    metrics = {
        "loss": loss_value,
        "pos_score": jnp.sum(pos * valid) / denom,
        "hardest_neg_score": jnp.sum(jnp.where(batch["valid"], hardest, 0.0)) / denom,
        "valid_negatives": jnp.sum(n_valid * valid) / denom,
        "max_example_loss": jnp.max(jnp.where(batch["valid"], per_ex, -jnp.inf)),
    }
    first_bad = jnp.where((state.first_nonfinite_step < 0) & ~finite, state.step + 1,
                          state.first_nonfinite_step)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              table=table, table_state=table_state,
                              nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
                              first_nonfinite_step=first_bad)
    return new_state, metrics

  return jax.jit(train_step, donate_argnums=(0,) if donate else ())
