"""builders for the "Quality" options: decoupled tower weight decay against a
hand-computed reference, the table's learning-rate schedule, dropout / model
kinds, the normalize_classes "auto" resolution and the new fields' validation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import flags
from ml_collections import config_flags

from experiments.configs.common import base_config
from snm_jax.errors import ConfigError
from snm_jax.models.towers import LinearQuery, SNMTower, WideDeepQuery
from snm_jax.train.config import builders, validation
from experiments.sweeps.spec import apply_overrides

LR, MOM, WD = 0.1, 0.9, 0.05


def _config(**overrides):
  c = base_config()
  c.optimizer.learning_rate = LR
  c.optimizer.momentum = MOM
  c.train.num_steps = 20
  return apply_overrides(c, overrides)


def _tiny_params():
  rng = np.random.default_rng(0)
  return {"params": {"bag": {"embedding": rng.normal(size=(3, 2)).astype(np.float32)},
                     "proj": {"kernel": rng.normal(size=(2, 2)).astype(np.float32),
                              "bias": rng.normal(size=(2,)).astype(np.float32)}}}


def _grads(step):
  rng = np.random.default_rng(100 + step)
  return jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), _tiny_params())


def _reference(name, params, steps, wd):
  """p <- p - lr (u_t + wd * [p is a kernel / embedding] * p), in float64, with
  u_t the optimiser's direction from the gradients alone."""
  flat = {k: {kk: v.astype(np.float64) for kk, v in d.items()} for k, d in params["params"].items()}
  state = {}
  for t in range(1, steps + 1):
    g = _grads(t - 1)["params"]
    for mod, leaves in flat.items():
      for leaf, p in leaves.items():
        gl = g[mod][leaf].astype(np.float64)
        key = (mod, leaf)
        if name == "sgd":
          u = gl
        elif name == "momentum":
          state[key] = MOM * state.get(key, 0.0) + gl
          u = state[key]
        elif name == "adagrad":
          state[key] = state.get(key, 0.1) + gl ** 2
          u = gl / np.sqrt(state[key] + 1e-7)
        else:  # adam
          m, v = state.get(key, (0.0, 0.0))
          m, v = 0.9 * m + 0.1 * gl, 0.999 * v + 0.001 * gl ** 2
          state[key] = (m, v)
          u = (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
        decay = wd * p if leaf in ("kernel", "embedding") else 0.0
        leaves[leaf] = p - LR * (u + decay)
  return {"params": flat}


def _run(tx, params, steps):
  """steps optimiser steps, each one jitted program (as in the train step), not op by op."""
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for t in range(steps):
    params, state = step(params, state, _grads(t))
  return params, state


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam"])
@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_tower_weight_decay_equals_hand_computed_reference(name, on_nonfinite):
  params = jax.tree.map(jnp.asarray, _tiny_params())
  tx = builders.make_tower_optimizer(_config(**{"optimizer.name": name, "optimizer.weight_decay": WD,
                                                "train.on_nonfinite": on_nonfinite}))
  got, _ = _run(tx, params, 3)
  ref = _reference(name, _tiny_params(), 3, WD)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=1e-6)
  # The reference without decay differs: the decay did something (biases excepted).
  plain = _reference(name, _tiny_params(), 3, 0.0)
  assert not np.allclose(np.asarray(got["params"]["proj"]["kernel"]), plain["params"]["proj"]["kernel"])
  np.testing.assert_allclose(np.asarray(got["params"]["proj"]["bias"]), plain["params"]["proj"]["bias"],
                             rtol=2e-5, atol=1e-6)


_SCHED = optax.constant_schedule(LR)


@pytest.mark.parametrize("name,plain", [  # what make_tower_optimizer built before weight decay
    ("sgd", lambda: optax.sgd(_SCHED)), ("momentum", lambda: optax.sgd(_SCHED, momentum=MOM)),
    ("adam", lambda: optax.adam(_SCHED)), ("adagrad", lambda: optax.adagrad(_SCHED))])
