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
     each table shard (`snm_jax.train.core.row_optimizers`), shard-locally, with
     its optional decoupled decay of those rows (lazy: untouched rows are not
     decayed) at the same learning rate `table_lr(step)`.
With a sparse input table (`input_table`, model.input_update="sparse") the
tower's EmbeddingBag table is handled like the class table: the tower's bag is
summed from the rows of the batch's feature ids, the loss is differentiated
w.r.t. the bag vectors (N, hidden), and in step 3 only those rows are updated
(`snm_jax.train.core.input_table`); optax keeps the dense layers.
Tower dropout (if any) uses a key folded out of the step's rng, so the
sampler's draws do not depend on it.
Reduced precision (`snm_jax.models.precision`): with a compute dtype (model.dtype)
the scores multiply queries and gathered rows in it, accumulating in float32, and
the loss is float32; a bfloat16 class table (table.dtype) is gathered into float32
rows and its updated rows are rounded back (nearest, or stochastically with a key
folded out of the step's rng: ROUNDING_FOLD_IN).
The cost is O((N + B) h) for the table and O(N B h / M) for scoring; nothing
is O(K). Communication per step: an all-gather of N k candidates per shard,
psums of N-vectors, and the data-parallel sum of the B gathered rows' gradients.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax
import jax
import jax.numpy as jnp
import optax

import snm_jax.losses as losses_lib
from snm_jax.losses import registry as losses_registry
from snm_jax.mining import negatives as negatives_lib
from snm_jax.models import precision
from snm_jax.models.towers import l2_normalize, normalized_row_scores, tower_inputs
from snm_jax.sharding import BATCH, DATA, MODEL, TABLE
from snm_jax.train.core.input_table import InputTable, SparseTowerParams, bag_values
from snm_jax.train.core.nonfinite import all_finite
from snm_jax.train.core.row_optimizers import RowOptimizer, apply_row_update

P = jax.P

# The tower's dropout key is jax.random.fold_in(rng, DROPOUT_FOLD_IN) of the
# step's rng: the sampler keeps drawing from `rng` itself, so enabling dropout
# does not change which negatives are drawn.
DROPOUT_FOLD_IN = 0x0D50
# The stochastic rounding of a bfloat16 table's updated rows draws from fold_in(rng, ROUNDING_FOLD_IN).
ROUNDING_FOLD_IN = 0x0B16


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any            # dense tower (replicated), optax-updated
  opt_state: Any
  table: jax.Array       # (K_pad, h) class embeddings, row-sharded over `model`
  table_state: Any       # row-optimiser state, leading dim K_pad
  nonfinite_steps: Any = 0         # count of steps whose loss or gradients were NaN/inf (update dropped)
  first_nonfinite_step: Any = -1   # the first such step, numbered from 1 as the logs count; -1 if none

  def fingerprint_leaves(self):
    """The trained leaves, in the order `task.state_fingerprint` hashes them."""
    return (self.params, self.table, self.table_state, self.opt_state)

  def tower_params(self):
    """What the evaluators' and diagnostics' `tower_apply` takes: the tower's parameters."""
    return self.params

  @classmethod
  def create(cls, *, params, opt_state, table, table_state, **extra) -> "TrainState":
    """A state at step 0 with no non-finite step seen (jit-compatible); `extra`: a subclass's fields."""
    return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, table=table,
               table_state=table_state, nonfinite_steps=jnp.zeros((), jnp.int32),
               first_nonfinite_step=jnp.full((), -1, jnp.int32), **extra)


