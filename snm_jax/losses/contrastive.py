"""Cosine contrastive loss (Hadsell et al. 2006 form on cosine scores).

Used as the base loss of the S2M paper's AmazonCat experiment. With cosine
distance d = 1 - s for a cosine score s in [-1, 1]:
  L = 1/2 d_pos^2 + 1/2 sum_j max(0, margin - d_j)^2,
i.e. positives are pulled to s = 1 and negatives pushed below s = 1 - margin.
"""

import jax
import jax.numpy as jnp

from snm_jax.losses import ranking


def cosine_contrastive_loss(pos_score, neg_scores, margin: float = 0.5,
                            neg_mask=None) -> jax.Array:
  """Hadsell contrastive loss on cosine scores, summed over the negatives.

  Args:
    pos_score: (...,) cosine score of the positive pair.
    neg_scores: (..., B) cosine scores of the negative pairs (e.g. the mined
      hardest ones).
    margin: distance margin m; a negative costs 0 once d_j = 1 - s_j >= m.
    neg_mask: optional (..., B) bool, True for invalid negatives (add 0).

  Returns:
    (...,) losses.
  """
  d_pos = 1.0 - ranking.as_float(pos_score)
  d_neg = 1.0 - ranking.as_float(neg_scores)
  if neg_mask is not None:
    # d = margin gives exactly 0 and a zero gradient for invalid entries.
    d_neg = jnp.where(jnp.asarray(neg_mask, bool), margin, d_neg)
  neg_terms = 0.5 * jnp.square(jax.nn.relu(margin - d_neg))
  return 0.5 * jnp.square(d_pos) + jnp.sum(neg_terms, axis=-1)