def test_zero_weight_decay_is_todays_optimizer_bit_for_bit(name, plain):
  params = jax.tree.map(jnp.asarray, _tiny_params())
  got, got_state = _run(builders.make_tower_optimizer(_config(**{"optimizer.name": name})), params, 3)
  want, want_state = _run(plain(), params, 3)
  assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
  for a, b in zip(jax.tree.leaves((got, got_state)), jax.tree.leaves((want, want_state)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_table_schedule_default_is_the_constant_learning_rate():
  c = _config(**{"table.learning_rate": 0.7})
  sched = builders.make_table_schedule(c)
  assert [sched(s) for s in (0, 5, 10**6)] == [0.7, 0.7, 0.7]
  assert type(sched(0)) is float  # the same Python scalar the loop's constant lambda returned


def test_table_schedule_warmup_and_cosine():
  c = _config(**{"table.learning_rate": 2.0, "table.warmup_steps": 4, "table.decay": "cosine",
                 "train.num_steps": 20})
  sched = jax.jit(builders.make_table_schedule(c))  # one program for the five steps, as optax calls it
  got = [float(sched(s)) for s in (0, 2, 4, 12, 20)]
  np.testing.assert_allclose(got, [0.0, 1.0, 2.0, 1.0, 0.0], atol=1e-6)
  # The tower's schedule is unaffected by the table's fields.
  assert float(builders.make_schedule(c.optimizer, 20)(0)) == LR


def test_row_optimizer_carries_the_table_weight_decay():
  default = builders.make_row_optimizer(_config())
  assert default.weight_decay == 0.0 and default.additive  # SGD's scatter-add path, no decay
  opt = builders.make_row_optimizer(_config(**{"table.optimizer": "momentum", "table.weight_decay": 0.01}))
  assert opt.weight_decay == 0.01 and not opt.additive


@pytest.mark.parametrize("kind,cls,dim", [("snm_tower", SNMTower, 32), ("linear", LinearQuery, 11),
                                          ("wide_deep", WideDeepQuery, 11 + 32)])
def test_make_tower_kinds_and_widths(kind, cls, dim):
  c = _config(**{"model.kind": kind, "model.out": 32, "model.hidden": 16,
                 "model.feature_dropout": 0.1})
  tower, width = builders.make_tower(c, 10)
  assert isinstance(tower, cls) and width == dim and tower.feature_dropout == 0.1
  ids, vals = np.zeros((2, 3), np.int32), np.ones((2, 3), np.float32)
  init_apply = jax.jit(lambda i, v: tower.apply(tower.init(jax.random.key(0), i, v), i, v))  # one program
  assert init_apply(ids, vals).shape == (2, dim)
  assert builders.table_init_scale(c) == (1.0 if kind == "snm_tower" else 0.0)
  assert builders.tower_has_dropout(c) and not builders.tower_has_dropout(_config(**{"model.kind": kind}))


@pytest.mark.parametrize("kind,auto", [("snm_tower", True), ("linear", False), ("wide_deep", False)])
def test_normalize_classes_auto(kind, auto):
  c = _config(**{"model.kind": kind})
  assert c.model.normalize_classes is None
  assert builders.resolve_normalize_classes(c) is auto
  validation.validate(c, 100)
  c.model.normalize_classes = False
  assert builders.resolve_normalize_classes(c) is False
  c.model.normalize_classes = True
  if kind == "snm_tower":
    assert builders.resolve_normalize_classes(c) is True
  else:
    with pytest.raises(ConfigError, match=r"model\.normalize_classes.*initialised to 0"):
      validation.validate(c, 100)
    with pytest.raises(ConfigError, match=r"model\.normalize_classes"):
      builders.resolve_normalize_classes(c)


@pytest.mark.parametrize("arg,value", [("False", False), ("false", False), ("True", True), (None, None)])
def test_normalize_classes_parses_from_the_command_line(arg, value):
  argv = ["prog"] + ([f"--config.model.normalize_classes={arg}"] if arg else [])
  fv = flags.FlagValues()
  config_flags.DEFINE_config_dict("config", base_config(), flag_values=fv, sys_argv=argv)
  fv(argv)
  assert fv.config.model.normalize_classes is value


@pytest.mark.parametrize("field,value,message", [
    ("optimizer.weight_decay", -0.1, ">= 0"),
    ("table.weight_decay", -1e-3, ">= 0"),
    ("table.weight_decay", 2.0, "must be < 1"),  # table.learning_rate = 1.0 by default
    ("model.dropout", 1.0, r"\[0, 1\)"),
    ("model.dropout", -0.2, r"\[0, 1\)"),
    ("model.feature_dropout", 1.5, r"\[0, 1\)"),
    ("table.decay", "linear", r"\['constant', 'cosine'\]"),
    ("table.warmup_steps", -1, ">= 0"),
    ("model.kind", "deep", "wide_deep"),
])
def test_new_fields_are_validated(field, value, message):
  c = _config(**{field: value})
  with pytest.raises(ConfigError, match=rf"config\.{field}: .*{message}"):
    validation.validate(c, 100)


def test_dropout_on_the_linear_model_is_rejected():
  c = _config(**{"model.kind": "linear", "model.dropout": 0.2})
  with pytest.raises(ConfigError, match=r"model\.dropout.*feature_dropout"):
    validation.validate(c, 100)
  validation.validate(_config(**{"model.kind": "linear", "model.feature_dropout": 0.2}), 100)


def test_defaults_validate_and_change_nothing():
  c = base_config()
  validation.validate(c, 100)
  assert (c.optimizer.weight_decay, c.table.weight_decay, c.model.dropout, c.model.feature_dropout,
          c.table.warmup_steps, c.table.decay) == (0.0, 0.0, 0.0, 0.0, 0, "constant")


@pytest.mark.parametrize("overrides,dense", [
    ({"mining.k": 16, "mining.num_samples": 64}, True),       # S = 4 k: two matmuls beat the rescoring
    ({"mining.k": 1, "mining.num_samples": 64}, False),       # S = 64 k: rescore the hardest
    ({"mining.k": 16, "mining.num_samples": 4096}, False),
    ({"mining.k": 16, "mining.num_samples": 64, "mining.per_example": True}, False),  # N x S x h einsums
    ({"mining.k": 16, "mining.num_samples": 64, "mining.vartheta": "negative_sampling"}, False),  # no head
])
def test_the_score_gradient_is_dense_only_where_it_is_cheaper(overrides, dense):
  c = _config(**{"loss.kind": "bowl", "mining.sampler": "uniform", "mining.vartheta": "top_k",
                 "mining.num_strata": 1, **overrides})
  spec = builders.make_loss_spec(c, 1000)
  assert spec.dense_score_grad is dense
