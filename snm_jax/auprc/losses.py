"""One dispatch over the retrieval methods' batch losses (config.auprc.method).

A class-balanced batch (`snm_jax.auprc.sampling`) holds G groups of M items of
one class each, group-major; item i queries the other B - 1 items and its
positives are the M - 1 other members of its group. `batch_loss` is the mean
over the B queries of the method's per-query loss:

  soprc         Eq. 8 with the aux vector v of each query's class (paper: gradient
                through h(x+) in the denominator);
  soprc_sg      the same with that gradient stopped (the authors' code);
  soprc_sg_var  soprc_sg + the semi-variance regulariser (Eq. 9);
  ap_loss       the biased mini-batch AP loss (Eq. 5);
  smooth_ap     1 - Smooth-AP;
  triplet       hinge on s(a, n) + margin - s(a, p) over all (positive, negative) pairs;
  contrastive   `snm_jax.losses.cosine_contrastive_loss` over (positive, negatives) rows;
  untrained     0: the tower stays at its initialisation (the baseline row).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from snm_jax.auprc.estimator import ap_loss, smooth_ap_loss, soprc_loss
from snm_jax.auprc.regularizer import semi_variance
from snm_jax.errors import ConfigError
from snm_jax.losses import cosine_contrastive_loss

METHODS = ("soprc", "soprc_sg", "soprc_sg_var", "ap_loss", "smooth_ap", "triplet", "contrastive",
           "untrained")


def uses_aux_vector(method: str) -> bool:
  return method.startswith("soprc")


def _gather_rows(values_BxB, mask_BxB, k):
  """Per row, the k entries where mask is True: ((B, k) values, (B, k) mask)."""
  idx = jnp.argsort(~mask_BxB, axis=1, stable=True)[:, :k]
  return (jnp.take_along_axis(values_BxB, idx, 1), jnp.take_along_axis(mask_BxB, idx, 1))


def batch_loss(method, cfg, scores_BxB, labels_B, aux, prior_C, eps_C, num_pos):
  """Mean over the B queries of a batch of the method's per-query loss.

  Args:
    method: one of METHODS.
    cfg: the config.auprc section (its soprc / ap_loss / smooth_ap / triplet /
      contrastive hyper-parameters).
    scores_BxB: (B, B) scores of every item against every other.
    labels_B: (B,) class of each item.
    aux: `AuxVectorState` of the classes (used by the soprc methods).
    prior_C, eps_C: per-class prior pi_k and denominator guard (`class_priors`).
    num_pos: static number of positives of a query, M - 1.
  """
  if method == "untrained":
    return jnp.zeros((), scores_BxB.dtype)
  b = scores_BxB.shape[0]
  valid = ~jnp.eye(b, dtype=bool)
  pos = (labels_B[:, None] == labels_B[None, :]) & valid
  if uses_aux_vector(method):
    c = cfg.soprc
    loss_fn = functools.partial(
        soprc_loss, tau1=c.tau1, tau2=c.tau2, max_positives=num_pos,
        stop_gradient_denominator_positive=method.startswith("soprc_sg"))
    per_query = jax.vmap(lambda s, p, va, v, pr, e: loss_fn(
        s, p, v, pr, eps=e, valid_mask_B=va))(
            scores_BxB, pos, valid, aux.v[labels_B], prior_C[labels_B], eps_C[labels_B])
    loss = jnp.mean(per_query)
    if method == "soprc_sg_var":
      loss += jnp.mean(jax.vmap(lambda s, p, va: semi_variance(
          s, p, c.lambda_pos, c.lambda_neg, va))(scores_BxB, pos, valid))
    return loss
  if method == "ap_loss":
    return jnp.mean(jax.vmap(lambda s, p, va: ap_loss(
        s, p, tau1=cfg.ap_loss.tau1, tau2=cfg.ap_loss.tau2, valid_mask_B=va,
        max_positives=num_pos))(scores_BxB, pos, valid))
  if method == "smooth_ap":
    return jnp.mean(jax.vmap(lambda s, p, va: smooth_ap_loss(
        s, p, temperature=cfg.smooth_ap.temperature, valid_mask_B=va,
        max_positives=num_pos))(scores_BxB, pos, valid))
  pos_BxP, pos_ok_BxP = _gather_rows(scores_BxB, pos, num_pos)
  neg = valid & ~pos
  if method == "triplet":
    hinge = jax.nn.relu(scores_BxB[:, None, :] - pos_BxP[:, :, None] + cfg.triplet.margin)
    ok = pos_ok_BxP[:, :, None] & neg[:, None, :]
    return jnp.sum(hinge * ok) / jnp.maximum(jnp.sum(ok), 1)
  if method == "contrastive":
    per_pair = cosine_contrastive_loss(
        pos_BxP, jnp.broadcast_to(scores_BxB[:, None, :], pos_BxP.shape + (b,)),
        margin=cfg.contrastive.margin, neg_mask=~neg[:, None, :])
    return jnp.sum(per_pair * pos_ok_BxP) / jnp.maximum(jnp.sum(pos_ok_BxP), 1)
  raise ConfigError("auprc.method", f"{method!r} is not one of {list(METHODS)}")


def class_priors(y_train, num_classes, prior_mul):
  """(prior_C, eps_C): pi_k for (1 - pi)/pi and the guard 1/N+_k of Eq. 8.

  prior_mul = 0: the true prior (N_k - 1)/(N - 1); > 0: the authors'
  pi_k = prior_mul * N_k / max_k N_k.
  """
  counts = np.bincount(y_train, minlength=num_classes).astype(np.float64)
  if prior_mul > 0:
    prior = prior_mul * counts / counts.max()
  else:
    prior = (counts - 1) / (len(y_train) - 1)
  prior = np.clip(prior, 1e-6, 1 - 1e-6)
  eps = 1.0 / np.maximum(counts - 1, 1)
  return jnp.asarray(prior, jnp.float32), jnp.asarray(eps, jnp.float32)
