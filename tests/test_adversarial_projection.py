"""The tree's PCA (`adversarial/projection.py`): the truncated SVD of the implicitly centred
matrix (large d) against exact references, and its memory and time at d = 200,000."""

import time
import tracemalloc

import numpy as np
import pytest
import scipy.sparse

from snm_jax import adversarial as adv
from snm_jax.adversarial import projection


def _planted(n, d, strong, seed, density):
  """Sparse (n, d) features: background nonzeros plus `strong` columns (random positions) with
  distinct, well separated scales, so the top components are determined by clear eigen-gaps."""
  rng = np.random.default_rng(seed)
  x = scipy.sparse.random(n, d, density=density, format="csr", random_state=rng, dtype=np.float64)
  cols = rng.choice(d, size=strong, replace=False)
  rows = rng.random((n, strong)) < 0.3
  r, c = np.nonzero(rows)
  scale = 3.0 * 0.85 ** np.arange(strong)
  planted = scipy.sparse.csr_matrix((rng.random(r.size) * scale[c], (r, cols[c])), shape=(n, d))
  return (x + planted).tocsr()


def _variances(x, mean, comps):
  """Variance of the data along each component: ||(X - 1 mu^T) c||^2 / N (float64)."""
  proj = np.asarray(x @ comps.T.astype(np.float64)) - mean.astype(np.float64) @ comps.T
  return (proj ** 2).mean(axis=0)


def _gapped(var, rel_gap=0.02):
  """Components whose variance is separated from both neighbours by > rel_gap (relative); the
  last one's lower neighbour is not fitted, so it never counts."""
  gaps = np.abs(np.diff(var)) / var[:-1]
  left = np.concatenate([[np.inf], gaps])
  right = np.concatenate([gaps, [0.0]])
  return (left > rel_gap) & (right > rel_gap)


def _check_agrees(x, got, ref, k):
  mean_g, comps_g = got
  mean_r, comps_r = ref
  np.testing.assert_allclose(mean_g, mean_r, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(comps_g.astype(np.float64) @ comps_g.T, np.eye(k), atol=1e-5)
  var_g, var_r = _variances(x, mean_r, comps_g), _variances(x, mean_r, comps_r)
  np.testing.assert_allclose(var_g, var_r, rtol=1e-4)
  assert np.all(np.diff(var_g) <= 1e-9 * var_g[0])  # decreasing variance
  cos = np.abs(np.sum(comps_g.astype(np.float64) * comps_r, axis=1))
  gapped = _gapped(var_r)
  assert gapped.sum() >= k // 2, var_r  # the test data must determine most components
  assert np.all(cos[gapped] > 0.999), (cos, gapped)
  # The sign rule (largest-|.| entry positive) makes gapped components equal, not only parallel.
  np.testing.assert_allclose(comps_g[gapped], comps_r[gapped], atol=2e-3)


@pytest.mark.parametrize("sparse", [True, False])
def test_truncated_svd_matches_the_dense_covariance_pca(sparse):
  x = _planted(3000, 400, strong=12, seed=0, density=0.02)
  features = x if sparse else x.toarray()
  k = 8
  exact = adv.fit_projection(features, k)  # d = 400 <= EXACT_MAX_DIM: the dense covariance
  iterative = adv.fit_projection(features, k, exact_max_dim=0)
  _check_agrees(x, iterative, exact, k)
  # Deterministic: the start vector comes from a fixed seed.
  again = adv.fit_projection(features, k, exact_max_dim=0)
  assert all(np.array_equal(a, b) for a, b in zip(iterative, again))


def test_the_exact_path_is_kept_for_small_d():
  x = _planted(500, 60, strong=6, seed=1, density=0.1)
  mean, comps = adv.fit_projection(x, 4)
  xd = x.toarray()
  cov = np.cov(xd, rowvar=False, bias=True)
  vecs = np.linalg.eigh(cov)[1][:, ::-1][:, :4].T
  vecs *= np.sign(vecs[np.arange(4), np.abs(vecs).argmax(axis=1)])[:, None]
  np.testing.assert_allclose(comps, vecs, atol=1e-5)
  np.testing.assert_allclose(mean, xd.mean(0), rtol=1e-6)


def test_d_200000_sparse_fits_in_bounded_memory_and_time_and_matches_the_gram_reference():
  n, d, k = 2000, 200_000, 16
  x = _planted(n, d, strong=24, seed=2, density=1e-4)  # about 20 background nonzeros per row
  tracemalloc.start()
  t0 = time.perf_counter()
  mean, comps = adv.fit_projection(x, k)
  seconds = time.perf_counter() - t0
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert d > projection.EXACT_MAX_DIM
  # A few copies of the (k, d) float64 components (25.6 MB each); the d x d covariance is 320 GB.
  assert peak < 128 * 2**20, peak / 2**20
  assert seconds < 10.0, seconds
  assert mean.shape == (d,) and comps.shape == (k, d)
  # Exact reference through the N x N Gram matrix of the centred rows (N small):
  # C C^T = U S^2 U^T, components = C^T U / S.
  mu = np.asarray(x.mean(axis=0)).ravel()
  xc_u = lambda u: x.T @ u - np.outer(mu, u.sum(axis=0))  # C^T u for (N, m) u
  ones = np.ones(n)
  xmu = x @ mu
  gram = (x @ x.T).toarray() - np.outer(xmu, ones) - np.outer(ones, xmu) + mu @ mu
  evals, u = np.linalg.eigh(gram)
  top = np.argsort(evals)[::-1][:k]
  ref = (xc_u(u[:, top]) / np.sqrt(evals[top])).T
  ref *= np.sign(ref[np.arange(k), np.abs(ref).argmax(axis=1)])[:, None]
  _check_agrees(x, (mean, comps), (mu, ref), k)


def test_too_many_components_for_the_truncated_svd_is_a_clear_error():
  x = scipy.sparse.random(5, 50, density=0.3, format="csr", random_state=0)
  with pytest.raises(ValueError, match="k < min"):
    adv.fit_projection(x, 5, exact_max_dim=10)
