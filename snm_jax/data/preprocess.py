"""Feature preprocessing used by the papers: L2 rows, TF-IDF, PCA-k, random projection.

Fit on the training split, apply the same transform to the test split. Sparse
inputs stay sparse where the transform keeps sparsity (L2, TF-IDF); PCA and
random projection return dense float32.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

# PCA: the library's one implementation, shared with the adversarial tree's projection.
from snm_jax.pca import EXACT_PCA_MAX_DIM, PCA, apply_pca, fit_pca  # noqa: F401


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


def gaussian_projection_matrix(d: int, k: int, seed: int) -> np.ndarray:
  """R (d, k) with i.i.d. N(0, 1/k) entries (Johnson-Lindenstrauss: E||xR||^2 = ||x||^2)."""
  return (np.random.default_rng(seed).standard_normal((d, k)) / np.sqrt(k)).astype(np.float32)


def random_projection(x, k: int, seed: int) -> np.ndarray:
  """x @ R with R from `gaussian_projection_matrix(d, k, seed)`: dense float32 (N, k)."""
  r = gaussian_projection_matrix(x.shape[1], k, seed)
  return np.asarray(x @ r, dtype=np.float32)
