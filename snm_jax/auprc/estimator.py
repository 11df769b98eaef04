"""Mini-batch estimators of 1 - AUPRC for one query: SOPRC (Eq. 8) and baselines.

A batch is one query's ranked list: `scores_B` are the scores h(x) of B items,
`pos_mask_B` marks the relevant ones (z+), every other valid item is a negative
(z-). `valid_mask_B` removes items from both sets (e.g. the query itself);
masked entries must still hold finite scores (pad with 0, not -inf). Shapes are
static; use `jax.vmap` over queries.

With `max_positives=P` (static) the positives are gathered into P slots before
the O(P x B) pair terms are formed, instead of O(B x B); it must be at least the
number of positives in the batch (extra positives would be ignored).
"""
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from snm_jax.auprc.surrogates import one_sided_huber, one_sided_sigmoid


def _gather_positives(scores_B, pos_mask_B, max_positives):
  """Returns (scores_P, mask_P, index_P) of the positives, P = max_positives or B."""
  if max_positives is None:
    return scores_B, pos_mask_B, jnp.arange(scores_B.shape[0])
  order_P = jnp.argsort(~pos_mask_B, stable=True)[:max_positives]
  return scores_B[order_P], pos_mask_B[order_P], order_P


def _masked_mean(values_P, mask_P):
  mask_P = mask_P.astype(values_P.dtype)
  return jnp.sum(values_P * mask_P) / jnp.maximum(jnp.sum(mask_P), 1.0)


def _surrogates(tau1, tau2, l1, l2):
  l1 = l1 if l1 is not None else (lambda x: one_sided_huber(x, tau1))
  l2 = l2 if l2 is not None else (lambda x: one_sided_sigmoid(x, tau2))
  return l1, l2


def _check_eps(eps):
  # Only concrete Python numbers can be checked here; arrays may be traced.
  if isinstance(eps, (int, float)) and not eps > 0:
    raise ValueError(f"eps must be > 0 (it guards a division), got {eps}")


def _masks(scores_B, pos_mask_B, valid_mask_B):
  valid_B = (jnp.ones(scores_B.shape, bool) if valid_mask_B is None
             else valid_mask_B.astype(bool))
  pos_B = pos_mask_B.astype(bool) & valid_B
  return pos_B, ~pos_B & valid_B


def soprc_loss(scores_B: jax.Array,
               pos_mask_B: jax.Array,
               aux_v_N: jax.Array,
               prior,
               *,
               tau1: float = 0.1,
               tau2: float = 0.001,
               eps=None,
               valid_mask_B: Optional[jax.Array] = None,
               stop_gradient_denominator_positive: bool = False,
               max_positives: Optional[int] = None,
               l1: Optional[Callable] = None,
               l2: Optional[Callable] = None) -> jax.Array:
  """SOPRC's sampling-rate-invariant estimate of 1 - AUPRC (Eq. 8), one query.

    f = mean_{x+ in z+} s( (1-pi)/pi * mean_{x in z-} l1(h(x+) - h(x))
                                     / (mean_{u in v} l2(h(x+) - u) + eps) )

  with s(t) = t / (1 + t), computed as num / (num + den + eps) so that it never
  divides by zero. The denominator is 0 for the top-scoring positive (l2(0) = 0);
  the guard `eps` defaults to 1/N: with indicator surrogates this is exactly the
  positive's own count in "positives ranked at or above x+" that the strict
  lower bound l2 leaves out, so the formula then equals 1 - AP. Any eps > 0
  keeps value and gradient finite (|ds/dnum| <= 1/eps).

  Args:
    scores_B: (B,) scores of the batch items for this query.
    pos_mask_B: (B,) bool, True for positives (z+).
    aux_v_N: (N,) auxiliary vector v standing for the scores of all N+
      positives of this query (Eq. 10); gradients are stopped through it.
    prior: scalar pi = N+ / N of the whole data set (not of the batch).
    tau1: margin of the one-sided Huber l1 (pos-neg pairs).
    tau2: temperature of the one-sided sigmoid l2 (pos-pos pairs).
    eps: denominator guard, scalar > 0; None means 1 / N.
    valid_mask_B: (B,) bool, False for items in neither z+ nor z-.
    stop_gradient_denominator_positive: stop the gradient through h(x+) inside
      the denominator (the authors' published code) instead of letting it
      flow (the paper's formula, default).
    max_positives: static P; see the module docstring.
    l1: optional replacement of one_sided_huber(., tau1), e.g. an indicator.
    l2: optional replacement of one_sided_sigmoid(., tau2).

  Returns:
    Scalar loss; 0 if the batch has no positive.
  """
  l1, l2 = _surrogates(tau1, tau2, l1, l2)
  pos_B, neg_B = _masks(scores_B, pos_mask_B, valid_mask_B)
  pos_scores_P, pos_P, _ = _gather_positives(scores_B, pos_B, max_positives)
  aux_v_N = jax.lax.stop_gradient(aux_v_N)
  if eps is None:
    eps = 1.0 / aux_v_N.shape[-1]
  _check_eps(eps)

  neg_B = neg_B.astype(scores_B.dtype)
  l1_PxB = l1(pos_scores_P[:, None] - scores_B[None, :])
  neg_mean_P = (l1_PxB @ neg_B) / jnp.maximum(jnp.sum(neg_B), 1.0)
  h_den_P = (jax.lax.stop_gradient(pos_scores_P)
             if stop_gradient_denominator_positive else pos_scores_P)
  den_P = jnp.mean(l2(h_den_P[:, None] - aux_v_N[None, :]), axis=-1)
  num_P = (1.0 - prior) / prior * neg_mean_P
  return _masked_mean(num_P / (num_P + den_P + eps), pos_P)


