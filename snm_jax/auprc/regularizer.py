"""Semi-variance regulariser of SOPRC (Eq. 9), one query."""
from typing import Optional

import jax
import jax.numpy as jnp


def semi_variance(scores_B: jax.Array,
                  pos_mask_B: jax.Array,
                  lambda_pos: float,
                  lambda_neg: float,
                  valid_mask_B: Optional[jax.Array] = None) -> jax.Array:
  """Eq. 9: penalises positives below their mean and negatives above theirs.

    R = lambda_pos / n+ * sum_{x in z+, h(x) < mu+} (h(x) - mu+)^2
      + lambda_neg / n- * sum_{x in z-, h(x) > mu-} (h(x) - mu-)^2

  mu+ and mu- are the batch means of the positive and negative scores (gradients
  flow through them, as in the formula).

  Args:
    scores_B: (B,) scores of the batch items for this query.
    pos_mask_B: (B,) bool, True for positives.
    lambda_pos: weight lambda1 of the positive term.
    lambda_neg: weight lambda2 of the negative term.
    valid_mask_B: (B,) bool, False for items in neither set.

  Returns:
    Scalar; a term is 0 when its set is empty.
  """
  valid_B = (jnp.ones(scores_B.shape, bool) if valid_mask_B is None
             else valid_mask_B.astype(bool))
  pos_B = pos_mask_B.astype(bool) & valid_B
  neg_B = ~pos_B & valid_B

  def one_side(mask_B, below):
    m_B = mask_B.astype(scores_B.dtype)
    n = jnp.maximum(jnp.sum(m_B), 1.0)
    mu = jnp.sum(scores_B * m_B) / n
    dev_B = scores_B - mu
    side_B = (dev_B < 0) if below else (dev_B > 0)
    return jnp.sum(jnp.square(dev_B) * side_B * m_B) / n

  return lambda_pos * one_side(pos_B, True) + lambda_neg * one_side(neg_B, False)
