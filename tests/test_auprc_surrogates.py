"""SOPRC surrogates (Eq. 7) against closed forms and their bound properties."""
import jax
import jax.numpy as jnp
import numpy as np

from snm_jax.auprc import one_sided_huber, one_sided_sigmoid


def _np_huber(x, tau):
  return np.where(x < 0, 1 - 2 * x / tau,
                  np.where(x < tau, (1 - x / tau) ** 2, 0.0))


def _np_sigmoid(x, tau):
  e = np.exp(-x / tau)
  return np.where(x < 0, (e - 1) / (e + 1), 0.0)


def test_huber_matches_piecewise_definition_and_bounds_indicator():
  tau = 0.3
  x = np.concatenate([np.linspace(-2, 2, 401), [0.0, tau, -tau, 1e-7, -1e-7]])
  got = np.asarray(jax.jit(one_sided_huber)(jnp.asarray(x, jnp.float32), tau))
  np.testing.assert_allclose(got, _np_huber(x, tau), rtol=1e-5, atol=1e-6)
  assert np.all(got >= (x <= 0) - 1e-6)          # upper bound of 1[x <= 0]
  assert np.all(np.diff(got[:401]) <= 1e-7)       # non-increasing
  np.testing.assert_allclose(float(one_sided_huber(0.0, tau)), 1.0)
  # C^1: the derivative is -2/tau on both sides of 0 and 0 on both sides of tau.
  g = jax.jit(jax.vmap(jax.grad(lambda t: one_sided_huber(t, tau))))
  np.testing.assert_allclose(g(jnp.array([-1e-6, 1e-6])), [-2 / tau] * 2, rtol=1e-4)
  np.testing.assert_allclose(g(jnp.array([tau - 1e-6, tau + 1e-6])), [0, 0], atol=1e-4)


def test_sigmoid_matches_definition_lower_bounds_and_limits():
  tau = 0.05
  x = np.linspace(-1, 1, 401)
  got = np.asarray(jax.jit(one_sided_sigmoid)(jnp.asarray(x, jnp.float32), tau))
  np.testing.assert_allclose(got, _np_sigmoid(x, tau), rtol=1e-5, atol=1e-6)
  assert np.all(got <= (x <= 0) + 1e-7)  # lower bound of 1[x <= 0]
  assert np.all(got >= 0)
  # Lipschitz with constant 1 / (2 tau), attained just left of 0.
  g = np.asarray(jax.jit(jax.vmap(jax.grad(lambda t: one_sided_sigmoid(t, tau))))(
      jnp.asarray(x, jnp.float32)))
  assert np.max(np.abs(g)) <= 1 / (2 * tau) + 1e-3
  np.testing.assert_allclose(float(jax.grad(one_sided_sigmoid)(-1e-7, tau)),
                             -1 / (2 * tau), rtol=1e-3)
  # Tends to 1[x < 0] as tau -> 0, away from 0.
  far = np.array([-0.5, -0.05, 0.05, 0.5], np.float32)
  errs = [np.max(np.abs(np.asarray(one_sided_sigmoid(far, t)) - (far < 0)))
          for t in (1e-1, 1e-2, 1e-3)]
  assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-6


def test_surrogates_finite_for_huge_inputs():
  x = jnp.array([-1e30, -1e4, 1e4, 1e30], jnp.float32)
  for f in (lambda t: one_sided_sigmoid(t, 1e-3), lambda t: one_sided_huber(t, 0.1)):
    assert np.all(np.isfinite(np.asarray(jax.vmap(jax.grad(f))(x))))
  np.testing.assert_allclose(one_sided_sigmoid(x, 1e-3), [1, 1, 0, 0])
