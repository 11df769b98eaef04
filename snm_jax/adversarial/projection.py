"""PCA projection of raw features to the k dimensions the tree works in (paper: k = 16).

The components are the top-k eigenvectors of the feature covariance
Sigma = (1/N) sum_n (x_n - mu)(x_n - mu)^T, i.e. the top-k right singular
vectors of the centred (N, d) matrix X - 1 mu^T. Two ways to get them:

  * d <= EXACT_MAX_DIM: the dense d x d covariance and its top-k eigenpairs by
    LAPACK's syevr (`scipy.linalg.eigh(subset_by_index=...)`; exact; at most
    128 MiB and a few seconds at d = 4096).
  * larger d (e.g. d = 135,909 features: a dense covariance of 148 GB): a
    truncated SVD of the centred matrix with ARPACK (`scipy.sparse.linalg.svds`)
    on a `LinearOperator` that applies X and subtracts the mean implicitly,
    never densifying X: each product costs O(nnz(X) + N + d), a restart cycle of
    the Lanczos iteration about 2k of them, and memory is X plus about 2k
    vectors of length min(N, d). The start vector is drawn from a fixed seed,
    so the result is deterministic, and ARPACK converges to machine precision:
    it agrees with the exact path wherever the eigen-gaps determine the
    components (tests/test_adversarial_projection.py).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.sparse
import scipy.sparse.linalg

# Largest feature dimension d whose PCA uses the dense d x d covariance (float64: 128 MiB at 4096).
EXACT_MAX_DIM = 4096


def fit_projection(features, k: int, *, exact_max_dim: int = EXACT_MAX_DIM,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Top-k principal components of the training features.

  Args:
    features: (N, d) dense array or scipy.sparse matrix (never densified).
    k: number of components, k <= d (and k < min(N, d) when d > exact_max_dim).
    exact_max_dim: up to this d the dense d x d covariance is decomposed exactly;
      above it, the truncated SVD of the implicitly centred matrix (module docstring).
    seed: the truncated SVD's start vector (the result does not depend on it beyond
      round-off where eigen-gaps allow).

  Returns:
    mean: (d,) float32; components: (k, d) float32 with orthonormal rows, ordered by
    decreasing variance, each row's largest-magnitude entry positive. Project with
    (x - mean) @ components.T (`project`).
  """
  n, d = features.shape
  if not 0 < k <= d:
    raise ValueError(f"need 0 < k <= d = {d}, got k = {k}")
  if d <= exact_max_dim:
    mean, components = _covariance_pca(features, k)
  else:
    mean, components = _truncated_svd_pca(features, k, seed)
  # Fix each component's sign (largest-magnitude entry positive) for reproducibility.
  components *= np.sign(components[np.arange(k), np.abs(components).argmax(axis=1)])[:, None]
  return mean.astype(np.float32), components.astype(np.float32)


def _covariance_pca(features, k: int) -> tuple[np.ndarray, np.ndarray]:
  """(mean (d,), components (k, d)) float64 from eigh of the dense d x d covariance."""
  n, _ = features.shape
  if scipy.sparse.issparse(features):
    x = features.astype(np.float64)
    mean = np.asarray(x.mean(axis=0)).ravel()
    second = np.asarray((x.T @ x).todense()) / n
  else:
    x = np.asarray(features, np.float64)
    mean = x.mean(axis=0)
    second = x.T @ x / n
  cov = second - np.outer(mean, mean)
  # The top k eigenpairs only (LAPACK syevr): back-transforming all d eigenvectors was most of the
  # full decomposition's time (Bibtex, d = 1836, k = 8: 5.2 s against 2.5 s, the same vectors to 1e-14).
  d = cov.shape[0]
  _, vecs = scipy.linalg.eigh(cov, subset_by_index=[d - k, d - 1], driver="evr")
  return mean, vecs[:, ::-1].T


def _truncated_svd_pca(features, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(mean (d,), components (k, d)) float64: the top-k right singular vectors of X - 1 mu^T,
  by ARPACK on an operator that never forms the centred (or any d x d) matrix."""
  n, d = features.shape
  if k >= min(n, d):
    raise ValueError(f"the truncated SVD (d = {d} > exact_max_dim) needs k < min(N, d) = "
                     f"{min(n, d)}, got k = {k}")
  if scipy.sparse.issparse(features):
    x = scipy.sparse.csr_matrix(features, dtype=np.float64)
  else:
    x = np.asarray(features, np.float64)
  mean = np.asarray(x.mean(axis=0), np.float64).ravel()
  xt = x.T  # CSC view of a CSR matrix: no copy

  def matvec(v):  # (X - 1 mu^T) v
    v = np.ravel(v)
    return x @ v - mean @ v

  def rmatvec(u):  # (X - 1 mu^T)^T u
    u = np.ravel(u)
    return xt @ u - mean * u.sum()

  centred = scipy.sparse.linalg.LinearOperator((n, d), matvec=matvec, rmatvec=rmatvec,
                                               dtype=np.float64)
  v0 = np.random.default_rng(seed).standard_normal(min(n, d))
  _, s, vt = scipy.sparse.linalg.svds(centred, k=k, v0=v0, solver="arpack")
  return mean, vt[np.argsort(s)[::-1]]


def project(features, projection) -> np.ndarray:
  """(N, d) dense or sparse features -> (N, k) float32: (x - mean) @ components^T."""
  mean, components = projection
  return (np.asarray(features @ components.T) - mean @ components.T).astype(np.float32)