@flax.struct.dataclass
class SparseInputTrainState(TrainState):
  """The state with a sparse input table (model.input_update="sparse", `snm_jax.train.core.input_table`):
  `params` lacks the tower's EmbeddingBag table, which is held here. A subclass, so that the dense
  path's state (and its checkpoints and fingerprints) keeps its former pytree."""
  input_table: Any = None        # (d_pad, hidden) the EmbeddingBag's rows, row-sharded over `model`
  input_table_state: Any = None  # its row-optimiser state, leading dim d_pad

  def fingerprint_leaves(self):
    return super().fingerprint_leaves() + (self.input_table, self.input_table_state)

  def tower_params(self):
    """`SparseTowerParams`, what `InputTable.apply_fn(tower.apply)` takes."""
    return SparseTowerParams(self.params, self.input_table)


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """Static description of the per-example loss.

  kind: "bowl" | "powl" (SNM with weights vartheta) | "sampled_softmax" |
    "mined_softmax" (sampled softmax, gradient to the `mined_k` hardest draws only) |
    "full_softmax" | "logistic_ns" (Bamler & Mandt Eq. 2) | "adversarial_ns"
    (their Eq. 6, with regulariser weight `lam`; needs the tree sampler) | "nce".
  head_minus_tail, tail: vartheta split as head (first k) + constant tail.
  phi: margin surrogate (callable).
  logit_scale: scores are multiplied by it before the loss (an inverse softmax temperature).
  reduction: "mean" or "s2m" (average of the top-`k_prime` per-example losses).
  mask_accidental_hits: drop sampled negatives equal to one of the example's
    positives (`label_set`). None: the loss's own convention
    (`losses.registry.masks_accidental_hits`: True for SNM and the softmaxes,
    False for logistic_ns / adversarial_ns / nce, whose Eq. 2 / Eq. 6 / NCE draw
    y' ~ p_n over all labels).
  dense_score_grad: SNM and mined_softmax. False (default): when vartheta has no tail the
    k selected scores are recomputed from their gathered rows and only they
    are differentiated (O(N k h) backward). True: the gradient flows through
    all N x S scores (two O(N S h) matmuls) -- the same gradient, kept as the
    reference the benchmarks compare with.
  mined_k: mined_softmax only: k, how many sampled negatives (the largest
    corrected logits) receive gradient (`losses.sampled.mined_softmax_loss`).
  """
  kind: str
  phi: Callable | None = None
  head_minus_tail: tuple = ()
  tail: float = 0.0
  logit_scale: float = 1.0
  reduction: str = "mean"
  k_prime: int = 0
  lam: float = 0.0
  dense_score_grad: bool = False
  mask_accidental_hits: bool | None = None
  mined_k: int = 0


def _module_has_dropout(module) -> bool:
  rates = (getattr(module, "dropout", 0.0), getattr(module, "feature_dropout", 0.0))
  return any(isinstance(r, (int, float)) and r > 0 for r in rates)


def _varying_axes(x) -> set:
  """The mesh axes x varies over inside shard_map (empty outside): `.mat.varying` of its type in
  jax 0.10, `.vma` before."""
  t = jax.typeof(x)
  return set(t.mat.varying) if hasattr(t, "mat") else set(getattr(t, "vma", ()))


def _varying_like(x, other):
  """x made varying over the mesh axes `other` varies over: what autodiff does implicitly before
  a product of the two, and whose transpose (a psum) sums x's cotangent over those axes. A
  custom_vjp needs it explicitly, as its cotangents must have its inputs' types."""
  missing = tuple(sorted(_varying_axes(other) - _varying_axes(x)))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _scores_constant_leading_columns(q_const, q_tail, rows, c: int):
  """[q_const, q_tail] @ rows.T, (n, c) and (n, h - c) x (S, h) -> (n, S), for a query whose first
  c columns depend on no parameter ([x, 1] of the wide-and-deep query; the caller stops their
  gradient): one product forward; backward, the tail's cotangent g @ rows[:, c:] (an n x S x
  (h - c) product) and the rows' one g.T @ q. Autodiff of the one product would compute the
  n x S x h cotangent and drop most of it; as two products (the columns split), the table is
  sliced into two copies for the forward pass and the rows' cotangent assembled from two padded
  halves, every step. The constant columns take no cotangent, so none is padded to the query's
  width or summed over the mesh (on one device XLA still runs that sum: 0.5 ms of Delicious's
  wide-and-deep step, with 0.6 ms for the padding)."""
  return precision.matmul_nt(jnp.concatenate([q_const, q_tail], axis=1), rows, jnp.float32)


