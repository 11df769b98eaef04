"""The losses the trainer runs (`snm_jax.losses.sampled`, via `snm_jax.losses.registry`)
against NumPy references of the paper formulas, unsharded and on a 1-D mesh of
forced CPU devices via shard_map (negatives sharded over the axis)."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snm_jax.losses import registry, sampled
import np_reference as ref

P = jax.P
N, S, M = 4, 16, 4
LAM, NUM_SAMPLES = 0.3, S
HEAD_MINUS_TAIL, TAIL = np.array([0.5, 0.25], np.float32), 0.125
MINED_K = 3


def _hinge(x):
  return jnp.maximum(0.0, 1.0 - x)


def _np_hinge(x):
  return max(0.0, 1.0 - float(x))


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  pos = rng.normal(size=N).astype(np.float32)
  neg = rng.normal(size=(N, S)).astype(np.float32)
  valid = rng.random((N, S)) > 0.25
  valid[0] = False  # an example with no valid negative
  log_q = np.log(rng.uniform(0.1, 2.0, (N, S))).astype(np.float32)
  log_q_pos = np.log(rng.uniform(0.1, 2.0, N)).astype(np.float32)
  return pos, neg, valid, log_q, log_q_pos


def _fns(axis_name):
  return {
      "sampled_softmax": (
          lambda p, s, v, lq, lqp: sampled.sampled_softmax_loss(p, s, v, lq, log_q_pos=lqp, axis_name=axis_name),
          lambda p, s, v, lq, lqp: ref.np_sampled_softmax(p, s, v, lq, lqp)),
      "mined_softmax": (
          lambda p, s, v, lq, lqp: sampled.mined_softmax_loss(p, s, v, lq, k=MINED_K, log_q_pos=lqp,
                                                              axis_name=axis_name)[0],
          lambda p, s, v, lq, lqp: ref.np_mined_softmax(p, s, v, lq, lqp, MINED_K)[0]),
      "full_softmax": (
          lambda p, s, v, lq, lqp: sampled.sampled_softmax_loss(p, s, v, jnp.zeros_like(s), axis_name=axis_name),
          lambda p, s, v, lq, lqp: ref.np_sampled_softmax(p, s, v, np.zeros_like(s), np.zeros_like(p))),
      "logistic_ns": (
          lambda p, s, v, lq, lqp: sampled.logistic_negative_sampling_loss(p, s, v, axis_name=axis_name),
          lambda p, s, v, lq, lqp: ref.np_logistic_ns(p, s, v)),
      "adversarial_ns": (
          lambda p, s, v, lq, lqp: sampled.adversarial_ns_loss(p, s, v, lq, lqp, lam=LAM, num_samples=NUM_SAMPLES,
                                                              axis_name=axis_name),
          lambda p, s, v, lq, lqp: ref.np_adversarial_ns(p, s, v, lq, lqp, LAM, NUM_SAMPLES)),
      "nce": (
          lambda p, s, v, lq, lqp: sampled.nce_loss(p, s, v, lq, lqp, axis_name=axis_name),
          lambda p, s, v, lq, lqp: ref.np_nce(p, s, v, lq, lqp)),
      "bowl": (
          lambda p, s, v, lq, lqp: sampled.ordered_weighted_loss(
              p, s, v, head_minus_tail=HEAD_MINUS_TAIL, tail=TAIL, phi=_hinge, kind="bowl", axis_name=axis_name)[0],
          lambda p, s, v, lq, lqp: ref.np_sampled_owl(p, s, v, HEAD_MINUS_TAIL, TAIL, _np_hinge, "bowl")),
      "powl": (
          lambda p, s, v, lq, lqp: sampled.ordered_weighted_loss(
              p, s, v, head_minus_tail=HEAD_MINUS_TAIL, tail=TAIL, phi=_hinge, kind="powl", axis_name=axis_name)[0],
          lambda p, s, v, lq, lqp: ref.np_sampled_owl(p, s, v, HEAD_MINUS_TAIL, TAIL, _np_hinge, "powl")),
  }


@functools.cache
def _unsharded(kind):
  """kind's unsharded loss, jitted, and its NumPy reference: one program for the three tests below
  (their inputs have the same shapes)."""
  fn, np_fn = _fns(None)[kind]
  return jax.jit(fn), np_fn


KINDS = ("bowl", "powl", "sampled_softmax", "mined_softmax", "full_softmax", "logistic_ns", "adversarial_ns",
         "nce")


def test_registry_covers_the_trainer_kinds():
  from snm_jax.train.config.builders import LOSS_KINDS  # pylint: disable=g-import-not-at-top
  assert set(registry.LOSSES) == set(LOSS_KINDS) == set(KINDS)
  with pytest.raises(ValueError, match="unknown loss kind"):
    registry.get_loss("owl")


@pytest.mark.parametrize("kind", KINDS)
def test_unsharded_matches_numpy_reference(kind):
  args = _inputs()
  fn, np_fn = _unsharded(kind)
  got = fn(*map(jnp.asarray, args))
  np.testing.assert_allclose(np.asarray(got), np_fn(*args), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_equals_unsharded(kind):
  args = _inputs(1)
  fn_sh, _ = _fns("x")[kind]
  fn, np_fn = _unsharded(kind)
  mesh = jax.make_mesh((M,), ("x",), devices=jax.devices()[:M])
  neg_spec = P(None, "x")
  specs = (P(), neg_spec, neg_spec, neg_spec, P())
  sharded = jax.jit(jax.shard_map(fn_sh, mesh=mesh, in_specs=specs, out_specs=P()))
  got = sharded(*(jax.device_put(jnp.asarray(a), jax.NamedSharding(mesh, sp)) for a, sp in zip(args, specs)))
  want = fn(*map(jnp.asarray, args))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got), np_fn(*args), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_registry_entry_is_the_sampled_loss(kind):
  """The registry adapter (as the step calls it) returns the sampled loss of its kind."""
  pos, neg, valid, log_q, log_q_pos = map(jnp.asarray, _inputs(2))
  spec = types.SimpleNamespace(kind=kind, head_minus_tail=HEAD_MINUS_TAIL, tail=TAIL, phi=_hinge, lam=LAM,
                               mined_k=MINED_K, dense_score_grad=True)
  loss = jax.jit(lambda *a: registry.get_loss(kind)(*a, spec=spec, num_samples=NUM_SAMPLES, axis_name=None,
                                                    score_at=None))  # as the (jitted) step calls it
  per_ex, hardest = loss(pos, neg, valid, log_q, log_q_pos)
  want = _unsharded(kind)[0](pos, neg, valid, log_q, log_q_pos)
  np.testing.assert_array_equal(np.asarray(per_ex), np.asarray(want))
  assert (hardest is not None) == (kind in ("bowl", "powl"))
