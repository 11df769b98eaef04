"""Row-wise decoupled weight decay of the class table (table.weight_decay):
equal to a dense NumPy reference with duplicate ids, lazy (untouched rows keep
their values), applied once per touched row, and never O(K) per step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snm_jax.train.core import row_optimizers
from snm_jax.train.core.row_optimizers import apply_row_update

R, H = 12, 3
LR, WD, BETA = 0.3, 0.5, 0.9


def _ids_and_grads(seed):
  rng = np.random.default_rng(seed)
  # Duplicates (3 x row 2, 2 x row 7), a padding id (R) and an out-of-range one (-1).
  ids = np.array([2, 7, 2, 5, 2, 7, R, -1, 0], np.int32)
  grads = rng.normal(size=(ids.size, H)).astype(np.float32)
  return ids, grads


def _dense_reference(name, table, state, ids, grads, lr, wd):
  """The dense update of the summed gradient on the touched rows, then each
  touched row times (1 - lr wd) once; untouched rows (and state) unchanged."""
  table = table.astype(np.float64).copy()
  state = {k: v.astype(np.float64).copy() for k, v in state.items()}
  ok = (ids >= 0) & (ids < table.shape[0])
  g = np.zeros_like(table)
  np.add.at(g, ids[ok], grads[ok])
  touched = np.unique(ids[ok])
  for r in touched:
    if name == "sgd":
      table[r] -= lr * g[r]
    elif name == "momentum":
      state["momentum"][r] = BETA * state["momentum"][r] + g[r]
      table[r] -= lr * state["momentum"][r]
    else:  # row-wise adagrad
      state["accumulator"][r] += np.mean(g[r] ** 2)
      table[r] -= lr * g[r] / (np.sqrt(state["accumulator"][r]) + 1e-10)
    table[r] *= 1.0 - lr * wd
  return table, state, touched


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad"])
def test_row_decay_equals_dense_reference_with_duplicate_ids(name):
  kwargs = {"beta": BETA} if name == "momentum" else {}
  opt = row_optimizers.get_row_optimizer(name, **kwargs)._replace(weight_decay=WD)
  table = np.random.default_rng(0).normal(size=(R, H)).astype(np.float32)
  state = jax.tree.map(np.asarray, opt.init(R, H))
  if name == "momentum":  # a nonzero momentum on every row, so laziness shows
    state["momentum"] = np.random.default_rng(1).normal(size=(R, H)).astype(np.float32)
  update = jax.jit(lambda t, s, i, g, lr: apply_row_update(t, s, i, g, lr, opt))
  t_np, s_np = table, state
  t_jx, s_jx = jnp.asarray(table), jax.tree.map(jnp.asarray, state)
  for step in range(3):
    ids, grads = _ids_and_grads(step)
    t_np, s_np, touched = _dense_reference(name, t_np, s_np, ids, grads, LR, WD)
    t_jx, s_jx = update(t_jx, s_jx, jnp.asarray(ids), jnp.asarray(grads), jnp.float32(LR))
    np.testing.assert_allclose(np.asarray(t_jx), t_np, rtol=1e-5, atol=1e-6)
    for k in s_np:
      np.testing.assert_allclose(np.asarray(s_jx[k]), s_np[k], rtol=1e-5, atol=1e-6)
  untouched = np.setdiff1d(np.arange(R), touched)
  assert untouched.size  # lazy: rows no step touched keep their initial values exactly
  np.testing.assert_array_equal(np.asarray(t_jx)[untouched], table[untouched])


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad"])
def test_row_decay_with_zero_gradient_only_shrinks_touched_rows_once(name):
  """With g = 0 (and momentum 0) the optimisers leave the rows unchanged, so the
  result isolates the decay: a row named three times shrinks by (1 - lr wd) once."""
  opt = row_optimizers.get_row_optimizer(name)._replace(weight_decay=WD)
  table = jnp.asarray(np.random.default_rng(2).normal(size=(R, H)).astype(np.float32))
  state = opt.init(R, H)
  ids = np.array([4, 4, 4, 9, R], np.int32)
  update = jax.jit(lambda t, s, i, g: apply_row_update(t, s, i, g, LR, opt))  # one program, not op by op
  out, _ = update(table, state, ids, np.zeros((5, H), np.float32))
  expect = np.asarray(table).copy()
  expect[[4, 9]] *= 1.0 - LR * WD
  np.testing.assert_allclose(np.asarray(out), expect, rtol=1e-6)


def test_zero_decay_is_the_plain_optimiser():
  opt = row_optimizers.get_row_optimizer("sgd")
  assert opt.weight_decay == 0.0
  table = jnp.asarray(np.random.default_rng(3).normal(size=(R, H)).astype(np.float32))
  ids, grads = _ids_and_grads(0)
  a, _ = jax.jit(lambda t, i, g: apply_row_update(t, {}, i, g, LR, opt))(table, ids, grads)
  b, _ = jax.jit(lambda t, i, g: apply_row_update(t, {}, i, g, LR, opt._replace(weight_decay=0.0)))(
      table, ids, grads)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  expect = np.asarray(table).copy()
  ok = (ids >= 0) & (ids < R)
  np.add.at(expect, ids[ok], -LR * grads[ok])
  np.testing.assert_allclose(np.asarray(a), expect, rtol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad"])
def test_row_decay_allocates_nothing_of_table_size(name):
  """Only the in-place scatters into the table / state produce arrays with K rows."""
  k, t = 1009, 7
  opt = row_optimizers.get_row_optimizer(name)._replace(weight_decay=WD)
  state = opt.init(k, H)
  jaxpr = jax.make_jaxpr(lambda tb, s, i, g: apply_row_update(tb, s, i, g, LR, opt))(
      np.zeros((k, H), np.float32), state, np.zeros((t,), np.int32), np.zeros((t, H), np.float32))
  big = [e.primitive.name for e in jaxpr.jaxpr.eqns
         for v in e.outvars if k in getattr(v.aval, "shape", ())]
  assert big and set(big) <= {"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul"}, big


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad"])
def test_every_row_update_equals_the_gathered_update(name):
  """every_row=True (the full sampler: ids 0..R-1 in order, padding rows marked R) gives the
  gather / merge / scatter path's rows and state, decay included; the marked rows keep theirs."""
  kwargs = {"beta": BETA} if name == "momentum" else {}
  opt = row_optimizers.get_row_optimizer(name, **kwargs)._replace(weight_decay=WD)
  rng = np.random.default_rng(2)
  table = jnp.asarray(rng.normal(size=(R, H)).astype(np.float32))
  state = opt.init(R, H)
  ids = np.where(np.arange(R) < R - 3, np.arange(R), R).astype(np.int32)  # 3 padding rows
  grads = jnp.asarray(rng.normal(size=(R, H)).astype(np.float32))
  dense = jax.jit(lambda t, s: apply_row_update(t, s, ids, grads, LR, opt, every_row=True))
  gathered = jax.jit(lambda t, s: apply_row_update(t, s, ids, grads, LR, opt))
  (t_d, s_d), (t_g, s_g) = dense(table, state), gathered(table, state)
  np.testing.assert_allclose(np.asarray(t_d), np.asarray(t_g), rtol=1e-6, atol=1e-7)
  for a, b in zip(jax.tree.leaves(s_d), jax.tree.leaves(s_g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(t_d)[R - 3:], np.asarray(table)[R - 3:])
  assert np.abs(np.asarray(t_d)[:R - 3] - np.asarray(table)[:R - 3]).min() > 0
