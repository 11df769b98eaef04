"""Masked ranking helpers shared by the ordered weighted losses.

Convention: `valid` is a bool array, True for entries that take part. Invalid
entries are ranked last and contribute exactly 0; they may hold any value
(even inf/NaN) without producing NaN gradients.
"""

from typing import Optional

import jax
import jax.numpy as jnp

from snm_jax.losses.surrogates import Phi

KINDS = ("bowl", "powl")


def check_kind(kind: str) -> str:
  if kind not in KINDS:
    raise ValueError(f"kind: must be one of {KINDS}, got {kind!r}")
  return kind


def as_float(x) -> jax.Array:
  """`x` as a JAX array of a floating dtype (ints become the default float)."""
  x = jnp.asarray(x)
  return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(float)


def rank_key(scores: jax.Array, valid: Optional[jax.Array]) -> jax.Array:
  """Scores with invalid entries replaced by the lowest finite value.

  A finite fill (not -inf) keeps every later subtraction finite; invalid
  entries still sort after every valid finite score.
  """
  if valid is None:
    return scores
  return jnp.where(valid, scores, jnp.finfo(scores.dtype).min)


def masked_top_k(scores_xB: jax.Array, k: int, valid_xB: Optional[jax.Array] = None):
  """The k largest valid scores along the last axis, in non-increasing order.

  Uses `jax.lax.top_k` (no full sort). If fewer than k entries are valid the
  result is padded with invalid entries, flagged False in `top_valid`.

  Args:
    scores_xB: (..., B) float scores.
    k: static int, 1 <= k <= B.
    valid_xB: optional (..., B) bool, True for entries that may be ranked.

  Returns:
    (top_scores (..., k), top_valid (..., k) bool, top_idx (..., k) int32);
    `top_scores` are gathered from `scores_xB`, so gradients flow to them.
  """
  scores_xB = as_float(scores_xB)
  _, idx = jax.lax.top_k(jax.lax.stop_gradient(rank_key(scores_xB, valid_xB)), k)
  top = jnp.take_along_axis(scores_xB, idx, axis=-1)
  if valid_xB is None:
    top_valid = jnp.ones(idx.shape, bool)
  else:
    top_valid = jnp.take_along_axis(jnp.asarray(valid_xB, bool), idx, axis=-1)
  return top, top_valid, idx


def phi_terms(pos_score: jax.Array, neg_scores: jax.Array, phi: Phi, kind: str,
              valid: Optional[jax.Array] = None) -> jax.Array:
  """Per-negative terms: phi(v_y - v_j) (POWL) or phi(-v_j) (BOWL).

  Args:
    pos_score: (...,) positive score v_y, broadcast against the last axis.
    neg_scores: (..., B) negative scores v_j.
    phi: surrogate callable.
    kind: "powl" or "bowl".
    valid: optional (..., B) bool; invalid terms are exactly 0.

  Returns:
    (..., B) array of terms.
  """
  u = (jnp.expand_dims(pos_score, -1) - neg_scores if kind == "powl"
       else -neg_scores)
  if valid is None:
    return phi(u)
  # Double where: evaluating phi at a benign u for invalid entries keeps the
  # backward pass free of 0 * inf = NaN (e.g. exponential at garbage scores).
  u_safe = jnp.where(valid, u, jnp.ones_like(u))
  return jnp.where(valid, phi(u_safe), jnp.zeros_like(u_safe))


def masked_phi_sum(pos_score: jax.Array, neg_scores: jax.Array, phi: Phi,
                   kind: str, valid: Optional[jax.Array] = None) -> jax.Array:
  """sum_j valid_j * phi_term(j) over the last axis; shape (...,).

  Additive over any partition of the negatives, so a sharded caller can sum
  per-shard results (e.g. with `jax.lax.psum`).
  """
  return jnp.sum(phi_terms(pos_score, neg_scores, phi, kind, valid), axis=-1)
