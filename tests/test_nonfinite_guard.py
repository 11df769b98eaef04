"""The train steps' non-finite guard (snm_jax/train/core/nonfinite.py): `all_finite` is True
exactly when the loss and every entry of every leaf are finite, huge finite values included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snm_jax.train.core.nonfinite import all_finite

TREE = {"table": np.full((33, 17), 3e38, np.float32),  # sums of these would overflow to inf
        "half": np.ones((5, 3), jnp.bfloat16), "step": np.int32(7)}


def _with(leaf, index, value):
  tree = jax.tree.map(np.array, TREE)
  tree[leaf][index] = value
  return tree


@pytest.mark.parametrize("leaf,index", [("table", (0, 0)), ("table", (32, 16)), ("half", (4, 2))])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_any_nonfinite_entry_is_caught_under_jit(leaf, index, bad):
  guard = jax.jit(all_finite)
  assert bool(guard(jnp.float32(1.0), TREE))
  assert not bool(guard(jnp.float32(1.0), _with(leaf, index, bad)))
  assert not bool(guard(jnp.float32(bad), TREE))
  # The reference the guard replaces, on the same trees.
  ref = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(_with(leaf, index, bad)))
  assert not ref
