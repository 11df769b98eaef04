"""The losses the trainer runs: per-example losses over sampled (optionally label-sharded) scores.

Every function takes the positive scores ``pos`` (N,), the negative scores
``scores_NxS`` (N, S) with validity ``valid`` (N, S) (False for padding draws
and, where the loss masks them, accidental hits: `registry.MASK_ACCIDENTAL_HITS`) and, where the loss needs them, log proposal / log expected
count arrays (N, S) and (N,). Inside `shard_map`, each model shard holds the
scores of its share of the sampled negatives (S = S_local) and ``pos`` is
already replicated over the model axis ``axis_name``. Everything that needs
all B negatives is done with O(n k M) or O(n) communication:

* ordered weighted losses (SNM, Algorithm 1 of Reddi et al. 2019): the weights
  are split as vartheta = head (first k) + constant tail c, so that
    loss = sum_{j<k} (head_j - c) * phi(term_[j]) + c * sum_{all valid j} phi(term_j),
  where term_j = -v_j (BOWL, plus phi(v_y)) or v_y - v_j (POWL) and [j] is the
  j-th largest sampled score. The first sum needs only the global top-k (a
  local top-k, then an all-gather of k candidates per shard); the second is a
  `psum` of per-shard partial sums.
* softmax-type losses: a `pmax` and a `psum` of per-shard partial sums; the
  mined softmax also merges the per-shard top-k of its corrected logits, as
  the ordered weighted losses do.

With ``axis_name=None`` (no mesh) the collectives are skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from snm_jax.losses.ranking import masked_top_k, owl_terms
from snm_jax.losses.topk import merge_top_k_across


def _psum(x, axis_name):
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def _pmax(x, axis_name):
  return x if axis_name is None else jax.lax.pmax(x, axis_name)


def ordered_weighted_loss(pos, scores, valid, *, head_minus_tail: np.ndarray, tail: float,
                          phi, kind: str, axis_name=None, score_at=None, return_hardest: bool = True):
  """SNM loss of every example from sharded sampled scores.

  Args:
    pos: (n,) positive scores v_y (replicated over `axis_name`).
    scores: (n, S) this shard's sampled negative scores.
    valid: (n, S) bool, False for accidental hits and padding draws.
    head_minus_tail: (k,) static weights vartheta_j - c for the k hardest.
    tail: static constant weight c of every sampled negative.
    phi: elementwise margin surrogate.
    kind: "bowl" or "powl".
    axis_name: the mesh axis the negatives are sharded over, or None.
    score_at: optional `idx (n, k) -> (n, k)` recomputing, differentiably, the
      scores at those positions of `scores` (e.g. from the gathered class rows).
      When given and `tail == 0`, `scores` is only ranked and never
      differentiated: the gradient reaches the k selected rows only, O(n k h),
      instead of the two O(n S h) matmuls of a dense score gradient.
    return_hardest: False skips the top-k entirely when k == 0 (no head) and
      returns None for `hardest`.
  Returns:
    (loss (n,), hardest (n,) top-1 sampled negative score or -inf).
  """
  k = len(head_minus_tail)
  zero = jnp.zeros_like(scores)
  loss = phi(pos) if kind == "bowl" else jnp.zeros_like(pos)
  if tail != 0.0:
    per_neg = jnp.where(valid, phi(owl_terms(pos, jnp.where(valid, scores, zero), kind)), zero)
    loss = loss + tail * _psum(jnp.sum(per_neg, axis=-1), axis_name)
  if k == 0 and not return_hardest:
    return loss, None
  if score_at is not None and tail == 0.0:
    _, top_valid, top_ids = masked_top_k(jax.lax.stop_gradient(scores), max(k, 1), valid)
    top_vals = score_at(top_ids)
  else:
    top_vals, top_valid, top_ids = masked_top_k(scores, max(k, 1), valid)
  if axis_name is not None:
    top_vals, top_ids, top_valid = merge_top_k_across(top_vals, top_ids, top_valid, max(k, 1), axis_name)
  if k > 0:
    safe = jnp.where(top_valid, top_vals, jnp.zeros_like(top_vals))
    w = jnp.asarray(head_minus_tail, scores.dtype)
    loss = loss + jnp.sum(jnp.where(top_valid, w * phi(owl_terms(pos, safe, kind)), 0.0), axis=-1)
  hardest = jnp.where(top_valid[..., 0], top_vals[..., 0], -jnp.inf)
  return loss, jax.lax.stop_gradient(hardest)


def sampled_softmax_loss(pos, scores, valid, log_q, *, log_q_pos=0.0, axis_name=None):
  """Sampled softmax with the logQ correction (Jean et al. 2015; Bengio & Senecal 2008).

  Shapes: pos (N,), scores_NxS / valid / log_q (N, S), log_q_pos (N,) or scalar.

  loss = -(v_y - log q_y) + log( exp(v_y - log q_y) + sum_valid exp(v_j - log q_j) ).
  With log_q = 0 and all labels as "samples" it is the full softmax cross-entropy.
  """
  pos_logit = pos - log_q_pos
  logits = jnp.where(valid, scores - log_q, -jnp.inf)
  m = _pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), axis_name)
  m = jnp.maximum(m, jax.lax.stop_gradient(pos_logit))
  total = _psum(jnp.sum(jnp.where(valid, jnp.exp(logits - m[:, None]), 0.0), axis=-1), axis_name)
  total = total + jnp.exp(pos_logit - m)
  return -(pos_logit - m) + jnp.log(total)


def mined_softmax_loss(pos, scores, valid, log_q, *, k: int, log_q_pos=0.0, axis_name=None,
                       score_at=None):
  """Mined sampled softmax: sampled softmax whose gradient reaches only the k hardest draws.

  Stochastic negative mining (Reddi et al. 2019) for a coupled loss, which their
  paper leaves open: with corrected logits o_y = v_y - log(B q_y) and
  o_j = v_j - log(B q_j) (the logQ convention of `sampled_softmax_loss`: `log_q`
  are the sampler's log expected counts) and T the k valid draws of largest o_j,

    loss = -o_y + log( e^{o_y} + sum_{j in T} e^{o_j} + sg( sum_{valid j not in T} e^{o_j} ) ),

  sg = stop_gradient. So:
    * the value is sampled softmax's exactly (the normaliser estimate is still
      the logQ-corrected one over all B draws: selection changes no value);
    * the gradient w.r.t. o_y (hence the query through the positive) and w.r.t.
      o_j, j in T, is sampled softmax's (softmax weights over the full
      normaliser Z); the B - k draws outside T get none. The gradient dropped
      is sum_{j not in T} p_j grad(v_j), p_j = e^{o_j} / Z, so its norm is at
      most tau * max_j |grad(v_j)| with tau = sum_{j not in T} p_j, the tail
      mass (returned per example);
    * k >= the number of valid draws: plain sampled softmax, value and gradient.
  Ranking by o_j rather than v_j makes T the k largest terms of the normaliser,
  the set of size k with the smallest tail mass tau, i.e. the smallest bound on
  the dropped gradient; for a uniform q (log q constant per example) the two
  rankings agree.

  Why: with `score_at`, `scores` is only ranked and the k selected scores are
  recomputed from their gathered rows, so the score gradient costs O(n k h)
  instead of the two O(n S h) matmuls of a dense score gradient (as the ordered
  weighted losses' `score_at`). Sharded: a local top-k by o, then the merge of
  the M k candidates (`merge_top_k_across`); the full normaliser is a psum.

  Args:
    pos: (n,) positive scores v_y (replicated over `axis_name`).
    scores: (n, S) this shard's sampled negative scores.
    valid: (n, S) bool, False for accidental hits and padding draws.
    log_q: (n, S) log expected counts log(B q_j) of the draws.
    k: static number of draws that receive gradient, >= 1.
    log_q_pos: (n,) or scalar, log(B q_y) of the positive.
    axis_name: the mesh axis the negatives are sharded over, or None.
    score_at: optional `idx (n, k) -> (n, k)` recomputing, differentiably, the
      scores at those positions of `scores`. None: the top-k are gathered from
      `scores` (the dense reference: same value and gradient).
  Returns:
    (loss (n,), tail_mass (n,) tau in [0, 1], no gradient).
  """
  pos_logit = pos - log_q_pos
  logits = jnp.where(valid, scores - log_q, -jnp.inf)
  fixed = jax.lax.stop_gradient(logits)
  # The value: `sampled_softmax_loss`'s computation, on logits that carry no gradient.
  m = _pmax(jnp.max(fixed, axis=-1), axis_name)
  m = jnp.maximum(m, jax.lax.stop_gradient(pos_logit))
  total_all = _psum(jnp.sum(jnp.where(valid, jnp.exp(fixed - m[:, None]), 0.0), axis=-1), axis_name)
  # The gradient: the k largest corrected logits, re-scored (or gathered) differentiably.
  _, top_valid, idx = masked_top_k(fixed, k, valid)
  top_scores = (score_at(idx) if score_at is not None
                else jnp.take_along_axis(scores, idx, axis=-1, mode="clip"))
  top = top_scores - jnp.take_along_axis(log_q, idx, axis=-1, mode="clip")
  if axis_name is not None:
    top, idx, top_valid = merge_top_k_across(top, idx, top_valid, k, axis_name)
  # Double where: invalid slots hold arbitrary values; exp of a benign one keeps 0 * inf out.
  safe = jnp.where(top_valid, top, m[:, None])
  head = jnp.sum(jnp.where(top_valid, jnp.exp(safe - m[:, None]), 0.0), axis=-1)
  fixed_head = jax.lax.stop_gradient(head)
  # head - sg(head) is exactly 0: the value is total_all's, the gradient the head's.
  total = (total_all + (head - fixed_head)) + jnp.exp(pos_logit - m)
  tail_mass = jnp.maximum(total_all - fixed_head, 0.0) / jax.lax.stop_gradient(total)
  return -(pos_logit - m) + jnp.log(total), tail_mass


def logistic_negative_sampling_loss(pos, scores, valid, *, axis_name=None):
  """Negative sampling, Bamler & Mandt (2020) Eq. 2, averaged over the valid sampled negatives:
  -log sigma(v_y) - mean_j log sigma(-v_j). Shapes: pos (N,), scores_NxS / valid (N, S)."""
  neg = _psum(jnp.sum(jnp.where(valid, jax.nn.log_sigmoid(-jnp.where(valid, scores, 0.0)), 0.0),
                      axis=-1), axis_name)
  count = _psum(jnp.sum(valid, axis=-1), axis_name)
  return -jax.nn.log_sigmoid(pos) - neg / jnp.maximum(count, 1)


def adversarial_ns_loss(pos, scores, valid, log_q, log_q_pos, *, lam: float, num_samples: int,
                        axis_name=None):
  """Bamler & Mandt Eq. 6 with the S drawn negatives averaged (their code's choice):
  -log s(xi_y) + lam (xi_y + log p_n(y|x))^2 + mean_s[-log s(-xi_s) + lam (xi_s + log p_n(y_s|x))^2].
  `log_q` / `log_q_pos` are log expected counts log(S p_n); log p_n carries no
  gradient (the tree is fixed while the model trains). Shapes: pos / log_q_pos (N,),
  scores_NxS / valid / log_q (N, S)."""
  log_s = jnp.log(float(num_samples))
  log_q = jax.lax.stop_gradient(log_q) - log_s
  log_q_pos = jax.lax.stop_gradient(log_q_pos) - log_s
  pos_term = -jax.nn.log_sigmoid(pos) + lam * jnp.square(pos + log_q_pos)
  safe = jnp.where(valid, scores, 0.0)
  neg_terms = -jax.nn.log_sigmoid(-safe) + lam * jnp.square(safe + jnp.where(valid, log_q, 0.0))
  neg = _psum(jnp.sum(jnp.where(valid, neg_terms, 0.0), axis=-1), axis_name)
  count = _psum(jnp.sum(valid, axis=-1), axis_name)
  return pos_term + neg / jnp.maximum(count, 1)


def nce_loss(pos, scores, valid, log_q, log_q_pos, *, axis_name=None):
  """Noise-contrastive estimation with S draws from the noise distribution q:
  -log s(v_y - log(S q_y)) - sum_s log s(-(v_s - log(S q_s))), where log_q,
  log_q_pos are the log expected counts log(S q). No bias removal at
  prediction (the model estimates log p(y|x) itself). Gutmann & Hyvarinen 2010,
  Mnih & Teh 2012. Shapes: pos / log_q_pos (N,), scores_NxS / valid / log_q (N, S)."""
  pos_term = -jax.nn.log_sigmoid(pos - jax.lax.stop_gradient(log_q_pos))
  logits = jnp.where(valid, scores - jax.lax.stop_gradient(log_q), 0.0)
  neg = _psum(jnp.sum(jnp.where(valid, -jax.nn.log_sigmoid(-logits), 0.0), axis=-1), axis_name)
  return pos_term + neg
