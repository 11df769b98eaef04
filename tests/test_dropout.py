"""The packed-draw dropout (snm_jax/models/dropout.py): its mask frequency, exact keep probability,
inverted scaling and determinism, against the rate asked for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snm_jax.models.dropout import Dropout, keep_mask


@pytest.mark.parametrize("keep,width_exact", [(0.5, 0.5), (0.75, 0.75), (0.7, 45875 / 65536),
                                              (0.1, 6554 / 65536)])
def test_keep_probability_is_the_rounded_one_and_the_masks_match_it(keep, width_exact):
  """8 bits when keep is a multiple of 1/256 (exact), else 16 (keep rounded to 2^-16); over
  2^21 draws the kept fraction is within 5 standard errors of that probability."""
  shape = (1024, 2048)
  mask, p = keep_mask(jax.random.key(0), keep, shape)
  assert p == width_exact
  assert abs(p - keep) <= 2.0 ** -17
  assert mask.shape == shape and mask.dtype == jnp.bool_
  frac = float(jnp.mean(mask))
  assert abs(frac - p) < 5 * np.sqrt(p * (1 - p) / mask.size)


@pytest.mark.parametrize("last", [1, 3, 7, 257])
def test_odd_widths_draw_independent_entries(last):
  """Widths that do not fill the last 32-bit word: the right shape, and over many keys each
  entry (the word's last used draw included) is kept at the keep rate."""
  keys = jax.random.split(jax.random.key(1), 4000)
  masks = np.asarray(jax.vmap(lambda k: keep_mask(k, 0.5, (3, last))[0])(keys))
  assert masks.shape == (4000, 3, last)
  per_entry = masks.mean(axis=0)
  assert np.all(np.abs(per_entry - 0.5) < 5 * np.sqrt(0.25 / 4000))
  if last > 1:  # neighbours in one word are not copies of each other
    assert np.mean(masks[..., 0] == masks[..., 1]) < 0.55


def test_layer_is_inverted_dropout_and_deterministic_in_its_key():
  x = jnp.arange(1.0, 1 + 64 * 96).reshape(64, 96)
  layer = Dropout(0.3)
  out = layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
  again = layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
  other = layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
  np.testing.assert_array_equal(out, again)
  assert not np.array_equal(out, other)
  kept = np.asarray(out) != 0
  _, keep = keep_mask(jax.random.key(0), 0.7, (1, 1))
  np.testing.assert_allclose(np.asarray(out)[kept], np.asarray(x)[kept] / keep, rtol=1e-6)
  # The mean over many masks is the input (inverted scaling by the mask's exact keep probability).
  keys = jax.random.split(jax.random.key(4), 2000)
  ones = jnp.ones((8, 16))
  mean = jnp.mean(jax.vmap(lambda k: layer.apply({}, ones, deterministic=False,
                                                 rngs={"dropout": k}))(keys), axis=0)
  assert abs(float(jnp.mean(mean)) - 1.0) < 5 * np.sqrt(0.3 / 0.7 / (2000 * 128))


def test_identity_when_deterministic_or_rate_zero_and_zeros_at_rate_one():
  x = jax.random.normal(jax.random.key(5), (4, 10))
  np.testing.assert_array_equal(Dropout(0.5).apply({}, x, deterministic=True), x)
  np.testing.assert_array_equal(Dropout(0.0).apply({}, x, deterministic=False), x)  # no rng needed
  np.testing.assert_array_equal(
      Dropout(1.0).apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(0)}), 0 * x)
  # Same interface as flax's layer: the flag on the module or the call, merged.
  np.testing.assert_array_equal(Dropout(0.5, deterministic=True).apply({}, x), x)
