"""Softmax-family baselines: full and sampled softmax, negative sampling, NCE.

All per-example functions reduce over the last axis and broadcast over leading
batch dims: pos_score (...,), neg_scores (..., B). `neg_mask` is True for
entries that are NOT valid negatives (accidental hits); they contribute 0.
"""

import math

import jax
import jax.numpy as jnp
import optax

from snm_jax.losses import ranking


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


def sampled_softmax(pos_score, neg_scores, log_q_pos, log_q_neg, neg_mask=None):
  """Sampled softmax with the logQ correction (Jean et al. 2015; Bengio & Senecal).

  With corrected logits o = v - log q(label), the loss is
  logsumexp(o_y, o_1, ..., o_B) - o_y, valid negatives only.

  Args:
    pos_score: (...,) positive score v_y.
    neg_scores: (..., B) sampled negative scores.
    log_q_pos: (...,) log proposal probability of the positive label.
    log_q_neg: (..., B) log proposal probabilities of the sampled negatives.
    neg_mask: optional (..., B) bool, True for invalid negatives.

  Returns:
    (...,) losses.
  """
  valid = _valid(neg_mask)
  pos = ranking.as_float(pos_score) - log_q_pos
  neg = _safe(ranking.as_float(neg_scores) - log_q_neg, valid)
  logits = jnp.concatenate([pos[..., None], neg], axis=-1)
  where = None
  if valid is not None:
    where = jnp.concatenate(
        [jnp.ones(valid.shape[:-1] + (1,), bool), jnp.broadcast_to(valid, neg.shape)],
        axis=-1)
  return jax.nn.logsumexp(logits, axis=-1, where=where) - pos


def negative_sampling_loss(pos_score, neg_scores, neg_mask=None) -> jax.Array:
  """Negative sampling (Eq. 2 of Bamler & Mandt 2020; Mikolov et al. 2013).

  -log sigma(v_y) - sum_j log sigma(-v_j) = softplus(-v_y) + sum_j softplus(v_j)
  (natural log), valid negatives only. Shapes as in `sampled_softmax`.
  """
  valid = _valid(neg_mask)
  neg = _safe(ranking.as_float(neg_scores), valid)
  return (jax.nn.softplus(-ranking.as_float(pos_score))
          + _masked_sum(jax.nn.softplus(neg), valid))


def nce_loss(pos_score, neg_scores, log_q_pos, log_q_neg, neg_mask=None):
  """Noise-contrastive estimation (Gutmann & Hyvarinen 2010; Mnih & Teh 2012).

  With B noise samples per example from q, the classifier logit of a label is
  delta = v - log(B q(label)), and the loss is
  -log sigma(delta_y) - sum_j log sigma(-delta_j)
  = softplus(-delta_y) + sum_j softplus(delta_j). B is the number of drawn
  samples (the static size of the last axis, masked ones included); masked
  negatives contribute 0. Shapes as in `sampled_softmax`.
  """
  valid = _valid(neg_mask)
  neg_scores = ranking.as_float(neg_scores)
  log_b = math.log(neg_scores.shape[-1])
  delta_pos = ranking.as_float(pos_score) - log_q_pos - log_b
  delta_neg = _safe(neg_scores - log_q_neg - log_b, valid)
  return jax.nn.softplus(-delta_pos) + _masked_sum(jax.nn.softplus(delta_neg), valid)
