"""The loss registry: `loss.kind -> function` for the losses the trainer runs.

Every entry has one signature,
  fn(pos (N,), scores_NxS (N, S), valid (N, S), log_q (N, S), log_q_pos (N,), *,
     spec, num_samples, axis_name, score_at) -> (per-example loss (N,), hardest or None)
where `spec` is the step's `LossSpec` (kind, head_minus_tail, tail, phi, lam,
mined_k, dense_score_grad), `num_samples` the sampler's S, `axis_name` the mesh axis the
negatives are sharded over (None: no mesh) and `score_at` the differentiable
rescorer of the ordered weighted losses and the mined softmax. `hardest` is the top-1 sampled
negative score when the loss computes it anyway (BOWL/POWL), else None.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from snm_jax.losses import sampled


def _ordered_weighted(pos, scores, valid, log_q, log_q_pos, *, spec, num_samples, axis_name, score_at):
  del log_q, log_q_pos, num_samples
  return sampled.ordered_weighted_loss(
      pos, scores, valid, head_minus_tail=np.asarray(spec.head_minus_tail, np.float32),
      tail=spec.tail, phi=spec.phi, kind=spec.kind, axis_name=axis_name,
      score_at=None if spec.dense_score_grad else score_at)


def _sampled_softmax(pos, scores, valid, log_q, log_q_pos, *, spec, num_samples, axis_name, score_at):
  del spec, num_samples, score_at
  return sampled.sampled_softmax_loss(pos, scores, valid, log_q, log_q_pos=log_q_pos,
                                      axis_name=axis_name), None


def _mined_softmax(pos, scores, valid, log_q, log_q_pos, *, spec, num_samples, axis_name, score_at):
  del num_samples
  loss, _ = sampled.mined_softmax_loss(pos, scores, valid, log_q, k=spec.mined_k, log_q_pos=log_q_pos,
                                       axis_name=axis_name,
                                       score_at=None if spec.dense_score_grad else score_at)
  return loss, None  # its top-k ranks corrected logits, not scores: the step finds the hardest


def _full_softmax(pos, scores, valid, log_q, log_q_pos, *, spec, num_samples, axis_name, score_at):
  del log_q, log_q_pos, spec, num_samples, score_at
  return sampled.sampled_softmax_loss(pos, scores, valid, jnp.zeros_like(scores),
                                      axis_name=axis_name), None


def _logistic_ns(pos, scores, valid, log_q, log_q_pos, *, spec, num_samples, axis_name, score_at):
  del log_q, log_q_pos, spec, num_samples, score_at
  return sampled.logistic_negative_sampling_loss(pos, scores, valid, axis_name=axis_name), None


def _adversarial_ns(pos, scores, valid, log_q, log_q_pos, *, spec, num_samples, axis_name, score_at):
  del score_at
  return sampled.adversarial_ns_loss(pos, scores, valid, log_q, log_q_pos, lam=spec.lam,
                                     num_samples=num_samples, axis_name=axis_name), None


def _nce(pos, scores, valid, log_q, log_q_pos, *, spec, num_samples, axis_name, score_at):
  del spec, num_samples, score_at
  return sampled.nce_loss(pos, scores, valid, log_q, log_q_pos, axis_name=axis_name), None


LOSSES: dict[str, Callable] = {
    "bowl": _ordered_weighted,
    "powl": _ordered_weighted,
    "sampled_softmax": _sampled_softmax,
    "mined_softmax": _mined_softmax,
    "full_softmax": _full_softmax,
    "logistic_ns": _logistic_ns,
    "adversarial_ns": _adversarial_ns,
    "nce": _nce,
}


# Whether a sampled negative equal to one of the example's positives (an accidental hit) is
# dropped, per loss: the loss's own definition. None in `MASK_ACCIDENTAL_HITS` marks a loss
# defined with y' ~ p_n over *all* labels, where masking is an option (`loss.mask_accidental_hits`):
# Bamler & Mandt's Eq. 2 and Eq. 6 (and Theorem 1's optimum xi* = log p_D - log p_n) and NCE
# (Gutmann & Hyvarinen: noise over all labels, optimum xi* = log p_D) draw negatives with no
# exclusion, so their default is False. The ordered weighted losses (Algorithm 1: the B negatives
# exclude the positives) and the softmaxes (the positive is the numerator, once) require True.
MASK_ACCIDENTAL_HITS: dict[str, bool | None] = {
    "bowl": True, "powl": True, "sampled_softmax": True, "mined_softmax": True, "full_softmax": True,
    "logistic_ns": None, "adversarial_ns": None, "nce": None,
}


def masks_accidental_hits(kind: str, requested: bool | None = None) -> bool:
  """Whether loss `kind` drops accidental hits: `requested` (None: the loss's default,
  False for logistic_ns / adversarial_ns / nce). Raises ValueError for False where the
  loss requires the mask (see `MASK_ACCIDENTAL_HITS`)."""
  get_loss(kind)
  fixed = MASK_ACCIDENTAL_HITS[kind]
  if requested is None:
    return bool(fixed) if fixed is not None else False
  if fixed is not None and bool(requested) != fixed:
    raise ValueError(f"loss.kind={kind} requires mask_accidental_hits={fixed}")
  return bool(requested)


def get_loss(kind: str) -> Callable:
  """The registered loss of `kind` (see `LOSSES`)."""
  try:
    return LOSSES[kind]
  except KeyError:
    raise ValueError(f"unknown loss kind {kind!r}") from None
