"""The query tower's input table (its `EmbeddingBag`, d x hidden) as a row-updated table.

By default (`model.input_update="dense"`) the table is a flax parameter of the
tower: its gradient is a dense (d, hidden) array (a scatter-add of the batch's
N x nnz rows into zeros) and optax updates all d rows every step, O(d hidden).
With `model.input_update="sparse"` it is held like the class table: the state
carries it (`step.SparseInputTrainState.input_table`, (d_pad, hidden),
row-sharded over `model`) with a row-optimiser state
(`snm_jax.train.row_optimizers`), and a step

  1. gathers the rows of the batch's feature ids, each model shard the rows it
     owns: (M, N, nnz, hidden), no gradient (`gather`);
  2. has the tower compute its bag sum_i v_i E[id_i] from them (`bag_fn`, the
     tower's `bag_fn` argument, `snm_jax.models.towers.EmbeddingBag`): each
     shard's partial sum over the ids it owns, then a psum over `model`,
     (N, hidden); the loss is differentiated w.r.t. the gathered rows, never
     the table (as the step does with the class rows);
  3. applies the row optimiser to the touched rows, each model shard to its own
     rows, after an all-gather of the batch's ids and row gradients over `data`
     (`update`): no all-to-all, nothing of size d.

Cost O(N nnz hidden) per step, whatever d. Communication per step: a psum of
(N, hidden) over `model` and the all-gather over `data` of N nnz hidden
gradient values (the class table's positives use the same pattern).

A row is *touched* by a step when a valid example of the batch names it with a
nonzero value (padding entries have value 0 and touch nothing), whether or
not feature dropout dropped it. The optimisers follow the tower's:
  optimizer.name=sgd       row-wise SGD: the same update as optax.sgd (to float
                           summation order);
  optimizer.name=momentum  *lazy* heavy-ball momentum (m <- beta m + g, on
                           touched rows only): optax's momentum keeps moving a
                           row by lr beta^t m on every later step, the lazy one
                           moves it only when it is touched again (a row seen
                           once moves by lr g instead of lr g / (1 - beta) in
                           total), and its m does not decay in between;
  optimizer.name=adagrad   row-wise Adagrad (one accumulator per row, of the
                           mean squared gradient) instead of optax's
                           per-coordinate accumulators;
at the tower's learning rate schedule, with optimizer.weight_decay as the row
optimiser's decoupled, lazy decay (`RowOptimizer.weight_decay`: touched rows
are multiplied by 1 - lr wd after the update; optax decays every row before
it). There is no row-wise Adam (`builders.validate` refuses the combination).

The table has d_pad = d rounded up to a multiple of mining.num_strata rows
(`input_table_rows`): the bound the class table already puts on the `model`
axis, so its shape does not depend on the mesh (a checkpoint restores onto any
mesh); the padding rows are never named, hence never gathered or updated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import traverse_util

from snm_jax.sharding import DATA, MODEL, TABLE
from snm_jax.train.row_optimizers import RowOptimizer, apply_row_update

P = jax.P
ROWS_SPEC = P(MODEL, DATA, None, None)  # gathered rows (M, N, nnz, hidden)
IDS_SPEC = P(DATA, None)                # feat_ids / feat_vals (N, nnz)
BAG_PARAM = ("bag", "embedding")        # the EmbeddingBag's parameter, at the end of its path


class SparseTowerParams(NamedTuple):
  """The tower's parameters when its input table is held outside the module: what
  `InputTable.apply_fn(tower.apply)` takes (the evaluators, the diagnostics)."""
  params: Any             # the flax variables without the EmbeddingBag's "embedding"
  input_table: jax.Array  # (d_pad, hidden), row-sharded over `model`


def input_table_rows(num_features: int, num_strata: int) -> int:
  """d rounded up to a multiple of `num_strata` (module docstring)."""
  return -(-num_features // num_strata) * num_strata


def split_params(params) -> tuple[Any, jax.Array]:
  """(flax variables without the EmbeddingBag's table, that table (d, hidden)).

  Raises ValueError unless exactly one parameter path ends in ("bag", "embedding")
  (`SNMTower`, and `WideDeepQuery`'s tower).
  """
  flat = traverse_util.flatten_dict(params)
  keys = [k for k in flat if k[-2:] == BAG_PARAM]
  if len(keys) != 1:
    raise ValueError(f"expected one EmbeddingBag table (a path ending in {BAG_PARAM}), found {keys}")
  table = flat.pop(keys[0])
  return traverse_util.unflatten_dict(flat), table


def _owned(table_l, ids_l):
  """(local ids (n, nnz), whether this model shard owns each)."""
  k_loc = table_l.shape[0]
  local = ids_l - jax.lax.axis_index(MODEL) * k_loc
  return local, (local >= 0) & (local < k_loc)


def _local_rows(table_l, ids_l):
  """This model shard's rows of `ids_l` (n, nnz): (n, nnz, hidden), valid where the shard owns the
  id and arbitrary (clipped ids' rows) elsewhere: `_partial_bag` gives those entries weight 0, which
  costs O(n nnz) where masking the rows themselves would be another pass over n nnz hidden values."""
  return jnp.take(table_l, _owned(table_l, ids_l)[0], axis=0, mode="clip")


def _partial_bag(table_l, ids_l, vals_l, rows_l):
  """sum_i v_i rows_i over the ids this shard owns, summed over the shards: (n, hidden). The same
  einsum as `EmbeddingBag`'s gather path (the same bits on one model shard)."""
  vals_l = jnp.where(_owned(table_l, ids_l)[1], vals_l, 0.0)
  return jax.lax.psum(jnp.einsum("bn,bnh->bh", vals_l, rows_l), MODEL)


@dataclasses.dataclass(frozen=True)
class InputTable:
  """The sparse input table's operations on `mesh` (module docstring).

  row_opt: the row optimiser (`builders.make_input_table`); lr: step -> its learning rate.
  """
  mesh: Any
  row_opt: RowOptimizer
  lr: Callable

  def gather(self, table, feat_ids):
    """(d_pad, hidden) table, (N, nnz) ids -> (M, N, nnz, hidden): each model shard's rows of
    the ids it owns (`_local_rows`: arbitrary rows elsewhere, which `bag_fn` weighs by 0) (step 1)."""
    return jax.shard_map(lambda t, i: _local_rows(t, i)[None], mesh=self.mesh,
                         in_specs=(TABLE, IDS_SPEC), out_specs=ROWS_SPEC)(table, feat_ids)

  def bag_fn(self, table, rows) -> Callable:
    """The tower's `bag_fn` over the rows `gather` took from `table`: (ids, vals) (N, nnz) ->
    (N, hidden), differentiable w.r.t. `rows` (step 2). Entries another shard owns get weight 0,
    hence a zero gradient."""
    def bag(feat_ids, feat_vals):
      return jax.shard_map(lambda t, i, v, r: _partial_bag(t, i, v, r[0]), mesh=self.mesh,
                           in_specs=(TABLE, IDS_SPEC, IDS_SPEC, ROWS_SPEC), out_specs=P(DATA, None))(
                               table, feat_ids, feat_vals, rows)
    return bag

  def table_bag_fn(self, table) -> Callable:
    """The tower's `bag_fn` read from the table itself (no gradient: evaluation)."""
    def bag(feat_ids, feat_vals):
      return jax.shard_map(lambda t, i, v: _partial_bag(t, i, v, _local_rows(t, i)), mesh=self.mesh,
                           in_specs=(TABLE, IDS_SPEC, IDS_SPEC), out_specs=P(DATA, None))(
                               table, feat_ids, feat_vals)
    return bag

  def apply_fn(self, tower_apply: Callable) -> Callable:
    """`apply(SparseTowerParams, feat_ids, feat_vals, **kw)` = `tower_apply(params, feat_ids,
    feat_vals, bag_fn=<the table's>, **kw)`: the tower as the evaluators and the diagnostics
    call it (`tower_apply(params, *tower_inputs(batch))`)."""
    def apply(tower_params: SparseTowerParams, feat_ids, feat_vals, **kw):
      return tower_apply(tower_params.params, feat_ids, feat_vals,
                         bag_fn=self.table_bag_fn(tower_params.input_table), **kw)
    return apply

  def update(self, table, table_state, batch, row_grads, lr, keep=True):
    """The row optimiser on the rows the batch touches (module docstring), each model shard on
    its own rows (step 3). row_grads: (M, N, nnz, hidden), the gradient of `gather`'s rows;
    keep: a traced bool, False to touch no row (the step's non-finite guard: the rows, their
    optimiser state and a non-finite gradient are then never combined, at O(N nnz) instead of
    a pass over the gradient). Returns (table, table_state)."""
    gather_data = self.mesh.shape[DATA] > 1  # an all_gather over one device is still a copy

    def local(table_l, tstate_l, ids_l, vals_l, valid_l, grads_l, lr, keep):
      k_loc, h = table_l.shape
      ids, vals, valid, grads = ((jax.lax.all_gather(x, DATA, tiled=True) if gather_data else x)
                                 for x in (ids_l, vals_l, valid_l, grads_l[0]))
      local_ids, owned = _owned(table_l, ids)
      touched = (vals != 0) & valid[:, None] & owned & keep
      row_ids = jnp.where(touched, local_ids, k_loc).reshape(-1)
      return apply_row_update(table_l, tstate_l, row_ids, grads.reshape(-1, h), lr, self.row_opt,
                              cap_unique=True)

    tstate_specs = jax.tree.map(lambda _: P(MODEL), table_state)
    return jax.shard_map(
        local, mesh=self.mesh,
        in_specs=(TABLE, tstate_specs, IDS_SPEC, IDS_SPEC, P(DATA), ROWS_SPEC, P(), P()),
        # As the class table's update: every data replica of a shard applies the same
        # all-gathered update (never differentiated).
        out_specs=(TABLE, tstate_specs), check_vma=False)(
            table, table_state, batch["feat_ids"], batch["feat_vals"], batch["valid"], row_grads, lr,
            jnp.asarray(keep))