def _scores_constant_leading_columns_fwd(q_const, q_tail, rows, c):
  del c  # q_const's width
  q = jnp.concatenate([q_const, q_tail], axis=1)
  return precision.matmul_nt(q, rows, jnp.float32), (q, rows)


def _scores_constant_leading_columns_bwd(c, residuals, g):
  q, rows = residuals
  # q_const's cotangent is zeros that nothing reads (its gradient is stopped): XLA drops them.
  return jnp.zeros_like(q[:, :c]), g @ rows[:, c:], g.T @ q  # rows': (S, h), their layout


_scores_constant_leading_columns.defvjp(_scores_constant_leading_columns_fwd,
                                        _scores_constant_leading_columns_bwd)


@dataclasses.dataclass(frozen=True)
class _Scorer:
  """Scaled scores of queries q (n, h) against gathered (float32) class rows (cosines if
  normalised); the factors of every product are in `dtype`, summed in float32."""
  scale: float
  normalize_classes: bool
  dtype: Any = jnp.float32
  constant_columns: int = 0  # the query's leading columns that depend on no parameter

  def class_rows(self, rows):
    return l2_normalize(rows) if self.normalize_classes else rows

  def positive(self, q, rows_nxh):  # -> (n,) unscaled: each query against its own row
    if precision.is_reduced(self.dtype):  # the factors rounded as a matmul in dtype rounds them
      q, rows_nxh = (x.astype(self.dtype).astype(jnp.float32) for x in (q, self.class_rows(rows_nxh)))
      return jnp.sum(q * rows_nxh, axis=-1)
    return jnp.sum(q * self.class_rows(rows_nxh), axis=-1)

  def shared(self, q, rows_Sxh):  # -> (n, S)
    rows = self.class_rows(rows_Sxh)
    c = self.constant_columns
    if not c:
      return self.scale * precision.matmul_nt(q, rows, self.dtype)
    if not precision.is_reduced(self.dtype):
      q_const = jax.lax.stop_gradient(q[:, :c])
      return self.scale * _scores_constant_leading_columns(
          _varying_like(q_const, rows), _varying_like(q[:, c:], rows), _varying_like(rows, q), c)
    # In a reduced compute dtype, as two products: only the tower's columns are differentiated
    # (as one, autodiff would compute the query's cotangent for all h columns, an n x S x h matmul,
    # the largest of the wide-and-deep step, and drop the constant ones). The same sum, in another
    # order. Its float32 rule above does the same in one product, without slicing the rows.
    return self.scale * (precision.matmul_nt(jax.lax.stop_gradient(q[:, :c]), rows[:, :c], self.dtype)
                         + precision.matmul_nt(q[:, c:], rows[:, c:], self.dtype))

  def each(self, q, rows_nxSxh):  # -> (n, S)
    return self.scale * (normalized_row_scores(q, rows_nxSxh, dtype=self.dtype) if self.normalize_classes
                         else precision.einsum("nh,nsh->ns", q, rows_nxSxh, self.dtype))


class LossAndGrads(NamedTuple):
  """What one forward/backward pass of the step computes (before any update)."""
  loss: jax.Array         # () the minibatch loss (mean or S2M)
  per_example: jax.Array  # (N,) per-example losses, 0 at invalid examples
  pos: jax.Array          # (N,) scaled positive scores
  hardest: jax.Array      # (N,) the hardest valid sampled negative's score
  n_valid: jax.Array      # (N,) valid sampled negatives per example
  g_params: Any           # gradient of the tower's parameters
  g_rows: jax.Array       # gradient of the gathered rows (`negatives.rows_spec`)
  g_pos: jax.Array        # (M, N, h) gradient of the positives' rows, per owning shard
  draws: negatives_lib.Draws
  g_input: Any = None     # (N, hidden) gradient of the tower's bag vectors (sparse input table)
  input_values: Any = None  # (N, nnz) the values the bag was called with (after feature dropout)


