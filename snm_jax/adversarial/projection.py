"""PCA projection of raw features to the k dimensions the tree works in (paper: k = 16)."""

from __future__ import annotations

import numpy as np
import scipy.sparse


def fit_projection(features, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Top-k principal components of the training features.

  Args:
    features: (N, d) dense array or scipy.sparse matrix (the covariance is formed
      as a dense d x d matrix, so d should be at most a few thousand).
    k: number of components, k <= d.

  Returns:
    mean: (d,) float32; components: (k, d) float32 with orthonormal rows, ordered by
    decreasing variance. Project with (x - mean) @ components.T (`project`).
  """
  n, d = features.shape
  if not 0 < k <= d:
    raise ValueError(f"need 0 < k <= d = {d}, got k = {k}")
  if scipy.sparse.issparse(features):
    x = features.astype(np.float64)
    mean = np.asarray(x.mean(axis=0)).ravel()
    second = np.asarray((x.T @ x).todense()) / n
  else:
    x = np.asarray(features, np.float64)
    mean = x.mean(axis=0)
    second = x.T @ x / n
  cov = second - np.outer(mean, mean)
  _, vecs = np.linalg.eigh(cov)
  components = vecs[:, ::-1][:, :k].T
  # Fix each component's sign (largest-magnitude entry positive) for reproducibility.
  components *= np.sign(components[np.arange(k), np.abs(components).argmax(axis=1)])[:, None]
  return mean.astype(np.float32), components.astype(np.float32)


def project(features, projection) -> np.ndarray:
  """(N, d) dense or sparse features -> (N, k) float32: (x - mean) @ components^T."""
  mean, components = projection
  return (np.asarray(features @ components.T) - mean @ components.T).astype(np.float32)
