"""Exact ordered weighted losses: NumPy reference, classical special cases, Theorem 3."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from np_reference import NP_PHI, np_owl
from snm_jax import losses


def _cases(rng, num_classes):
  """Random scores with ties, plus the labels to test."""
  v = rng.normal(size=num_classes)
  v[1] = v[3]  # tie among negatives
  v[2] = v[0]  # tie between the label 0 and a negative
  return v


@pytest.mark.parametrize("kind,phi", list(itertools.product(["powl", "bowl"], sorted(NP_PHI))))
def test_matches_numpy_reference(kind, phi):
  rng = np.random.default_rng(1)
  fn = jax.jit(jax.vmap(lambda v, y, t: losses.owl_loss(v, y, t, phi, kind)))
  num_classes, n = 7, 12
  v = np.stack([_cases(rng, num_classes) for _ in range(n)])
  v[-1] *= 50.0  # large magnitudes
  y = rng.integers(0, num_classes, size=n)
  y[:3] = 0
  theta = -np.sort(-rng.uniform(size=(n, num_classes - 1)), axis=1)
  got = np.asarray(fn(v.astype(np.float32), y, theta.astype(np.float32)))
  want = [np_owl(v[i].astype(np.float32).astype(np.float64), y[i], theta[i], NP_PHI[phi], kind)
          for i in range(n)]
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)


def test_special_cases():
  rng = np.random.default_rng(2)
  num_classes, n = 6, 10
  v = rng.normal(size=(n, num_classes))
  y = rng.integers(0, num_classes, size=n)
  e1 = np.eye(num_classes - 1, dtype=np.float32)[0]
  ones = np.ones(num_classes - 1, np.float32)

  @jax.jit
  @jax.vmap
  def ours(s, label):
    return (losses.powl(s, label, e1), losses.powl(s, label, ones),
            losses.bowl(s, label, ones))

  got = np.stack(ours(v.astype(np.float32), y), axis=1)
  for i in range(n):
    pos, others = v[i, y[i]], np.delete(v[i], y[i])
    crammer_singer = max(0.0, 1 - (pos - others.max()))
    weston_watkins = np.sum(np.maximum(0, 1 - (pos - others)))
    lee = max(0.0, 1 - pos) + np.sum(np.maximum(0, 1 + others))
    np.testing.assert_allclose(got[i], [crammer_singer, weston_watkins, lee],
                               rtol=1e-5, atol=1e-6)


def test_theta_shape_and_kind_validation():
  with pytest.raises(ValueError, match=r"theta: expected shape \(K-1,\) = \(4,\)"):
    losses.powl(np.zeros(5, np.float32), 0, np.ones(5, np.float32))
  with pytest.raises(ValueError, match="kind"):
    losses.owl_loss(np.zeros(5, np.float32), 0, np.ones(4, np.float32), kind="owl")


@pytest.mark.parametrize("kind", ["powl", "bowl"])
def test_grad_matches_finite_differences(kind):
  rng = np.random.default_rng(3)
  v = rng.normal(size=6) * 0.3  # distinct, inside the smooth region of logistic
  y = 2
  theta = np.array([0.5, 0.3, 0.2, 0.1, 0.0])
  with jax.enable_x64(True):
    grad_fn = jax.jit(jax.grad(lambda s: losses.owl_loss(s, y, theta, "logistic", kind)))
    g = np.asarray(grad_fn(v))
  f = lambda x: np_owl(x, y, theta, NP_PHI["logistic"], kind)
  eps = 1e-6
  fd = np.array([(f(v + eps * e) - f(v - eps * e)) / (2 * eps) for e in np.eye(6)])
  np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)
  assert abs(g[y]) > 0.1


def test_theorem3_surrogate_inequality():
  """POWL with theta_j = 1/k (j <= k) >= 1[y not in top-k]; BOWL >= twice that."""
  rng = np.random.default_rng(4)
  num_classes, k, n = 10, 3, 400
  v = rng.normal(size=(n, num_classes)) * rng.choice([0.1, 1.0, 5.0], size=(n, 1))
  y = rng.integers(0, num_classes, size=n)
  theta = np.r_[np.full(k, 1 / k), np.zeros(num_classes - 1 - k)].astype(np.float32)
  # y is outside the top k iff at least k other labels score >= v_y.
  missed = (np.sum(v >= v[np.arange(n), y][:, None], axis=1) - 1) >= k
  assert 0.3 < missed.mean() < 0.95  # both outcomes are exercised
  phis = ["hinge", "squared_hinge", "logistic", "exponential", "ramp"]

  vj = v.astype(np.float32)
  # One jit per phi: XLA compile time grows steeply with many sorts in one program.
  got = np.stack([
      np.asarray(jax.jit(jax.vmap(lambda s, l, phi=phi: jnp.stack(
          [losses.powl(s, l, theta, phi), losses.bowl(s, l, theta, phi)])))(vj, y))
      for phi in phis], axis=1)
  for i, phi in enumerate(phis[:4]):  # convex phi: both bounds
    assert np.all(got[:, i, 0] >= missed - 1e-5), phi
    assert np.all(got[:, i, 1] >= 2 * missed - 1e-5), phi
  assert np.all(got[:, 4, 0] >= missed - 1e-5)  # ramp (non-convex): POWL bound only
  # The BOWL factor 2 is tight for hinge: equality when v_y = v_[j] = 0 for j <= k.
  tight = np.zeros(num_classes, np.float32)
  tight[k + 1:] = -5.0
  np.testing.assert_allclose(jax.jit(lambda s: losses.bowl(s, 0, theta, "hinge"))(tight), 2.0)
