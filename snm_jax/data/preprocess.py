"""Feature preprocessing used by the papers: L2 rows, TF-IDF, PCA-k, random projection.

Fit on the training split, apply the same transform to the test split. Sparse
inputs stay sparse where the transform keeps sparsity (L2, TF-IDF); PCA and
random projection return dense float32.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import scipy.linalg
import scipy.sparse as sp
import scipy.sparse.linalg as spla

# Largest feature dimension d whose PCA decomposes the dense d x d covariance (float64: 128 MiB at
# 4096); above it, a truncated SVD (`fit_pca`).
EXACT_PCA_MAX_DIM = 4096


def l2_normalize_rows(x):
  """x / ||x||_2 per row (all-zero rows stay zero). CSR or dense (N, d) -> same kind, float32."""
  if sp.issparse(x):
    x = sp.csr_matrix(x, dtype=np.float32, copy=True)
    norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1)).ravel())
    scale = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    x.data *= np.repeat(scale, np.diff(x.indptr)).astype(np.float32)
    return x
  x = np.asarray(x, dtype=np.float32)
  norms = np.linalg.norm(x, axis=1, keepdims=True)
  return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


def fit_idf(x_train) -> np.ndarray:
  """Smoothed inverse document frequency, float32 (d,).

  idf_j = log((1 + N) / (1 + df_j)) + 1, df_j = #rows with x_ij != 0
  (scikit-learn's `TfidfTransformer(smooth_idf=True)`).
  """
  n = x_train.shape[0]
  if sp.issparse(x_train):
    df = np.bincount(sp.csr_matrix(x_train).indices, minlength=x_train.shape[1])
  else:
    df = np.count_nonzero(x_train, axis=0)
  return (np.log((1.0 + n) / (1.0 + df)) + 1.0).astype(np.float32)


def apply_tfidf(x, idf: np.ndarray, sublinear_tf: bool = False, normalize: bool = True):
  """tf_ij * idf_j (tf = 1 + log tf if `sublinear_tf`), then optional row L2. (N, d) -> same kind."""
  if sp.issparse(x):
    x = sp.csr_matrix(x, dtype=np.float32, copy=True)
    if sublinear_tf:
      x.data = (1.0 + np.log(x.data)).astype(np.float32)
    x = sp.csr_matrix(x.multiply(idf[None, :]), dtype=np.float32)
  else:
    x = np.asarray(x, dtype=np.float32)
    if sublinear_tf:
      x = np.where(x > 0, 1.0 + np.log(np.where(x > 0, x, 1.0)), x)
    x = (x * idf[None, :]).astype(np.float32)
  return l2_normalize_rows(x) if normalize else x


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


def gaussian_projection_matrix(d: int, k: int, seed: int) -> np.ndarray:
  """R (d, k) with i.i.d. N(0, 1/k) entries (Johnson-Lindenstrauss: E||xR||^2 = ||x||^2)."""
  return (np.random.default_rng(seed).standard_normal((d, k)) / np.sqrt(k)).astype(np.float32)


def random_projection(x, k: int, seed: int) -> np.ndarray:
  """x @ R with R from `gaussian_projection_matrix(d, k, seed)`: dense float32 (N, k)."""
  r = gaussian_projection_matrix(x.shape[1], k, seed)
  return np.asarray(x @ r, dtype=np.float32)
