"""Margin surrogates: values vs NumPy, upper bound on the 0-1 loss, stability, grads."""

import math

import jax
import numpy as np
import pytest

from snm_jax import losses

NP_PHI = {
    "hinge": lambda u: np.maximum(1 - u, 0),
    "squared_hinge": lambda u: np.maximum(1 - u, 0) ** 2,
    "logistic": lambda u: np.log1p(np.exp(-u)) / math.log(2),
    "exponential": lambda u: np.exp(-u),
    "ramp": lambda u: np.where(u <= 0, 1.0, np.where(u <= 1.0, 1 - u, 0.0)),
}


U = np.random.default_rng(0).normal(scale=3, size=200)
U[:3] = [0.0, 1.0, -1.0]  # kinks
GRID = np.linspace(-5.0, 5.0, 1001, dtype=np.float32)
U_SMOOTH = np.array([-1.7, -0.3, 0.4, 0.8, 1.9])  # away from kinks


@pytest.fixture(scope="module")
def values():
  """{name: (phi(U), phi(GRID))} for every surrogate, one program."""
  return jax.jit(lambda u, grid: {name: (losses.get_phi(name)(u), losses.get_phi(name)(grid))
                                  for name in NP_PHI})(U.astype(np.float32), GRID)


@pytest.fixture(scope="module")
def grads():
  """{name: phi'(U_SMOOTH)} in float64 for every surrogate, one program."""
  with jax.enable_x64(True):
    return jax.tree.map(np.asarray, jax.jit(lambda u: {
        name: jax.vmap(jax.grad(losses.get_phi(name)))(u) for name in NP_PHI})(U_SMOOTH))


@pytest.mark.parametrize("name", sorted(NP_PHI))
def test_values_match_numpy(name, values):
  np.testing.assert_allclose(values[name][0], NP_PHI[name](U), rtol=2e-5, atol=1e-6)


def test_ramp_rho():
  u = np.array([-2.0, 0.0, 0.1, 0.25, 0.5, 0.7])
  np.testing.assert_allclose(jax.jit(losses.get_phi("ramp", rho=0.5))(u),
                             [1.0, 1.0, 0.8, 0.5, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("name", sorted(NP_PHI))
def test_upper_bounds_zero_one_and_non_increasing(name, values):
  phi = np.asarray(values[name][1])
  assert np.all(phi >= (GRID <= 0) - 1e-6)
  assert np.all(np.diff(phi) <= 1e-6)
  assert phi[500] >= 1.0 - 1e-6  # phi(0) >= 1


def test_logistic_stable_for_large_magnitudes():
  u = np.array([-1e4, -100.0, 100.0, 1e4], np.float32)
  val, g = map(np.asarray, jax.jit(lambda u: (losses.logistic(u), jax.vmap(jax.grad(losses.logistic))(u)))(u))
  np.testing.assert_allclose(val, np.logaddexp(0, -np.asarray(u, np.float64)) / math.log(2),
                             rtol=1e-6, atol=1e-30)  # float32 underflows exp(-100)
  np.testing.assert_allclose(g, [-1 / math.log(2), -1 / math.log(2), 0, 0], atol=1e-6)


@pytest.mark.parametrize("name", sorted(NP_PHI))
def test_grad_matches_finite_differences(name, grads):
  u = U_SMOOTH
  g = grads[name]
  eps = 1e-6
  fd = (NP_PHI[name](u + eps) - NP_PHI[name](u - eps)) / (2 * eps)
  np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)


def test_get_phi_registry():
  assert losses.get_phi("hinge") is losses.hinge
  fn = lambda u: u * 0
  assert losses.get_phi(fn) is fn
  with pytest.raises(ValueError, match=r"'hindge'.*exponential.*hinge.*logistic.*ramp"):
    losses.get_phi("hindge")
  with pytest.raises(ValueError, match="rho"):
    losses.get_phi("ramp", rho=0.0)
