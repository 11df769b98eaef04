"""One-sided surrogates of the ranking indicator 1[x <= 0] used by SOPRC (Eq. 7).

x is always a score difference h(x+) - h(x): x <= 0 means x is ranked at or
above the positive x+.
"""
import jax.numpy as jnp


def one_sided_huber(x, tau1):
  """Upper bound l1 of 1[x <= 0] (Eq. 7), elementwise.

  l1(x) = 1 - 2x/tau1 for x < 0, (1 - x/tau1)^2 for 0 <= x < tau1, 0 for
  x >= tau1. Continuously differentiable, equal to 1 at x = 0, convex and
  non-increasing.

  Args:
    x: array of score differences, any shape.
    tau1: positive margin.

  Returns:
    Array of the shape of `x`.
  """
  u = jnp.asarray(x) / tau1
  return jnp.where(u < 0, 1.0 - 2.0 * u, jnp.square(jnp.maximum(1.0 - u, 0.0)))


def one_sided_sigmoid(x, tau2):
  """Lower bound l2 of 1[x <= 0] (Eq. 7), elementwise.

  l2(x) = (exp(-x/tau2) - 1) / (exp(-x/tau2) + 1) for x < 0 and 0 for x >= 0,
  written as tanh(max(-x, 0) / (2 tau2)) so large |x| never overflows. It is
  (1 / (2 tau2))-Lipschitz and tends to 1[x < 0] as tau2 -> 0.

  Args:
    x: array of score differences, any shape.
    tau2: positive temperature.

  Returns:
    Array of the shape of `x`, values in [0, 1).
  """
  return jnp.tanh(jnp.maximum(-jnp.asarray(x), 0.0) / (2.0 * tau2))
