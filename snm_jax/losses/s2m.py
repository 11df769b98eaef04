"""Doubly-stochastic mining (S2M, Rawat et al.): average of the hardest examples.

S2M first computes a per-example loss from the hardest labels (e.g.
`snm_loss`), then averages only the k' largest per-example losses of the
minibatch; k' = batch size is plain SNM / SGD.
"""

import numbers

import jax
import jax.numpy as jnp

from snm_jax.losses import ranking


def avg_top_k(values, k: int, mask=None) -> jax.Array:
  """Mean of the k largest valid entries along the last axis.

  Args:
    values: (..., N) float.
    k: static int, 1 <= k <= N.
    mask: optional (..., N) bool, True for VALID entries (e.g. real, not
      padded, examples). If fewer than k entries are valid, the mean is over
      the valid ones; with no valid entry the result is 0.

  Returns:
    (...,) means. Gradients reach only the selected entries.
  """
  values = ranking.as_float(values)
  n = values.shape[-1]
  if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= n:
    raise ValueError(f"k: must be a static int in [1, {n}], got {k!r}")
  top, top_valid, _ = ranking.masked_top_k(values, k, mask)
  if mask is None:
    return jnp.mean(top, axis=-1)
  total = jnp.sum(jnp.where(top_valid, top, 0), axis=-1)
  count = jnp.sum(top_valid, axis=-1)
  return total / jnp.maximum(count, 1).astype(total.dtype)


def s2m_loss(per_example_losses, k_prime: int, mask=None) -> jax.Array:
  """S2M minibatch loss: `avg_top_k(per_example_losses, k_prime, mask)`.

  Args:
    per_example_losses: (N,) losses of the minibatch.
    k_prime: static int, number of hardest examples kept (N gives the mean).
    mask: optional (N,) bool, True for valid (non-padding) examples.

  Returns:
    Scalar.
  """
  return avg_top_k(per_example_losses, k_prime, mask)
