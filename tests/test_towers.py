"""Query models: dropout (bag output and input nonzeros) acts only in training
and leaves rate-0 models bit-identical; wide_deep is the linear query and the
tower side by side, so a class row scores w.x + b + e.tower(x)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snm_jax.models import towers
from snm_jax.models.towers import EmbeddingBag, LinearQuery, SNMTower, WideDeepQuery, l2_normalize

D, HID, OUT, N, NNZ = 30, 16, 8, 64, 6


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.choice(D, size=(N, NNZ)).astype(np.int32)
  vals = rng.random((N, NNZ)).astype(np.float32) + 0.1
  return jnp.asarray(ids), jnp.asarray(vals)


def _reference_tower(params, ids, vals):
  """SNMTower as it was before dropout: bag -> relu -> dense -> l2."""
  p = params["params"]
  h = jax.nn.relu(jnp.einsum("bn,bnh->bh", vals, p["bag"]["embedding"][ids]))
  return l2_normalize(h @ p["proj"]["kernel"] + p["proj"]["bias"])


@pytest.mark.parametrize("dropout,feature_dropout", [(0.0, 0.0), (0.5, 0.0), (0.0, 0.5), (0.3, 0.2)])
def test_dropout_does_not_change_params_or_evaluation(dropout, feature_dropout):
  ids, vals = _inputs()
  plain = SNMTower(D, HID, OUT)
  tower = SNMTower(D, HID, OUT, dropout=dropout, feature_dropout=feature_dropout)
  p0 = plain.init(jax.random.key(0), ids, vals)
  p1 = tower.init(jax.random.key(0), ids, vals)
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The evaluator's call: deterministic, and equal to the dropout-free model.
  e1, e2 = tower.apply(p1, ids, vals), jax.jit(tower.apply)(p1, ids, vals)
  np.testing.assert_array_equal(np.asarray(e1), np.asarray(plain.apply(p0, ids, vals)))
  np.testing.assert_allclose(np.asarray(e2), np.asarray(e1), atol=1e-6)
  np.testing.assert_allclose(np.asarray(e1), np.asarray(jax.jit(_reference_tower)(p1, ids, vals)), atol=1e-6)


def test_rate_zero_training_needs_no_rng_and_equals_evaluation():
  ids, vals = _inputs()
  tower = SNMTower(D, HID, OUT)
  p = tower.init(jax.random.key(0), ids, vals)
  np.testing.assert_array_equal(np.asarray(tower.apply(p, ids, vals, train=True)),
                                np.asarray(tower.apply(p, ids, vals)))


def test_bag_dropout_in_training_is_random_and_inverted():
  ids, vals = _inputs()
  tower = SNMTower(D, HID, OUT, dropout=0.5, normalize=False)
  p = tower.init(jax.random.key(0), ids, vals)
  train = jax.jit(lambda k: tower.apply(p, ids, vals, train=True, rngs={"dropout": jax.random.key(k)}))
  a, b = train(1), train(2)
  assert not np.allclose(a, b)
  np.testing.assert_array_equal(np.asarray(train(1)), np.asarray(a))  # same key, same mask
  # Inverted dropout: the mean over many masks is the deterministic output (the
  # projection is linear in the dropped bag output).
  mean = np.mean([np.asarray(train(k)) for k in range(400)], axis=0)
  det = np.asarray(tower.apply(p, ids, vals))
  assert np.abs(mean - det).mean() < 0.1 * np.abs(det).mean()


def test_feature_dropout_drops_nonzeros_and_scales_the_kept_ones():
  ids, vals = _inputs()
  # One nonzero per row: each output entry is 0 or scaled.
  ids, vals = np.asarray(ids)[:, :1], np.asarray(vals)[:, :1]
  rate = 0.25
  q = LinearQuery(D, feature_dropout=rate)
  ref, evaluated = map(np.asarray, jax.jit(lambda i, v: (LinearQuery(D).apply({}, i, v), q.apply({}, i, v)))(
      ids, vals))
  train = jax.jit(lambda k: q.apply({}, ids, vals, train=True, rngs={"dropout": jax.random.key(k)}))
  outs = np.stack([np.asarray(train(k)) for k in range(50)])
  assert (outs[..., -1] == 1.0).all()  # the bias input is never dropped
  x, x_ref = outs[..., :-1].sum(-1), ref[:, :-1].sum(-1)  # (keys, N), (N,)
  kept = x != 0
  np.testing.assert_allclose(x[kept], np.broadcast_to(x_ref / (1 - rate), x.shape)[kept], rtol=1e-6)
  assert abs((~kept).mean() - rate) < 0.05
  np.testing.assert_array_equal(evaluated, ref)  # evaluation: no dropout


def test_wide_deep_is_linear_query_and_tower_side_by_side():
  ids, vals = _inputs()
  wd = WideDeepQuery(D, hidden=HID, out=OUT)
  params = jax.jit(wd.init)(jax.random.key(0), ids, vals)
  assert set(params["params"]) == {"tower"}  # the wide path has no parameters: it is the table
  q, lin, deep = map(np.asarray, jax.jit(lambda p: (  # one program
      wd.apply(p, ids, vals), LinearQuery(D).apply({}, ids, vals),
      SNMTower(D, HID, OUT).apply({"params": p["params"]["tower"]}, ids, vals)))(params))
  assert q.shape == (N, D + 1 + OUT)
  np.testing.assert_array_equal(q[:, :D + 1], lin)
  np.testing.assert_array_equal(q[:, D + 1:], deep)
  # A class row [w, b, e] scores w.x + b + e.tower(x).
  rng = np.random.default_rng(1)
  w, b, e = rng.normal(size=D), rng.normal(), rng.normal(size=OUT)
  x = np.zeros((N, D))
  np.add.at(x, (np.arange(N)[:, None], np.asarray(ids)), np.asarray(vals))
  np.testing.assert_allclose(q @ np.concatenate([w, [b], e]), x @ w + b + deep @ e, rtol=1e-5, atol=1e-5)


def test_wide_deep_dropout_only_in_training():
  ids, vals = _inputs()
  wd = WideDeepQuery(D, hidden=HID, out=OUT, dropout=0.5, feature_dropout=0.3)
  params = jax.jit(wd.init)(jax.random.key(0), ids, vals)
  det, plain, tr = map(np.asarray, jax.jit(lambda p, key: (  # one program
      wd.apply(p, ids, vals), WideDeepQuery(D, hidden=HID, out=OUT).apply(p, ids, vals),
      wd.apply(p, ids, vals, train=True, rngs={"dropout": key})))(params, jax.random.key(1)))
  np.testing.assert_array_equal(det, plain)
  assert not np.allclose(tr[:, :D], det[:, :D]) and not np.allclose(tr[:, D + 1:], det[:, D + 1:])
  assert (tr[:, D] == 1.0).all()


def test_embedding_bag_unchanged():
  ids, vals = _inputs()
  bag = EmbeddingBag(D, HID)
  p = bag.init(jax.random.key(0), ids, vals)
  ref = np.einsum("bn,bnh->bh", np.asarray(vals), np.asarray(p["params"]["embedding"])[np.asarray(ids)])
  np.testing.assert_allclose(np.asarray(bag.apply(p, ids, vals)), ref, rtol=1e-5, atol=1e-6)


def test_dense_bag_matmul_equals_the_gather_in_values_and_gradients():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from snm_jax.models.towers import SNMTower  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  d, n, nnz = 37, 6, 5
  ids = jnp.asarray(rng.integers(0, d, (n, nnz)), jnp.int32)  # repeated ids within a row too
  vals = jnp.asarray(rng.random((n, nnz)) * (rng.random((n, nnz)) > 0.3), jnp.float32)  # zeros = padding
  gather = SNMTower(num_features=d, hidden=8, out=4)
  dense = SNMTower(num_features=d, hidden=8, out=4, bag_matmul="dense")
  params = jax.jit(gather.init)(jax.random.key(0), ids, vals)
  loss = lambda m, params: jax.grad(lambda p: jnp.sum(jnp.sin(m.apply(p, ids, vals))))(params)  # noqa: E731
  values_dense, values_gather, grads_dense, grads_gather = jax.jit(lambda p: (  # one program
      dense.apply(p, ids, vals), gather.apply(p, ids, vals), loss(dense, p), loss(gather, p)))(params)
  np.testing.assert_allclose(values_dense, values_gather, atol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_dense), jax.tree.leaves(grads_gather), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("bias_column", [False, True])
def test_densify_equals_the_dense_rows(monkeypatch, flat, bias_column):
  """Padded rows -> dense rows: every nonzero in its (row, column), padding (value 0, id 0 or any)
  adding nothing, the bias column 1. Both index forms: one flat int32 index, and the (row,
  column) pairs used when N x width would not fit int32 (forced here by lowering the limit)."""
  if not flat:
    monkeypatch.setattr(towers, "FLAT_INDEX_LIMIT", 0)
  rng = np.random.default_rng(3)
  ids = np.zeros((N, NNZ), np.int32)
  vals = np.zeros((N, NNZ), np.float32)
  expected = np.zeros((N, D + int(bias_column)), np.float32)
  for i in range(N):
    length = i % (NNZ + 1)  # 0..NNZ real entries, the rest padding
    cols = rng.choice(D, size=length, replace=False)
    ids[i, :length], vals[i, :length] = cols, rng.standard_normal(length)
    ids[i, length:] = rng.integers(0, D, NNZ - length)  # padding ids need not be 0
    expected[i, cols] = vals[i, :length]
  if bias_column:
    expected[:, -1] = 1.0
  got = jax.jit(lambda i, v: towers.densify(i, v, D, bias_column=bias_column))(ids, vals)
  np.testing.assert_array_equal(np.asarray(got), expected)
