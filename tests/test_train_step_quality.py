"""The train step with the "Quality" options: dropout from a key folded out of
the step's rng (same negatives, rate 0 = today's bits), row-wise decay of the
touched rows with the table schedule's lr, and the linear / wide-and-deep
queries with unnormalised class rows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from snm_jax import sharding
from snm_jax.mining.samplers import StratifiedSampler
from snm_jax.models.towers import LinearQuery, SNMTower, WideDeepQuery
from snm_jax.train.core import row_optimizers
from snm_jax.train.core.step import LossSpec, TrainState, make_train_step
from step_fixtures import B, D, H, K, N, V, commit, loss_spec, make, toy_batch

KEY = jax.random.key(7)
TABLE_LR = 0.5


# _touched's draws in one program per sampler (op by op: ~15 small compiles).
_draws = jax.jit(lambda sampler, key: sampler.sample_strata(key, jnp.arange(V), None)[0], static_argnums=0)


def build(mesh_shape=(1, 1), *, model=None, dim=H, row_opt="sgd", weight_decay=0.0, normalize=True,
          dropout=None, table_lr=lambda s: TABLE_LR, spec=None, init_scale=1.0, per_example=False):
  """As step_fixtures.make, with the model, row decay, dropout flag and schedule open."""
  mesh = sharding.make_mesh(mesh_shape)
  model = model or SNMTower(num_features=D, hidden=H, out=H)
  b = toy_batch()
  # Op by op, as step_fixtures.make: test_defaults_are_todays_step_bit_for_bit compares the two
  # states' bits, and a jitted init rounds differently.
  params = model.init(jax.random.key(0), b["feat_ids"], b["feat_vals"])
  tx = optax.sgd(0.1)
  ropt = row_optimizers.get_row_optimizer(row_opt)._replace(weight_decay=weight_decay)
  table = init_scale * jax.random.normal(jax.random.key(1), (K, dim))
  state = TrainState.create(
      params=params, opt_state=tx.init(params),
      table=jax.device_put(table, sharding.named(mesh, sharding.TABLE)),
      table_state=jax.tree.map(lambda x: jax.device_put(x, sharding.named(mesh, jax.P(sharding.MODEL))),
                               ropt.init(K, dim)))
  state = commit(state, mesh)
  sampler = StratifiedSampler(K, B, num_strata=V, per_example=per_example)
  step = make_train_step(tower_apply=model.apply, tx=tx, row_opt=ropt, table_lr=table_lr, sampler=sampler,
                         loss=spec or loss_spec(), mesh=mesh, normalize_classes=normalize, donate=False,
                         dropout=dropout)
  batch = {k: jax.device_put(v, sharding.named(mesh, jax.P(sharding.DATA))) for k, v in b.items()}
  return dict(model=model, state=state, step=step, batch=batch, sampler=sampler, raw_batch=b)


@functools.cache
def _plain(row_opt):
  """build(row_opt=row_opt), shared by the tests that only read it (the step does not donate)."""
  return build(row_opt=row_opt)


def _run(setup, steps=2):
  st = setup["state"]
  for i in range(steps):
    st, m = setup["step"](st, setup["batch"], jax.random.fold_in(KEY, i))
  return st, m


def _leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves((state.params, state.table, state.table_state,
                                                  state.opt_state))]


def _assert_same_bits(a, b):
  for x, y in zip(_leaves(a), _leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def _touched(setup, key):
  """Rows the first step names on a (1, 1) mesh: the drawn negatives and the positives."""
  ids = _draws(setup["sampler"], key)
  touched = np.zeros(K, bool)
  touched[np.asarray(ids)] = True
  touched[setup["raw_batch"]["label"]] = True
  return touched


def test_defaults_are_todays_step_bit_for_bit():
  today = make((2, 4))  # the shared fixture: SNMTower, sgd rows, constant table lr, no dropout
  now = build((2, 4), model=SNMTower(num_features=D, hidden=H, out=H, dropout=0.0, feature_dropout=0.0))
  _assert_same_bits(_run(today)[0], _run(now)[0])


def test_rate_zero_with_the_dropout_flag_draws_nothing_and_changes_nothing():
  a = _plain("sgd")
  b = build(dropout=True)  # rates 0: train=True is the identity, no rng drawn
  _assert_same_bits(_run(a)[0], _run(b)[0])


def test_dropout_flag_defaults_to_the_modules_rates():
  model = SNMTower(num_features=D, hidden=H, out=H, dropout=0.5)
  auto, explicit, off = (build(model=model, dropout=d) for d in (None, True, False))
  a, e, o = _run(auto)[0], _run(explicit)[0], _run(off)[0]
  _assert_same_bits(a, e)
  assert not np.array_equal(np.asarray(a.table), np.asarray(o.table))
  _assert_same_bits(o, _run(_plain("sgd"))[0])  # dropout=False: the module's deterministic call


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)])
def test_dropout_changes_training_not_the_negatives_nor_evaluation(mesh_shape):
  spec = LossSpec(kind="sampled_softmax")  # every valid draw gets a gradient: touched rows show the draws
  # A tower wide enough that no query is all zero after dropout (with H = 8 hidden units some
  # example's bag can be dropped entirely, which zeroes its rows' gradients and hides its draws).
  wide = 8 * H
  plain = build(mesh_shape, spec=spec, model=SNMTower(num_features=D, hidden=wide, out=H))
  drop = build(mesh_shape, spec=spec, dropout=True,
               model=SNMTower(num_features=D, hidden=wide, out=H, dropout=0.5, feature_dropout=0.3))
  s0, m0 = plain["step"](plain["state"], plain["batch"], KEY)
  s1, m1 = drop["step"](drop["state"], drop["batch"], KEY)
  assert not np.allclose(float(m0["loss"]), float(m1["loss"]))
  assert not np.allclose(np.asarray(s0.params["params"]["proj"]["kernel"]),
                         np.asarray(s1.params["params"]["proj"]["kernel"]))
  # The same negatives were drawn: same valid-negative count, same rows moved.
  assert float(m0["valid_negatives"]) == float(m1["valid_negatives"])
  t0 = np.asarray(drop["state"].table)
  moved0 = np.abs(np.asarray(s0.table) - t0).sum(1) > 0
  moved1 = np.abs(np.asarray(s1.table) - t0).sum(1) > 0
  np.testing.assert_array_equal(moved0, moved1)
  # Same key, same dropout masks: bit-identical reruns.
  s2, _ = drop["step"](drop["state"], drop["batch"], KEY)
  _assert_same_bits(s1, s2)
  # Evaluation (the Evaluator's call) is deterministic and dropout-free.
  b = drop["raw_batch"]
  embed = jax.jit(drop["model"].apply)
  e1, e2 = embed(s1.params, b["feat_ids"], b["feat_vals"]), embed(s1.params, b["feat_ids"], b["feat_vals"])
  np.testing.assert_array_equal(np.asarray(e1), np.asarray(e2))
  no_drop = SNMTower(num_features=D, hidden=wide, out=H).apply(s1.params, b["feat_ids"], b["feat_vals"])
  np.testing.assert_allclose(np.asarray(e1), np.asarray(no_drop), atol=1e-6)


@pytest.mark.parametrize("row_opt", ["sgd", "momentum", "adagrad"])
def test_table_decay_scales_each_touched_row_once(row_opt):
  """First step: the decayed update is the plain one times (1 - lr wd) on the
  touched rows (momentum starts at 0, so the relation is exact); the others
  do not move."""
  wd = 0.2
  plain = _plain(row_opt)
  decayed = build(row_opt=row_opt, weight_decay=wd)
  s0, _ = plain["step"](plain["state"], plain["batch"], KEY)
  s1, _ = decayed["step"](decayed["state"], decayed["batch"], KEY)
  touched = _touched(plain, KEY)
  assert 0 < touched.sum() < K
  t0, t_plain, t_dec = (np.asarray(x.table) for x in (plain["state"], s0, s1))
  np.testing.assert_allclose(t_dec[touched], t_plain[touched] * (1 - TABLE_LR * wd), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(t_dec[~touched], t0[~touched])
  for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):  # the tower is not the table
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("per_example,with_dropout", [(False, False), (True, True)])
def test_sharded_decay_and_dropout_match_single_device(per_example, with_dropout):
  model = SNMTower(num_features=D, hidden=H, out=H, dropout=0.3 if with_dropout else 0.0)
  kw = dict(weight_decay=0.1, row_opt="momentum", per_example=per_example, model=model,
            dropout=with_dropout)
  ref, sh = build((1, 1), **kw), build((2, 4), **kw)
  a, _ = _run(ref, 3)
  b, _ = _run(sh, 3)
  np.testing.assert_allclose(np.asarray(b.table), np.asarray(a.table), atol=2e-6)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=2e-6)


def test_table_warmup_schedule_drives_update_and_decay():
  """At step 0 of a warm-up the table lr is 0: neither gradient nor decay moves
  a row (the decay uses the same lr); the tower still trains."""
  sched = optax.join_schedules([optax.linear_schedule(0.0, TABLE_LR, 4), optax.constant_schedule(TABLE_LR)], [4])
  s = build(weight_decay=0.3, table_lr=sched)
  st1, _ = s["step"](s["state"], s["batch"], KEY)
  np.testing.assert_array_equal(np.asarray(st1.table), np.asarray(s["state"].table))
  assert not np.array_equal(np.asarray(st1.params["params"]["proj"]["kernel"]),
                            np.asarray(s["state"].params["params"]["proj"]["kernel"]))
  st2, _ = s["step"](st1, s["batch"], jax.random.fold_in(KEY, 1))
  assert np.abs(np.asarray(st2.table) - np.asarray(st1.table)).max() > 0


def test_normalize_classes_must_be_resolved():
  with pytest.raises(ValueError, match="resolve_normalize_classes"):
    build(normalize=None)


@pytest.mark.parametrize("kind", ["linear", "wide_deep"])
def test_linear_kinds_learn_from_a_zero_table(kind):
  """normalize_classes=False (their auto value) and a zero table (their init
  scale): the training loss falls and the table's rows leave 0."""
  model, dim = ((LinearQuery(num_features=D), D + 1) if kind == "linear"
                else (WideDeepQuery(num_features=D, hidden=H, out=H), D + 1 + H))
  s = build(model=model, dim=dim, normalize=False, init_scale=0.0, spec=LossSpec(kind="sampled_softmax"))
  st, losses = s["state"], []
  for i in range(30):
    st, m = s["step"](st, s["batch"], jax.random.fold_in(KEY, i))
    losses.append(float(m["loss"]))
  assert np.isfinite(losses).all()
  assert np.mean(losses[-5:]) < 0.5 * losses[0], losses
  assert np.abs(np.asarray(st.table)).max() > 0
