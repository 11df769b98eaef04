"""The query tower's input table (its `EmbeddingBag`, d x hidden) as a row-updated table.

By default (`model.input_update="dense"`) the table is a flax parameter of the
tower: its gradient is a dense (d, hidden) array (a scatter-add of the batch's
N x nnz rows into zeros) and optax updates all d rows every step, O(d hidden).
With `model.input_update="sparse"` it is held like the class table: the state
carries it (`step.SparseInputTrainState.input_table`, (d_pad, hidden),
row-sharded over `model`) with a row-optimiser state
(`snm_jax.train.core.row_optimizers`), and a step

  1. has the tower take its bag b_n = sum_i v_ni E[id_ni] (N, hidden) from
     `bag_fn` (the tower's argument, `snm_jax.models.towers.EmbeddingBag`):
     each model shard sums the rows it owns straight from its table shard (a
     loop over the nnz entries, gather and multiply-add fused: the N x nnz x
     hidden rows are never written out), then the shards' sums are added
     (all-gathered over `model`, added in shard order: the same bits on one or
     several processes); the
     EmbeddingBag reports the values v it was called with (after feature
     dropout) through flax's "intermediates" collection;
  2. differentiates the loss w.r.t. the bag vectors b (N, hidden) -- a zero
     (N, hidden) input added to the bag, as the step differentiates gathered
     class rows, never the table. The bag is linear in the rows, so the
     gradient of row E[id_ni] is v_ni g_n, g = dL/db (what autodiff w.r.t. the
     gathered rows would give, without materialising it);
  3. applies the row optimiser to the touched rows, each model shard to its own
     rows, after an all-gather over `data` of the batch's ids, values and
     bag gradients (`update`): no all-to-all, nothing of size d. SGD adds
     -lr v_ni g_n in a loop over the nnz entries (no N nnz x hidden array);
     the other optimisers (and a weight decay) merge duplicate ids first, from
     the N nnz x hidden row gradients (`apply_row_update`).

Cost O(N nnz hidden) per step, whatever d. Communication per step: an
all-gather of M x (N, hidden) partial bags over `model` and an all-gather over
`data` of N (hidden + 2 nnz) values.

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
it). There is no row-wise Adam (`validation.validate` refuses the combination).

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
from snm_jax.train.core.row_optimizers import RowOptimizer, apply_row_update

P = jax.P
IDS_SPEC = P(DATA, None)                # feat_ids / feat_vals (N, nnz)
BAG_PARAM = ("bag", "embedding")        # the EmbeddingBag's parameter, at the end of its path
BAG_VALUES = ("bag", "values")          # what it sows into "intermediates" when given a bag_fn
UNROLL = 8  # nnz entries per iteration of the bag's and SGD's loops (measured: 8-16 best on CPU)


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


def bag_values(intermediates) -> jax.Array:
  """The (N, nnz) values the EmbeddingBag was called with (after feature dropout), from the
  "intermediates" collection of `tower.apply(..., bag_fn=..., mutable=["intermediates"])`."""
  flat = traverse_util.flatten_dict(intermediates)
  keys = [k for k in flat if k[-2:] == BAG_VALUES]
  if len(keys) != 1:
    raise ValueError(f"expected one sown EmbeddingBag input (a path ending in {BAG_VALUES}), found {keys}")
  return flat[keys[0]][0]


def _owned(table_l, ids_l):
  """(local ids, whether this model shard owns each): ids of any shape."""
  k_loc = table_l.shape[0]
  local = ids_l - jax.lax.axis_index(MODEL) * k_loc
  return local, (local >= 0) & (local < k_loc)


def _local_bag(table_l, ids_l, vals_l):
  """sum_i v_i E[id_i] over the ids this shard owns, summed over the shards: (n, hidden).

  The shards' partial sums are all-gathered and added in shard order on every device, not
  psum-ed: an all-reduce spanning processes may add them in another order than one within a
  process, and a run must have the same bits on one or several processes (tests/test_multihost.py).

  A loop over the nnz entries, each a gather of n rows and a multiply-add into an (n, hidden)
  accumulator that XLA fuses: the rows are read once and never written out (on 2 CPU cores
  at n = 256, nnz = 64, hidden = 512: 3-4 ms, against ~30 ms for a gather of the n nnz rows
  followed by the batched (1, nnz) x (nnz, hidden) products of an einsum)."""
  local, owned = _owned(table_l, ids_l)
  vals_l = jnp.where(owned, vals_l, 0.0).astype(table_l.dtype)

  def term(i):
    return vals_l[:, i, None] * jnp.take(table_l, local[:, i], axis=0, mode="clip")

  # Started from the first term, not from zeros: the carry then has the shard_map's
  # per-device type from the start.
  acc = jax.lax.fori_loop(1, ids_l.shape[1], lambda i, acc: acc + term(i), term(0), unroll=UNROLL)
  return jnp.sum(jax.lax.all_gather(acc, MODEL), axis=0)


@dataclasses.dataclass(frozen=True)
class InputTable:
  """The sparse input table's operations on `mesh` (module docstring).

  row_opt: the row optimiser (`builders.make_input_table`); lr: step -> its learning rate.
  """
  mesh: Any
  row_opt: RowOptimizer
  lr: Callable

  def table_bag_fn(self, table) -> Callable:
    """The tower's `bag_fn` reading `table` (d_pad, hidden): (ids, vals) (N, nnz) -> (N, hidden),
    not differentiable w.r.t. the table (step 1; evaluation)."""
    def bag(feat_ids, feat_vals):
      # The all_gather's result is typed varying over `model`, though every shard holds the
      # same sum: no replication check (this map is never differentiated).
      return jax.shard_map(_local_bag, mesh=self.mesh, in_specs=(TABLE, IDS_SPEC, IDS_SPEC),
                           out_specs=P(DATA, None), check_vma=False)(table, feat_ids, feat_vals)
    return bag

  def bag_fn(self, table, delta) -> Callable:
    """The training `bag_fn`: the table's bag plus `delta` (N, hidden), zeros, the input the
    loss is differentiated w.r.t. (its gradient is dL/d bag, step 2)."""
    bag = self.table_bag_fn(table)
    return lambda feat_ids, feat_vals: bag(feat_ids, feat_vals) + delta

  @staticmethod
  def zero_delta(table, feat_ids):
    """The (N, hidden) zeros `bag_fn` adds (the differentiated input)."""
    return jnp.zeros((feat_ids.shape[0], table.shape[1]), table.dtype)

  def apply_fn(self, tower_apply: Callable) -> Callable:
    """`apply(SparseTowerParams, feat_ids, feat_vals, **kw)` = `tower_apply(params, feat_ids,
    feat_vals, bag_fn=<the table's>, **kw)`: the tower as the evaluators and the diagnostics
    call it (`tower_apply(params, *tower_inputs(batch))`). No gradient reaches the table (the
    diagnostics differentiate only the class rows): it would be a dense d x hidden array."""
    def apply(tower_params: SparseTowerParams, feat_ids, feat_vals, **kw):
      table = jax.lax.stop_gradient(tower_params.input_table)
      return tower_apply(tower_params.params, feat_ids, feat_vals, bag_fn=self.table_bag_fn(table), **kw)
    return apply

  def update(self, table, table_state, batch, values, bag_grads, lr, keep=True):
    """The row optimiser on the rows the batch touches (module docstring), each model shard on
    its own rows (step 3): row E[id_ni] gets the gradient values[n, i] bag_grads[n].

    values: (N, nnz) the EmbeddingBag's input values (`bag_values`); bag_grads: (N, hidden)
    dL/d bag; keep: a traced bool, False to touch no row (the step's non-finite guard: the
    rows, their optimiser state and a non-finite gradient are then never combined).
    Returns (table, table_state)."""
    gather_data = self.mesh.shape[DATA] > 1  # an all_gather over one device is still a copy
    opt = self.row_opt

    def local(table_l, tstate_l, ids_l, raw_l, vals_l, valid_l, g_l, lr, keep):
      k_loc, h = table_l.shape
      ids, raw, vals, valid, g = ((jax.lax.all_gather(x, DATA, tiled=True) if gather_data else x)
                                  for x in (ids_l, raw_l, vals_l, valid_l, g_l))
      local_ids, owned = _owned(table_l, ids)
      touched = (raw != 0) & valid[:, None] & owned & keep
      row_ids = jnp.where(touched, local_ids, k_loc)  # k_loc: dropped
      if opt.additive and not opt.weight_decay:  # SGD: scatter-add -lr v_ni g_n, entry by entry
        def add_entry(i, t):
          return t.at[row_ids[:, i]].add((-lr * vals[:, i, None] * g).astype(t.dtype), mode="drop")
        return jax.lax.fori_loop(0, ids.shape[1], add_entry, table_l, unroll=UNROLL), tstate_l
      grads = (vals[..., None] * g[:, None, :]).reshape(-1, h)
      return apply_row_update(table_l, tstate_l, row_ids.reshape(-1), grads, lr, opt, cap_unique=True)

    tstate_specs = jax.tree.map(lambda _: P(MODEL), table_state)
    return jax.shard_map(
        local, mesh=self.mesh,
        in_specs=(TABLE, tstate_specs, IDS_SPEC, IDS_SPEC, IDS_SPEC, P(DATA), P(DATA, None), P(), P()),
        # As the class table's update: every data replica of a shard applies the same
        # all-gathered update (never differentiated).
        out_specs=(TABLE, tstate_specs), check_vma=False)(
            table, table_state, batch["feat_ids"], batch["feat_vals"], values, batch["valid"],
            bag_grads, lr, jnp.asarray(keep))
