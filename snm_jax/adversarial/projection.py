"""PCA projection of raw features to the k dimensions the tree works in (paper: k = 16).

The components are the top-k eigenvectors of the feature covariance, from the library's one PCA
(`snm_jax.pca.fit_pca`: exact top-k eigenpairs of the d x d covariance up to
EXACT_MAX_DIM features, a truncated SVD of the implicitly centred matrix above it), kept in float32
for the tree.
"""

from __future__ import annotations

import numpy as np

from snm_jax.pca import EXACT_PCA_MAX_DIM as EXACT_MAX_DIM
from snm_jax.pca import fit_pca, project_centred


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
  pca = fit_pca(features, k, seed=seed, exact_max_dim=exact_max_dim)
  return pca.mean.astype(np.float32), pca.components.astype(np.float32)


def project(features, projection) -> np.ndarray:
  """(N, d) dense or sparse features -> (N, k) float32: (x - mean) @ components^T."""
  return project_centred(features, *projection)
