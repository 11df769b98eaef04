"""Principal components of sparse or dense features: the library's one PCA, used by the feature
preprocessing (`snm_jax.data.preprocess`) and by the adversarial tree's projection
(`snm_jax.adversarial.projection`)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import scipy.linalg
import scipy.sparse as sp
import scipy.sparse.linalg as spla

# Largest feature dimension d whose PCA decomposes the dense d x d covariance (float64: 128 MiB at
# 4096); above it, a truncated SVD (`fit_pca`).
EXACT_PCA_MAX_DIM = 4096


class PCA(NamedTuple):
  """A fitted PCA: project with (x - mean) @ components.T."""
  mean: np.ndarray  # (d,) float64
  components: np.ndarray  # (k, d) float64, orthonormal rows, by decreasing variance
  explained_variance: np.ndarray  # (k,) float64, variance along each component (1 / (N - 1))


def fit_pca(x_train, k: int, seed: int = 0, exact_max_dim: int = EXACT_PCA_MAX_DIM) -> PCA:
  """Top-k principal components of x_train (N, d), sparse or dense, never densified.

  The components are the top-k eigenvectors of the covariance (1/N) sum_n (x_n - mu)(x_n - mu)^T,
  i.e. the top-k right singular vectors of the centred matrix X - 1 mu^T. Two ways to get them:

    * d <= exact_max_dim: the dense d x d covariance and its top-k eigenpairs only, by LAPACK's
      syevr (`scipy.linalg.eigh(subset_by_index=...)`; exact; 128 MiB and a few seconds at d = 4096).
      Back-transforming all d eigenvectors was most of a full decomposition's time (Bibtex, d = 1836,
      k = 8: 5.2 s against 2.5 s, the same vectors to 1e-14).
    * larger d (e.g. d = 135,909 features: a dense covariance of 148 GB): a truncated SVD with ARPACK
      (`scipy.sparse.linalg.svds`) of a `LinearOperator` that applies X and subtracts the mean
      implicitly: each product costs O(nnz(X) + N + d), memory is X plus about 2k vectors of length
      min(N, d). The start vector comes from `seed`, so the result is deterministic; ARPACK converges
      to machine precision, so both paths agree wherever the eigen-gaps determine the components.

  Each component's sign is fixed (its largest-magnitude entry positive) for reproducibility.
  """
  n, d = x_train.shape
  if not 0 < k <= d:
    raise ValueError(f"need 0 < k <= d = {d}, got k = {k}")
  if sp.issparse(x_train):
    x = sp.csr_matrix(x_train, dtype=np.float64)
  else:
    x = np.asarray(x_train, np.float64)
  mean = np.asarray(x.mean(axis=0), np.float64).ravel()
  if d <= exact_max_dim:
    second = x.T @ x
    second = (second.toarray() if sp.issparse(second) else second) / n
    cov = second - np.outer(mean, mean)
    evals, evecs = scipy.linalg.eigh(cov, subset_by_index=[d - k, d - 1], driver="evr")
    comps, var = evecs[:, ::-1].T, evals[::-1] * (n / max(n - 1, 1))
  else:
    comps, singular = _truncated_svd(x, mean, k, seed)
    var = singular ** 2 / max(n - 1, 1)
  comps = comps * np.sign(comps[np.arange(k), np.abs(comps).argmax(axis=1)])[:, None]
  return PCA(mean=mean, components=comps, explained_variance=var)


def _truncated_svd(x, mean: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(the top-k right singular vectors (k, d), their singular values (k,)) of X - 1 mu^T, by
  ARPACK on an operator that never forms the centred (or any d x d) matrix."""
  n, d = x.shape
  if k >= min(n, d):
    raise ValueError(f"the truncated SVD (d = {d} above the exact PCA's limit) needs k < min(N, d) = "
                     f"{min(n, d)}, got k = {k}")
  xt = x.T  # CSC view of a CSR matrix: no copy

  def matvec(v):  # (X - 1 mu^T) v
    v = np.ravel(v)
    return x @ v - mean @ v

  def rmatvec(u):  # (X - 1 mu^T)^T u
    u = np.ravel(u)
    return xt @ u - mean * u.sum()

  centred = spla.LinearOperator((n, d), matvec=matvec, rmatvec=rmatvec, dtype=np.float64)
  v0 = np.random.default_rng(seed).standard_normal(min(n, d))
  _, s, vt = spla.svds(centred, k=k, v0=v0, solver="arpack")
  order = np.argsort(s)[::-1]
  return vt[order], s[order]


def apply_pca(x, pca: PCA) -> np.ndarray:
  """(x - mean) @ components.T, dense float32 (N, k)."""
  return project_centred(x, pca.mean, pca.components)


def project_centred(x, mean: np.ndarray, components: np.ndarray) -> np.ndarray:
  """(N, d) dense or sparse x -> (N, k) float32 (x - mean) @ components.T, x never densified."""
  return (np.asarray(x @ components.T) - (mean @ components.T)[None, :]).astype(np.float32)
