"""A train step's non-finite guard, shared by every task's step (`snm_jax.train.core.step`,
`snm_jax.train.trainer.retrieval`): whether an update is kept, and the state's counters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def all_finite(loss_value, *trees):
  """True iff `loss_value` and every leaf of `trees` are finite (and an
  `optax.apply_if_finite` state among `trees` saw a finite gradient).

  Pass what the update produces (new parameters, optimiser state, ...), not the
  gradients: see `snm_jax.train.core.step._all_finite` for why. With finite values
  every where() on the result selects the update: same bits as without it.
  """
  finite = jnp.isfinite(loss_value)
  for leaf in jax.tree.leaves(trees):
    finite = finite & _leaf_finite(leaf)
  for tree in trees:
    if isinstance(tree, optax.ApplyIfFiniteState):  # train.on_nonfinite="skip" wraps the optimiser
      finite = finite & tree.last_finite  # it zeroed a non-finite gradient's update itself
  return finite


def _leaf_finite(leaf):
  """jnp.all(jnp.isfinite(leaf)) as one reduction: x - x is 0 for every finite x and NaN for
  NaN and +-inf, so the sum is NaN exactly when an entry is not finite (and cannot overflow).
  XLA:CPU ran the isfinite mask and its all-reduction as two passes: on a Delicious
  wide-and-deep table (984 x 629) 0.4 ms of every step, against ~0.15 ms. (x * 0 has the same
  values, but XLA materialised the broadcast zero inside the train step.)"""
  if not jnp.issubdtype(leaf.dtype, jnp.inexact):
    return jnp.all(jnp.isfinite(leaf))
  return jnp.isfinite(jnp.sum(leaf - leaf, dtype=jnp.float32))


def keep_if_finite(finite, new, old):
  """`new` where the step was finite, else `old` (leafwise, any pytree)."""
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def nonfinite_counters(state, finite) -> dict:
  """The state's `nonfinite_steps` and `first_nonfinite_step` (numbered from 1,
  as the logs count; -1 if none) after a step whose update was `finite`."""
  return dict(
      nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
      first_nonfinite_step=jnp.where((state.first_nonfinite_step < 0) & ~finite, state.step + 1,
                                     state.first_nonfinite_step))
