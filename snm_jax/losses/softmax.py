"""Softmax-family baselines: full, sampled and mined sampled softmax, negative sampling, NCE.

All per-example functions reduce over the last axis and broadcast over leading
batch dims: pos_score (...,), neg_scores (..., B). `neg_mask` is True for
entries that are NOT valid negatives (accidental hits); they contribute 0.
The sampled ones are thin wrappers of the losses the trainer runs
(`snm_jax.losses.sampled`), in the trainer's conventions: negative sampling
averages over the valid negatives, NCE's noise logit is v - log(B q).
"""

import math

import jax
import jax.numpy as jnp
import optax

from snm_jax.losses import ranking, sampled


def _valid(neg_mask):
  return None if neg_mask is None else ~jnp.asarray(neg_mask, bool)


def _masked_sum(x, valid):
  if valid is None:
    return jnp.sum(x, axis=-1)
  return jnp.sum(jnp.where(valid, x, jnp.zeros_like(x)), axis=-1)


def _safe(x, valid):
  # Invalid entries may hold garbage (inf/NaN); replace before any nonlinearity
  # so their zero cotangent is never multiplied by inf.
  return x if valid is None else jnp.where(valid, x, jnp.zeros_like(x))


def softmax_cross_entropy(scores, label) -> jax.Array:
  """Full softmax cross-entropy logsumexp(v) - v_y.

  Args:
    scores: (..., K) logits.
    label: (...,) int labels.

  Returns:
    (...,) losses (natural log).
  """
  return optax.softmax_cross_entropy_with_integer_labels(ranking.as_float(scores), label)


def _rows(pos_score, neg_scores, neg_mask, *neg_like):
  """(..., B) inputs as (N, B) rows, pos (N,), validity (N, B), and the leading shape."""
  neg = ranking.as_float(neg_scores)
  lead = neg.shape[:-1]
  b = neg.shape[-1]
  pos = jnp.broadcast_to(ranking.as_float(pos_score), lead).reshape(-1)
  valid = (jnp.ones(neg.shape, bool) if neg_mask is None
           else jnp.broadcast_to(~jnp.asarray(neg_mask, bool), neg.shape))
  extra = [jnp.broadcast_to(jnp.asarray(x, neg.dtype), neg.shape).reshape(-1, b) for x in neg_like]
  return pos, neg.reshape(-1, b), valid.reshape(-1, b), extra, lead


def _pos_rows(x, lead, dtype):
  return jnp.broadcast_to(jnp.asarray(x, dtype), lead).reshape(-1)


def sampled_softmax(pos_score, neg_scores, log_q_pos, log_q_neg, neg_mask=None):
  """Sampled softmax with the logQ correction (Jean et al. 2015; Bengio & Senecal).

  With corrected logits o = v - log q(label), the loss is
  logsumexp(o_y, o_1, ..., o_B) - o_y, valid negatives only
  (`snm_jax.losses.sampled.sampled_softmax_loss`).

  Args:
    pos_score: (...,) positive score v_y.
    neg_scores: (..., B) sampled negative scores.
    log_q_pos: (...,) log proposal probability of the positive label.
    log_q_neg: (..., B) log proposal probabilities of the sampled negatives.
    neg_mask: optional (..., B) bool, True for invalid negatives.

  Returns:
    (...,) losses.
  """
  pos, neg, valid, (log_q,), lead = _rows(pos_score, neg_scores, neg_mask, log_q_neg)
  out = sampled.sampled_softmax_loss(pos, neg, valid, log_q,
                                     log_q_pos=_pos_rows(log_q_pos, lead, neg.dtype))
  return out.reshape(lead)


def mined_softmax(pos_score, neg_scores, log_q_pos, log_q_neg, k: int, neg_mask=None):
  """Mined sampled softmax: `sampled_softmax`'s value, gradient to the k hardest draws only.

  With corrected logits o = v - log q(label) and T the k valid negatives of
  largest o, the loss is
  -o_y + log(e^{o_y} + sum_{j in T} e^{o_j} + stop_gradient(sum_{valid j not in T} e^{o_j}))
  (`snm_jax.losses.sampled.mined_softmax_loss`, which documents the estimator
  and the bound on the gradient it drops). k >= B: `sampled_softmax`.

  Args:
    pos_score: (...,) positive score v_y.
    neg_scores: (..., B) sampled negative scores.
    log_q_pos: (...,) log proposal probability (or expected count) of the positive.
    log_q_neg: (..., B) the same for the sampled negatives.
    k: static number of negatives that receive gradient, >= 1.
    neg_mask: optional (..., B) bool, True for invalid negatives.

  Returns:
    (...,) losses.
  """
  pos, neg, valid, (log_q,), lead = _rows(pos_score, neg_scores, neg_mask, log_q_neg)
  out, _ = sampled.mined_softmax_loss(pos, neg, valid, log_q, k=k,
                                      log_q_pos=_pos_rows(log_q_pos, lead, neg.dtype))
  return out.reshape(lead)


def negative_sampling_loss(pos_score, neg_scores, neg_mask=None) -> jax.Array:
  """Negative sampling (Eq. 2 of Bamler & Mandt 2020; Mikolov et al. 2013), the negatives averaged
  as the trainer does (`snm_jax.losses.sampled.logistic_negative_sampling_loss`):

  -log sigma(v_y) - mean_j log sigma(-v_j) = softplus(-v_y) + mean_j softplus(v_j)
  (natural log), valid negatives only (none valid: the positive term alone).
  Shapes as in `sampled_softmax`.
  """
  pos, neg, valid, _, lead = _rows(pos_score, neg_scores, neg_mask)
  return sampled.logistic_negative_sampling_loss(pos, neg, valid).reshape(lead)


def nce_loss(pos_score, neg_scores, log_q_pos, log_q_neg, neg_mask=None):
  """Noise-contrastive estimation (Gutmann & Hyvarinen 2010; Mnih & Teh 2012).

  With B noise samples per example from q, the classifier logit of a label is
  delta = v - log(B q(label)), and the loss is
  -log sigma(delta_y) - sum_j log sigma(-delta_j)
  = softplus(-delta_y) + sum_j softplus(delta_j). B is the number of drawn
  samples (the static size of the last axis, masked ones included); masked
  negatives contribute 0. `snm_jax.losses.sampled.nce_loss` with the log
  expected counts log(B q). Shapes as in `sampled_softmax`.
  """
  pos, neg, valid, (log_q,), lead = _rows(pos_score, neg_scores, neg_mask, log_q_neg)
  log_b = math.log(neg.shape[-1])
  return sampled.nce_loss(pos, neg, valid, log_q + log_b,
                          _pos_rows(log_q_pos, lead, neg.dtype) + log_b).reshape(lead)
