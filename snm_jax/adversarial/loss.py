"""Adversarial negative sampling loss (Eq. 6) and bias removal (Eq. 5) of Bamler & Mandt (2020)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
  """
  logp_pos = jax.lax.stop_gradient(logp_pos)
  logp_neg = jax.lax.stop_gradient(logp_neg)
  pos = -jax.nn.log_sigmoid(xi_pos) + lam * jnp.square(xi_pos + logp_pos)
  neg = -jax.nn.log_sigmoid(-xi_neg) + lam * jnp.square(xi_neg + logp_neg)
  if jnp.ndim(xi_neg) == jnp.ndim(xi_pos) + 1:
    neg = jnp.mean(neg, axis=-1)
  return pos + neg


def debias_scores(xi, logp):
  """Eq. 5: prediction scores xi_y(x) + log p_n(y|x) (any matching shapes)."""
  return xi + logp