def ap_loss(scores_B: jax.Array,
            pos_mask_B: jax.Array,
            *,
            tau1: float = 0.1,
            tau2: float = 0.001,
            eps: float = 1.0,
            valid_mask_B: Optional[jax.Array] = None,
            max_positives: Optional[int] = None,
            l1: Optional[Callable] = None,
            l2: Optional[Callable] = None) -> jax.Array:
  """The biased mini-batch AP loss (Eq. 5), one query.

    f = mean_{x+ in z+} s( sum_{x in z-} l1(h(x+) - h(x))
                           / (sum_{u in z+} l2(h(x+) - h(u)) + eps) )

  Its implicit prior is the batch rate pi0 = n+ / (n+ + n-), so its mean drifts
  with pi0 - pi. `eps` (default 1, the positive's own count, see `soprc_loss`)
  guards the denominator, which is 0 for the batch's top positive.

  Args:
    scores_B, pos_mask_B, valid_mask_B, tau1, tau2, max_positives, l1, l2: as in
      `soprc_loss`.
    eps: denominator guard (a count, not a mean), > 0.

  Returns:
    Scalar loss; 0 if the batch has no positive.
  """
  _check_eps(eps)
  l1, l2 = _surrogates(tau1, tau2, l1, l2)
  pos_B, neg_B = _masks(scores_B, pos_mask_B, valid_mask_B)
  pos_scores_P, pos_P, _ = _gather_positives(scores_B, pos_B, max_positives)
  diff_PxB = pos_scores_P[:, None] - scores_B[None, :]
  num_P = l1(diff_PxB) @ neg_B.astype(scores_B.dtype)
  den_P = l2(diff_PxB) @ pos_B.astype(scores_B.dtype)
  return _masked_mean(num_P / (num_P + den_P + eps), pos_P)


def smooth_ap_loss(scores_B: jax.Array,
                   pos_mask_B: jax.Array,
                   *,
                   temperature: float = 0.01,
                   valid_mask_B: Optional[jax.Array] = None,
                   max_positives: Optional[int] = None) -> jax.Array:
  """1 - Smooth-AP (Brown et al., ECCV 2020), one query.

    AP ~= mean_{x+} (1 + sum_{u in z+, u != x+} sig((h(u) - h(x+)) / T))
                    / (1 + sum_{u valid, u != x+} sig((h(u) - h(x+)) / T))

  Args:
    scores_B, pos_mask_B, valid_mask_B, max_positives: as in `soprc_loss`.
    temperature: sigmoid temperature T.

  Returns:
    Scalar loss in [0, 1); 0 if the batch has no positive.
  """
  pos_B, neg_B = _masks(scores_B, pos_mask_B, valid_mask_B)
  pos_scores_P, pos_P, index_P = _gather_positives(scores_B, pos_B,
                                                   max_positives)
  not_self_PxB = index_P[:, None] != jnp.arange(scores_B.shape[0])[None, :]
  sig_PxB = jax.nn.sigmoid((scores_B[None, :] - pos_scores_P[:, None])
                           / temperature) * not_self_PxB
  rank_pos_P = 1.0 + sig_PxB @ pos_B.astype(scores_B.dtype)
  rank_all_P = rank_pos_P + sig_PxB @ neg_B.astype(scores_B.dtype)
  smooth_ap = _masked_mean(rank_pos_P / rank_all_P, pos_P)
  return jnp.where(jnp.any(pos_P), 1.0 - smooth_ap, 0.0)