def make_loss_and_grads(*, tower_apply: Callable, sampler, loss: LossSpec, mesh, normalize_classes: bool,
                        stratum_cdf: jax.Array | None = None, table_rows: int | None = None,
                        dropout: bool | None = None, input_table: InputTable | None = None,
                        compute_dtype=jnp.float32):
  """Builds `loss_and_grads(params, table, batch, rng) -> (LossAndGrads, negatives layout)`:
  steps 1 and 2 of the module docstring (sample + gather, score + loss, backward),
  unjitted, so the train step and the diagnostics (`snm_jax.train.core.diagnostics`)
  share them. Arguments as in `make_train_step`; with `input_table`, `params` is a
  `SparseTowerParams` (the state's `tower_params()`) and its table's gradient is given
  as that of the bag vectors, `g_input`, with the bag's `input_values`. compute_dtype: the
  scores' (model.dtype; the tower's own is set on its module, `builders.make_tower`)."""
  if normalize_classes is None:
    raise ValueError("normalize_classes=None (config 'auto'): pass "
                     "builders.resolve_normalize_classes(config)")
  if dropout is None:
    dropout = _module_has_dropout(getattr(tower_apply, "__self__", None))
  negatives = negatives_lib.for_sampler(sampler, mesh, stratum_cdf, table_rows)
  constant_columns = getattr(getattr(tower_apply, "__self__", None), "constant_query_columns", 0)
  scorer = _Scorer(loss.logit_scale, normalize_classes, compute_dtype, constant_columns)
  per_example_loss = losses_registry.get_loss(loss.kind)
  mask_hits = losses_registry.masks_accidental_hits(loss.kind, loss.mask_accidental_hits)

  # ---- 2. score + loss, per model shard -------------------------------------
  def sharded_loss(q_l, rows_l, pos_rows_l, ids_l, log_q_l, label_set_l, log_q_pos_l, labels_l):
    scores, score_at, ids, log_q, mine = negatives.local_scores(q_l, rows_l, ids_l, log_q_l, scorer)
    if negatives.positives_in_scores:  # the full sampler: the positive is one of the scored rows
      pos = jax.lax.psum(negatives_lib.positive_column(scores, labels_l), MODEL)
    else:
      pos = loss.logit_scale * jax.lax.psum(scorer.positive(q_l, pos_rows_l[0]), MODEL)
    excluded = label_set_l if mask_hits else jnp.full_like(label_set_l, -1)  # padding excludes nothing
    hit = negatives.hits(ids, excluded)
    valid = (ids < negatives.num_labels) & ~hit & mine
    n_valid = jax.lax.psum(negatives.valid_count(valid, ids_l, excluded), MODEL)
    per_ex, hardest = per_example_loss(pos, scores, valid, log_q, log_q_pos_l, spec=loss,
                                       num_samples=negatives.num_samples, axis_name=MODEL,
                                       score_at=score_at)
    if hardest is None:  # BOWL/POWL's top-k already holds the hardest negative
      hardest = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(jnp.where(valid, scores, -jnp.inf), -1)), MODEL)
    return per_ex, pos, hardest, n_valid

  sharded_loss = jax.shard_map(
      sharded_loss, mesh=mesh,
      in_specs=(P(DATA, None), negatives.rows_spec, P(MODEL, DATA, None), negatives.ids_spec,
                negatives.ids_spec, P(DATA, None), BATCH, BATCH),
      out_specs=(BATCH, BATCH, BATCH, BATCH))

  def reduce(per_ex, valid):
    if loss.reduction == "s2m":  # Rawat et al. 2021: the mean of the top-k' per-example losses
      return losses_lib.s2m_loss(per_ex, loss.k_prime, mask=valid)
    w = valid.astype(per_ex.dtype)
    return jnp.sum(per_ex * w) / jnp.maximum(jnp.sum(w), 1.0)

  def loss_and_grads(params, table, batch, rng) -> LossAndGrads:
    # ---- 1. sample + gather (no gradient) -------------------------------------
    draws = negatives.draw_and_gather(table, batch, rng)
    delta = None  # sparse input table: the bag vectors' zero offset, differentiated
    if input_table is not None:
      in_table, params = params.input_table, params.params
      delta = input_table.zero_delta(in_table, batch["feat_ids"])

    def loss_fn(params, rows, pos_rows, delta):
      kw = {}
      if delta is not None:
        kw = {"bag_fn": input_table.bag_fn(in_table, delta), "mutable": ["intermediates"]}
      if dropout:
        q = tower_apply(params, *tower_inputs(batch), train=True,
                        rngs={"dropout": jax.random.fold_in(rng, DROPOUT_FOLD_IN)}, **kw)
      else:
        q = tower_apply(params, *tower_inputs(batch), **kw)
      q, values = (q, None) if delta is None else (q[0], bag_values(q[1]["intermediates"]))
      per_ex, pos, hardest, n_valid = sharded_loss(q, rows, pos_rows, draws.ids, draws.log_q,
                                                   batch["label_set"], draws.log_q_pos, batch["label"])
      per_ex = jnp.where(batch["valid"], per_ex, 0.0)
      return reduce(per_ex, batch["valid"]), (per_ex, pos, hardest, n_valid, values)

    (loss_value, (*aux, values)), (g_params, g_rows, g_pos, g_input) = jax.value_and_grad(
        loss_fn, argnums=(0, 1, 2, 3), has_aux=True)(params, draws.rows, draws.pos_rows, delta)
    return LossAndGrads(loss_value, *aux, g_params, g_rows, g_pos, draws, g_input, values)

  return loss_and_grads, negatives


