"""Sparse, row-wise optimisers for embedding tables (the class table).

optax transforms act on whole arrays: applied to a K x h table they cost
O(K h) per step even when only N + B rows received gradient. These optimisers
gather the touched rows, update them and scatter them back, so a step costs
O((N + B) h) whatever K is. Duplicate ids are merged first (their gradients
summed), so the result equals the dense update of the same gradient for SGD,
and the "lazy" variant of momentum / Adagrad that skips untouched rows.

Each optimiser is a pair of pure functions:
  init(num_rows, dim, dtype) -> state   (a dict of arrays with leading dim num_rows)
  update(rows, grads, state_rows, lr) -> (new_rows, new_state_rows)
and `apply_row_update` does the gather / merge / scatter around them.

Decoupled row-wise weight decay (`RowOptimizer.weight_decay`, AdamW-style):
after the optimiser's update, every row touched by the step is multiplied by
(1 - lr * weight_decay) once, however often its id repeats in the step. It is
lazy: rows no step touches are not decayed (decaying all K rows would cost
O(K h) per step), so a row's total shrinkage depends on how often it is
sampled or is a positive, not on the step count. "Touched" means named by a
valid id of the step (in the train step: every drawn negative of the shard and
every positive), whether or not its gradient is nonzero.

A table stored narrower than float32 (bfloat16 as uint16 bits, config table.dtype;
`snm_jax.models.precision`) is updated in float32:
the touched rows are gathered and upcast, duplicate ids merged, the optimiser (its state
stays float32) and the decay applied in float32, and the new rows rounded back once
(`snm_jax.models.precision.round_rows`: nearest-even, or stochastic). SGD then takes the
merging path too: a scatter-add into bfloat16 rows would round once per duplicate.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from snm_jax.errors import ConfigError
from snm_jax.models import precision


class RowOptimizer(NamedTuple):
  init: Callable
  update: Callable
  # True when the update is stateless and linear in the gradient (plain SGD):
  # duplicate ids then need no merge, and `apply_row_update` scatter-adds
  # -lr * grad directly (no sort of the ids, no gather of the old rows).
  additive: bool = False
  # Decoupled L2 decay of the touched rows (see the module docstring); 0 = off.
  # A Python float: the decay is compiled in only when it is nonzero.
  weight_decay: float = 0.0


def sgd() -> RowOptimizer:
  def init(num_rows, dim, dtype=jnp.float32):
    del num_rows, dim, dtype
    return {}

  def update(rows, grads, state, lr):
    return rows - lr * grads, state

  return RowOptimizer(init, update, additive=True)


def momentum(beta: float = 0.9, nesterov: bool = False) -> RowOptimizer:
  """Lazy heavy-ball momentum: m <- beta m + g on touched rows only."""
  def init(num_rows, dim, dtype=jnp.float32):
    return {"momentum": jnp.zeros((num_rows, dim), dtype)}

  def update(rows, grads, state, lr):
    m = beta * state["momentum"] + grads
    step = beta * m + grads if nesterov else m
    return rows - lr * step, {"momentum": m}

  return RowOptimizer(init, update)


def adagrad(initial_accumulator: float = 0.1, eps: float = 1e-10) -> RowOptimizer:
  """Row-wise Adagrad (one accumulator per row, of the mean squared gradient).

  This is the memory-light variant used for large embedding tables (one float
  per row instead of h); the accumulator only grows on touched rows.
  """
  def init(num_rows, dim, dtype=jnp.float32):
    del dim
    return {"accumulator": jnp.full((num_rows,), initial_accumulator, dtype)}

  def update(rows, grads, state, lr):
    acc = state["accumulator"] + jnp.mean(jnp.square(grads), axis=-1)
    return rows - lr * grads / (jnp.sqrt(acc)[:, None] + eps), {"accumulator": acc}

  return RowOptimizer(init, update)


def get_row_optimizer(name: str, **kwargs) -> RowOptimizer:
  table = {"sgd": sgd, "momentum": momentum, "adagrad": adagrad}
  if name not in table:
    raise ConfigError("table.optimizer", f"unknown row optimiser {name!r}; choose from {sorted(table)}")
  return table[name](**kwargs)


def apply_row_update(table, state, row_ids, grads, lr, opt: RowOptimizer, cap_unique: bool = False,
                     rounding: str = "nearest", key=None, row_offset=0, every_row: bool = False):
  """Applies `opt` to the rows of `table` named by `row_ids`.

  Args:
    table: (R_local, h) table (or table shard).
    state: dict of (R_local, ...) optimiser state arrays.
    row_ids: (T,) int32 local row ids; ids outside [0, R_local) are ignored
      (use R_local to mark "not mine" / padding).
    grads: (T, h) gradient of each touched row (duplicates are summed).
    lr: scalar learning rate.
    cap_unique: merge duplicates into min(T, R_local + 1) rows instead of T (there are at most
      R_local + 1 distinct ids, "not mine" included): the same values, far less work when
      T >> R_local (a sparse input table with d < N nnz). Off by default: the class table's
      updates keep their compiled shapes (row-wise Adagrad's mean may round differently).
    rounding, key, row_offset: for a table narrower than float32 (module docstring), how the
      float32 rows are written back ("nearest" | "stochastic"); stochastic rounding draws from
      `key` and the global row id row_offset + local id. Ignored for float32 tables.
    every_row: row_ids are the rows 0..R_local-1 in order, some marked R_local (untouched: the
      padding labels); T = R_local. The same update, dense: no merge, gather or scatter.
  Returns:
    (table, state) with only the touched rows changed; cost O(T h + T log T),
    or O(T h) for an additive optimiser (SGD) without weight decay. With
    `opt.weight_decay` = wd > 0 each touched row is then multiplied by
    (1 - lr * wd) once (for SGD its ids are sorted and only first occurrences
    scaled: O(T log T) more, nothing of size R_local).
  """
  num_rows = table.shape[0]
  t = row_ids.shape[0]
  row_ids = jnp.where((row_ids >= 0) & (row_ids < num_rows), row_ids, num_rows)
  wd = opt.weight_decay
  reduced = precision.is_reduced(table.dtype)
  if every_row:
    return _update_every_row(table, state, row_ids < num_rows, grads, lr, opt, rounding, key, row_offset)
  if opt.additive and not reduced:
    step = (-lr * grads).astype(table.dtype)
    table = table.at[row_ids].add(step, mode="drop")
    if wd:
      # Duplicates are not merged on this path: scale each touched row once,
      # at its first occurrence in sorted order; the rest index R_local (dropped).
      ids = jnp.sort(row_ids)
      first = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])
      factor = jnp.asarray(1.0 - lr * wd, table.dtype)
      table = table.at[jnp.where(first, ids, num_rows)].multiply(factor, mode="drop")
    return table, state
  size = min(t, num_rows + 1) if cap_unique else t
  unique, inverse = jnp.unique(row_ids, size=size, fill_value=num_rows, return_inverse=True)
  merged = jax.ops.segment_sum(grads, inverse.reshape(-1), num_segments=size)
  rows = table.at[unique].get(mode="fill", fill_value=0)
  if reduced:  # updated in float32, rounded back below
    rows = precision.upcast(rows)
  state_rows = jax.tree.map(lambda s: s.at[unique].get(mode="fill", fill_value=0), state)
  new_rows, new_state_rows = opt.update(rows, merged.astype(rows.dtype), state_rows, lr)
  if wd:  # `unique` holds each touched row once (padding = R_local, dropped below)
    new_rows = new_rows * (1.0 - lr * wd)
  if reduced:
    new_rows = precision.round_rows(new_rows, table.dtype, rounding, key, unique + row_offset)
  table = table.at[unique].set(new_rows.astype(table.dtype), mode="drop")
  state = jax.tree.map(lambda s, n: s.at[unique].set(n.astype(s.dtype), mode="drop"),
                       state, new_state_rows)
  return table, state


def _update_every_row(table, state, touched, grads, lr, opt: RowOptimizer, rounding, key, row_offset):
  """`apply_row_update` when grads (R_local, h) holds every row's gradient in order: the rows
  `touched` (R_local,) bool get the update, the others keep their values."""
  reduced = precision.is_reduced(table.dtype)
  rows = precision.upcast(table) if reduced else table
  new_rows, new_state = opt.update(rows, grads.astype(rows.dtype), state, lr)
  if opt.weight_decay:
    new_rows = new_rows * (1.0 - lr * opt.weight_decay)
  if reduced:
    new_rows = precision.round_rows(new_rows, table.dtype, rounding, key,
                                    jnp.arange(table.shape[0]) + row_offset)
  keep = lambda new, old: jnp.where(touched.reshape((-1,) + (1,) * (old.ndim - 1)), new.astype(old.dtype), old)  # pylint: disable=unnecessary-lambda-assignment
  return keep(new_rows, table), jax.tree.map(keep, new_state, state)
