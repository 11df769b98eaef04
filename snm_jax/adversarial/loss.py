"""Adversarial negative sampling loss (Eq. 6) and bias removal (Eq. 5) of Bamler & Mandt (2020)."""

from __future__ import annotations

import math

import jax.numpy as jnp

from snm_jax.losses import sampled


def adversarial_ns_loss(xi_pos, logp_pos, xi_neg, logp_neg, lam):
  """Eq. 6, per example: negative sampling with the debiasing regulariser.

    l = -log s(xi_y) + lam (xi_y + log p_n(y|x))^2
        + mean_s [ -log s(-xi_y's) + lam (xi_y's + log p_n(y'_s|x))^2 ],  y'_s ~ p_n(.|x).

  With one negative (S = 1) this is Eq. 6 exactly; several negatives are averaged
  (as in the authors' code), which leaves the expected loss, hence its minimiser,
  unchanged. In the nonparametric limit with lam -> 0 the minimiser is
  xi* = log p_D(y|x) - log p_n(y|x) (Theorem 1), so `debias_scores` recovers
  log p_D up to a constant; lam > 0 shrinks xi + log p_n towards 0.

  Args:
    xi_pos: (...,) model scores of the positive labels.
    logp_pos: (...,) log p_n(y|x) of the positive labels (no gradient is taken).
    xi_neg: (...,) or (..., S) scores of the sampled negatives.
    logp_neg: same shape as xi_neg, their log p_n(y'|x).
    lam: lambda >= 0.

  Returns:
    (...,) per-example loss.

  The one implementation is the trainer's `snm_jax.losses.sampled.adversarial_ns_loss`
  (which takes log expected counts log(S p_n)); this wraps it for log p_n inputs.
  """
  xi_pos = jnp.asarray(xi_pos)
  xi_neg = jnp.asarray(xi_neg)
  if xi_neg.ndim == xi_pos.ndim:  # one negative per example
    xi_neg, logp_neg = xi_neg[..., None], jnp.asarray(logp_neg)[..., None]
  dtype = jnp.result_type(xi_pos, xi_neg, float)
  lead = xi_neg.shape[:-1]
  s = xi_neg.shape[-1]
  log_s = math.log(s)
  neg = jnp.asarray(xi_neg, dtype).reshape(-1, s)
  log_q = jnp.broadcast_to(jnp.asarray(logp_neg, dtype), xi_neg.shape).reshape(-1, s) + log_s
  pos = jnp.broadcast_to(jnp.asarray(xi_pos, dtype), lead).reshape(-1)
  log_q_pos = jnp.broadcast_to(jnp.asarray(logp_pos, dtype), lead).reshape(-1) + log_s
  out = sampled.adversarial_ns_loss(pos, neg, jnp.ones(neg.shape, bool), log_q, log_q_pos,
                                    lam=lam, num_samples=s)
  return out.reshape(lead)


def debias_scores(xi, logp):
  """Eq. 5: prediction scores xi_y(x) + log p_n(y|x) (any matching shapes)."""
  return xi + logp