def make_train_step(*, tower_apply: Callable, tx: optax.GradientTransformation,
                    row_opt: RowOptimizer, table_lr: Callable, sampler, loss: LossSpec, mesh,
                    normalize_classes: bool, stratum_cdf: jax.Array | None = None, donate: bool = True,
                    table_rows: int | None = None, dropout: bool | None = None, max_traces: int | None = None,
                    input_table: InputTable | None = None, compute_dtype=jnp.float32,
                    table_rounding: str = "nearest", member: bool = False):
  """Builds `train_step(state, batch, rng) -> (state, metrics)`, jitted.

  sampler: a `StratifiedSampler` or a global sampler (the adversarial tree,
    `ExactSampler`: any object with `draw(key, batch)`);
    `snm_jax.mining.negatives.for_sampler` gives its layout on the mesh.
  batch: dict with 'feat_ids' (N, nnz), 'feat_vals' (N, nnz) (or 'features' (N, d) for a
    dense tower: `towers.tower_inputs`), 'label' (N,),
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
    `dropout` or `feature_dropout` field (the models of `snm_jax.models`).
  max_traces: if set, the step raises when traced (compiled) more often; the
    loop passes 1: its state is created with the step's output shardings, so
    one compilation serves the whole run. (A state built on the host, as in
    tests, is traced once more after the first step commits it to devices.)
  input_table: an `InputTable` (model.input_update="sparse"): the state is a
    `SparseInputTrainState`, `tower_apply` takes a `bag_fn` (`towers.SNMTower`), and the
    input table's touched rows get `input_table.row_opt` at `input_table.lr(step)`.
  compute_dtype: the scores' factors (model.dtype, `make_loss_and_grads`). table_rounding:
    "nearest" | "stochastic", how updated rows are written into a table narrower than float32
    (the state's `table.dtype`; `precision.round_rows`); float32 tables ignore it.
  member: True returns the step of one member of a candidate group (`snm_jax.train.trainer.group`),
    unjitted, for the group to `vmap` and jit: `train_step(state, batch, rng, table_lr_scale)`, the
    table's learning rate `table_lr(step) * table_lr_scale` (a traced scalar, so members with
    different rates share one program; with table_lr the unit-rate schedule this is the bits of
    `table_lr` at that rate, as optax's schedules end with the product by their initial value).
  """
  loss_and_grads, negatives = make_loss_and_grads(
      tower_apply=tower_apply, sampler=sampler, loss=loss, mesh=mesh,
      normalize_classes=normalize_classes, stratum_cdf=stratum_cdf, table_rows=table_rows,
      dropout=dropout, input_table=input_table, compute_dtype=compute_dtype)
  update_table = make_table_update(negatives, mesh, row_opt, table_rounding)

  def train_step(state: TrainState, batch, rng, table_lr_scale=None):
    lr = table_lr(state.step) if table_lr_scale is None else table_lr(state.step) * table_lr_scale
    out = loss_and_grads(state.tower_params(), state.table, batch, rng)
    # ---- 3. update; a non-finite loss or gradient drops it (see _all_finite) --
    updates, opt_state = tx.update(out.g_params, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = _all_finite(out.loss, out.g_rows, out.g_pos, params, opt_state, (out.g_input, out.input_values))
    keep_if_bad = lambda new, old: jnp.where(finite, new, old)  # pylint: disable=unnecessary-lambda-assignment
    table, table_state = update_table(
        state.table, state.table_state, out.draws.ids, jnp.where(finite, out.g_rows, 0.0),
        jnp.where(finite, out.g_pos, 0.0), out.draws.owned, batch["label"],
        jnp.where(finite, lr, 0.0), jax.random.fold_in(rng, ROUNDING_FOLD_IN))
    inputs = {}
    if input_table is not None:  # the rows of the batch's features, as the class table's rows
      inputs = dict(zip(("input_table", "input_table_state"), input_table.update(
          state.input_table, state.input_table_state, batch, out.input_values, out.g_input,
          input_table.lr(state.step), keep=finite)))
    new_state = state.replace(
        step=state.step + 1, params=jax.tree.map(keep_if_bad, params, state.params),
        opt_state=jax.tree.map(keep_if_bad, opt_state, state.opt_state), table=table,
        table_state=table_state, nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
        first_nonfinite_step=jnp.where((state.first_nonfinite_step < 0) & ~finite, state.step + 1,
                                       state.first_nonfinite_step), **inputs)
    return new_state, _step_metrics(batch["valid"], out.loss, out.per_example, out.pos, out.hardest,
                                    out.n_valid)

  if member:
    return train_step
  if max_traces is not None:
    train_step = limit_traces(train_step, max_traces)
  return jax.jit(train_step, donate_argnums=(0,) if donate else ())


def make_table_update(negatives, mesh, row_opt: RowOptimizer, rounding: str = "nearest") -> Callable:
  """`update(table, table_state, ids, row_grads, pos_grads, owned, labels, lr, key=None)`: the
  row-wise optimiser on the drawn and positive rows, each model shard on its own rows. A table
  narrower than float32 gets its rows updated in float32 and rounded back by `rounding`
  (`precision.round_rows`; "stochastic" draws from `key` and the rows' global ids)."""

  def update_table(table_l, tstate_l, ids_l, row_grads_l, pos_grads_l, owned_l, labels_l, lr, key):
    j = jax.lax.axis_index(MODEL)
    k_loc, h = table_l.shape
    ids_l, row_grads_l = negatives.rows_to_update(ids_l, row_grads_l)
    local = ids_l - j * k_loc
    neg_ids = jnp.where((ids_l < negatives.num_labels) & (local >= 0) & (local < k_loc), local,
                        k_loc).reshape(-1)
    if negatives.positives_in_scores:  # every row once, in order; the positives' gradient is in it
      return apply_row_update(table_l, tstate_l, neg_ids, row_grads_l.reshape(-1, h), lr, row_opt,
                              rounding=rounding, key=key, row_offset=j * k_loc, every_row=True)
    pos_grads = jax.lax.all_gather(pos_grads_l[0], DATA, tiled=True)
    owned = jax.lax.all_gather(owned_l[0], DATA, tiled=True)
    labels = jax.lax.all_gather(labels_l, DATA, tiled=True)
    pos_ids = jnp.where(owned, labels - j * k_loc, k_loc)
    row_ids = jnp.concatenate([neg_ids, pos_ids])
    grads = jnp.concatenate([row_grads_l.reshape(-1, h), pos_grads])
    return apply_row_update(table_l, tstate_l, row_ids, grads, lr, row_opt, rounding=rounding, key=key,
                            row_offset=j * k_loc)

  def update(table, tstate, ids, row_grads, pos_grads, owned, labels, lr, key=None):
    tstate_specs = jax.tree.map(lambda _: P(MODEL), tstate)
    key = jax.random.key(0) if key is None else key  # used only by stochastic rounding
    return jax.shard_map(
        update_table, mesh=mesh,
        in_specs=(TABLE, tstate_specs, negatives.ids_spec, negatives.rows_spec,
                  P(MODEL, DATA, None), P(MODEL, DATA), BATCH, P(), P()),
        # Every data replica of a table shard applies the same all-gathered
        # update; all_gather results are typed "varying" over `data`, hence no
        # replication check here (this map is never differentiated).
        out_specs=(TABLE, tstate_specs), check_vma=False)(table, tstate, ids, row_grads, pos_grads,
                                                   owned, labels, lr, key)

  return update


def limit_traces(fn: Callable, n: int) -> Callable:
  """`fn`, raising if traced more than `n` times: a recompilation mid-run is a bug.

  What chex.assert_max_traces checks, per built step: chex counts the traces of
  a function by its code location, so every step `make_train_step` builds
  (tests build many) would share one count.
  """
  traces = 0

  @functools.wraps(fn)
  def counted(*args):
    nonlocal traces
    traces += 1
    if traces > n:
      raise AssertionError(f"the train step was traced {traces} times (at most {n}): a batch or "
                           "state of a new shape, dtype or sharding recompiles it")
    return fn(*args)
  return counted


def _all_finite(loss_value, g_rows, g_pos, params, opt_state, g_input=None):
  """Whether the step's update is kept.

  A non-finite loss or gradient drops the whole update (the table gets a zero
  gradient and step, the tower and its optimiser state are kept), so the
  state stays the last good one; the step is counted, and the loop stops
  (on_nonfinite="stop") or goes on within train.max_skipped_steps ("skip").
  The tower's gradient is checked through what it produces, the updated
  parameters and optimiser state (a NaN/inf gradient makes them non-finite):
  a reduction over the gradient itself changes how XLA fuses its computation,
  and with it the bits of valid runs. With finite values every where() on
  `finite` selects the update: same bits as without the check. A sparse input
  table is checked through what its row gradients are made of, the bag vectors'
  gradient and the bag's input values (its new table would be an O(d hidden)
  reduction); None adds nothing to check.
  """
  return all_finite(loss_value, g_rows, g_pos, params, opt_state, g_input)


def _step_metrics(valid_mask, loss_value, per_ex, pos, hardest, n_valid) -> dict:
  """The step's logged scalars, averaged over the valid examples."""
  valid = valid_mask.astype(jnp.float32)
  denom = jnp.maximum(jnp.sum(valid), 1.0)
  return {
      "loss": loss_value,
      "pos_score": jnp.sum(pos * valid) / denom,
      "hardest_neg_score": jnp.sum(jnp.where(valid_mask, hardest, 0.0)) / denom,
      "valid_negatives": jnp.sum(n_valid * valid) / denom,
      "max_example_loss": jnp.max(jnp.where(valid_mask, per_ex, -jnp.inf)),
  }
