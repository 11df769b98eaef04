"""Margin surrogates phi(u) of the 0-1 loss 1[u <= 0] (SNM paper, Sec. 3).

Each phi is elementwise, non-increasing and satisfies phi(u) >= 1[u <= 0], so
any ordered weighted loss built from it upper-bounds the matching top-k error
(Theorem 3 for convex phi). Arguments and results are arrays of any shape.
"""

import functools
import math
from typing import Callable, Union

import jax
import jax.numpy as jnp

Phi = Callable[[jax.Array], jax.Array]
PhiLike = Union[str, Phi]

_LN2 = math.log(2.0)


def hinge(u: jax.Array) -> jax.Array:
  """max(1 - u, 0)."""
  return jax.nn.relu(1.0 - u)


def squared_hinge(u: jax.Array) -> jax.Array:
  """max(1 - u, 0)^2."""
  return jnp.square(jax.nn.relu(1.0 - u))


def logistic(u: jax.Array) -> jax.Array:
  """log2(1 + exp(-u)), in base 2 so that logistic(0) = 1.

  Computed as softplus(-u) / ln 2 (softplus is logaddexp(x, 0)), which neither
  overflows for u -> -inf (returns ~ -u / ln 2) nor loses the tail for large u.
  """
  return jax.nn.softplus(-u) / _LN2


def exponential(u: jax.Array) -> jax.Array:
  """exp(-u). Overflows to inf in float32 for u < -88 (inherent to the loss)."""
  return jnp.exp(-u)


def ramp(u: jax.Array, rho: float = 1.0) -> jax.Array:
  """1[u <= 0] + (1 - u / rho) 1[0 < u <= rho] = clip(1 - u / rho, 0, 1).

  Bounded and non-convex; `rho` > 0 is the width of the linear part.
  """
  if not rho > 0:
    raise ValueError(f"ramp: rho must be > 0, got {rho!r}")
  return jnp.clip(1.0 - u / rho, 0.0, 1.0)


PHIS: dict[str, Phi] = {
    "hinge": hinge,
    "squared_hinge": squared_hinge,
    "logistic": logistic,
    "exponential": exponential,
    "ramp": ramp,
}


def get_phi(phi: PhiLike, **kwargs) -> Phi:
  """Returns the surrogate for a registered name or a callable.

  Args:
    phi: one of `PHIS` ("hinge", "squared_hinge", "logistic", "exponential",
      "ramp") or a callable u -> phi(u).
    **kwargs: bound to the surrogate, e.g. `get_phi("ramp", rho=0.5)`.

  Raises:
    ValueError: unknown name (the message lists the valid ones).
  """
  if callable(phi):
    fn = phi
  elif isinstance(phi, str) and phi in PHIS:
    fn = PHIS[phi]
  else:
    raise ValueError(
        f"phi: unknown surrogate {phi!r}; valid names: {sorted(PHIS)} "
        "(or pass a callable)")
  if kwargs:
    if fn is ramp and "rho" in kwargs:
      ramp(0.0, rho=kwargs["rho"])  # validates rho eagerly, not inside jit
    fn = functools.partial(fn, **kwargs)
  return fn
