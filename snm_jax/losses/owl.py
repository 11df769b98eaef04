"""Exact ordered weighted losses over a full score vector (SNM paper, Sec. 3).

Notation: v in R^K scores, y the positive label, v^{-y}_[j] the j-th largest
score among the K-1 other labels, theta in R^{K-1} non-negative weights.

  POWL(v, y) = sum_{j=1}^{K-1} theta_j phi(v_y - v^{-y}_[j])
  BOWL(v, y) = phi(v_y) + sum_{j=1}^{K-1} theta_j phi(-v^{-y}_[j])

Special cases: Crammer-Singer = POWL(theta = e_1, hinge), Weston-Watkins =
POWL(theta = 1, hinge), Lee et al. = BOWL(theta = 1, hinge). These cost O(K log K)
per example; use them for small K and as ground truth for `snm_loss`.
"""

import jax
import jax.numpy as jnp

from snm_jax.losses import ranking
from snm_jax.losses.surrogates import PhiLike, get_phi


def sorted_other_scores(scores_K: jax.Array, label) -> jax.Array:
  """v^{-y}_[1] >= ... >= v^{-y}_[K-1]: the other labels' scores, sorted.

  Args:
    scores_K: (K,) scores.
    label: int scalar, the positive label y.

  Returns:
    (K-1,) scores, gradients flowing back to `scores_K`.
  """
  scores_K = ranking.as_float(scores_K)
  num_classes = scores_K.shape[-1]
  is_other = jnp.arange(num_classes) != label
  top, _, _ = ranking.masked_top_k(scores_K, num_classes - 1, is_other)
  return top


def _owl(scores_K, label, theta, phi, kind):
  scores_K = ranking.as_float(scores_K)
  if scores_K.ndim != 1:
    raise ValueError(f"scores: expected shape (K,), got {scores_K.shape}; "
                     "use jax.vmap for batches")
  num_classes = scores_K.shape[0]
  theta = jnp.asarray(theta, scores_K.dtype)
  if theta.shape != (num_classes - 1,):
    raise ValueError(
        f"theta: expected shape (K-1,) = ({num_classes - 1},), got {theta.shape}")
  phi_fn = get_phi(phi)
  others = sorted_other_scores(scores_K, label)
  pos = scores_K[label]
  loss = jnp.sum(theta * ranking.phi_terms(pos, others, phi_fn, kind))
  if kind == "bowl":
    loss = loss + phi_fn(pos)
  return loss


def powl(scores, label, theta, phi: PhiLike = "hinge") -> jax.Array:
  """Pairwise ordered weighted loss sum_j theta_j phi(v_y - v^{-y}_[j]).

  Args:
    scores: (K,) score vector v.
    label: int scalar y (may be traced).
    theta: (K-1,) weights for the ranked negatives, largest score first.
    phi: surrogate name (see `get_phi`) or callable.

  Returns:
    Scalar loss. Batch with `jax.vmap(powl, in_axes=(0, 0, None))`.
  """
  return _owl(scores, label, theta, phi, "powl")


def bowl(scores, label, theta, phi: PhiLike = "hinge") -> jax.Array:
  """Binary ordered weighted loss phi(v_y) + sum_j theta_j phi(-v^{-y}_[j]).

  Same arguments and shapes as `powl`.
  """
  return _owl(scores, label, theta, phi, "bowl")


def owl_loss(scores, label, theta, phi: PhiLike = "hinge", kind: str = "bowl"):
  """`bowl` or `powl` selected by `kind`."""
  return _owl(scores, label, theta, phi, ranking.check_kind(kind))
