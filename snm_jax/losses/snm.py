"""Stochastic Negative Mining loss (SNM paper, Algorithm 1).

For one example with positive score v_y and B sampled negative scores sorted
as v^B_[1] >= ... >= v^B_[B]:
  POWL: sum_j vartheta_j phi(v_y - v^B_[j])
  BOWL: phi(v_y) + sum_j vartheta_j phi(-v^B_[j])

With a concrete vartheta = (head (k,), constant tail c) (`split_vartheta`),
  sum_j vartheta_j phi_[j] = sum_{j<k} (head_j - c) phi_[j] + c sum_j phi_j,
so only `jax.lax.top_k(., k)` is needed (skipped when k = 0), never a full sort.
`ordered_weighted_phi_sum` is that arithmetic on its own, for callers (e.g. a
sharded miner) that compute the top k and the plain sum themselves.
"""

import jax
import jax.numpy as jnp
import numpy as np

from snm_jax.losses import ranking, sampled
from snm_jax.losses.surrogates import PhiLike, get_phi
from snm_jax.losses.vartheta import split_vartheta, validate_vartheta


def ordered_weighted_phi_sum(pos_score, top_scores, head_minus_tail, tail: float,
                             phi_sum_all=None, phi: PhiLike = "hinge",
                             kind: str = "bowl", valid_top=None) -> jax.Array:
  """SNM loss from the top-k sorted negatives and a sum over all negatives.

  loss = [phi(v_y) if BOWL] + sum_{j<k} (head_j - tail) valid_top_j term(top_j)
         + tail * phi_sum_all,
  term(s) = phi(v_y - s) (POWL) or phi(-s) (BOWL).

  Args:
    pos_score: (...,) positive scores v_y (leading batch dims allowed, e.g. (N,)).
    top_scores: (..., k) the k largest valid negative scores, non-increasing
      along the last axis (e.g. from `masked_top_k` or a distributed top-k).
    head_minus_tail: (k,) `head - tail` from `split_vartheta` (non-negative).
    tail: static float, the constant tail of vartheta.
    phi_sum_all: (...,) sum over ALL valid sampled negatives of term(s), e.g.
      `masked_phi_sum(...)` (summed over shards). May be None when tail == 0.
    phi: surrogate name or callable.
    kind: "bowl" or "powl".
    valid_top: optional (..., k) bool, False for padding entries of the top k
      (fewer than k valid negatives); those contribute 0.

  Returns:
    (...,) losses.
  """
  phi_fn = get_phi(phi)
  ranking.check_kind(kind)
  pos_score = ranking.as_float(pos_score)
  loss = jnp.zeros_like(pos_score)
  if jnp.shape(head_minus_tail)[-1] > 0:
    terms = ranking.phi_terms(pos_score, ranking.as_float(top_scores), phi_fn,
                              kind, valid_top)
    loss = loss + jnp.sum(jnp.asarray(head_minus_tail, terms.dtype) * terms, axis=-1)
  if tail != 0:
    if phi_sum_all is None:
      raise ValueError(f"phi_sum_all: required when tail = {tail} != 0")
    loss = loss + tail * phi_sum_all
  if kind == "bowl":
    loss = loss + phi_fn(pos_score)
  return loss


def snm_loss(pos_score, neg_scores, vartheta, phi: PhiLike = "hinge",
             kind: str = "bowl", neg_mask=None) -> jax.Array:
  """SNM loss of one example (Algorithm 1), POWL or BOWL form.

  Args:
    pos_score: scalar positive score v_y.
    neg_scores: (B,) scores of the B sampled negatives.
    vartheta: (B,) non-negative, non-increasing weights (see `top_k_vartheta`
      etc.). Concrete (NumPy) values use top-k + sum; a traced vartheta falls
      back to a full descending sort.
    phi: surrogate name (see `get_phi`) or callable.
    kind: "bowl" or "powl".
    neg_mask: optional (B,) bool, True for entries that are NOT valid negatives
      (accidental hits). They rank after every valid negative and add 0, so
      with n valid negatives the loss uses vartheta_1..vartheta_n.

  Returns:
    Scalar loss. Batch with `jax.vmap(functools.partial(snm_loss,
    vartheta=v, phi=..., kind=...))`; leading batch dims (pos (N,), neg_scores
    and neg_mask (N, B)) also work directly.
  """
  phi_fn = get_phi(phi)
  ranking.check_kind(kind)
  pos_score = ranking.as_float(pos_score)
  neg_scores = ranking.as_float(neg_scores)
  num_negatives = neg_scores.shape[-1]
  valid = None if neg_mask is None else ~jnp.asarray(neg_mask, bool)

  if isinstance(vartheta, jax.core.Tracer):
    if vartheta.shape != (num_negatives,):
      raise ValueError(f"vartheta: shape {vartheta.shape} != (B,) = ({num_negatives},)")
    sorted_scores, valid_s, _ = ranking.masked_top_k(neg_scores, num_negatives, valid)
    terms = ranking.phi_terms(pos_score, sorted_scores, phi_fn, kind,
                              None if valid is None else valid_s)
    loss = jnp.sum(vartheta.astype(terms.dtype) * terms, axis=-1)
    return loss + phi_fn(pos_score) if kind == "bowl" else loss

  head, tail = split_vartheta(validate_vartheta(vartheta, num_negatives))
  # The trainer's implementation (Algorithm 1 as the step runs it, unsharded).
  valid = jnp.ones(neg_scores.shape, bool) if valid is None else jnp.broadcast_to(valid, neg_scores.shape)
  loss, _ = sampled.ordered_weighted_loss(
      pos_score, neg_scores, valid, head_minus_tail=np.asarray(head - np.float32(tail), np.float32),
      tail=float(tail), phi=phi_fn, kind=kind, return_hardest=False)
  return loss
