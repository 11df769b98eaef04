"""Stochastic Negative Mining loss (SNM paper, Algorithm 1).

For one example with positive score v_y and B sampled negative scores sorted
as v^B_[1] >= ... >= v^B_[B]:
  POWL: sum_j vartheta_j phi(v_y - v^B_[j])
  BOWL: phi(v_y) + sum_j vartheta_j phi(-v^B_[j])

With a concrete vartheta = (head (k,), constant tail c) (`split_vartheta`),
  sum_j vartheta_j phi_[j] = sum_{j<k} (head_j - c) phi_[j] + c sum_j phi_j,
so only `jax.lax.top_k(., k)` is needed (skipped when k = 0), never a full sort.
The one implementation is the trainer's `snm_jax.losses.sampled.ordered_weighted_loss`
(which also runs sharded: a top-k merge and a psum over the mesh axis);
`snm_loss` is its single-example, vartheta-array interface.
"""

import jax
import jax.numpy as jnp
import numpy as np

from snm_jax.losses import ranking, sampled
from snm_jax.losses.surrogates import PhiLike, get_phi
from snm_jax.losses.vartheta import split_vartheta, validate_vartheta


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

  valid = jnp.ones(neg_scores.shape, bool) if valid is None else jnp.broadcast_to(valid, neg_scores.shape)
  if isinstance(vartheta, jax.core.Tracer):  # every weight may vary: a top-B (a full sort), no tail
    if vartheta.shape != (num_negatives,):
      raise ValueError(f"vartheta: shape {vartheta.shape} != (B,) = ({num_negatives},)")
    head_minus_tail, tail = vartheta, 0.0
  else:
    head, tail = split_vartheta(validate_vartheta(vartheta, num_negatives))
    head_minus_tail, tail = np.asarray(head - np.float32(tail), np.float32), float(tail)
  # The trainer's implementation (Algorithm 1 as the step runs it, unsharded).
  loss, _ = sampled.ordered_weighted_loss(pos_score, neg_scores, valid, head_minus_tail=head_minus_tail,
                                          tail=tail, phi=phi_fn, kind=kind, return_hardest=False)
  return loss
