"""MLPTower (model.kind=mlp, dense inputs): shapes, the L2-normalised output against a NumPy
forward pass, dropout only in training (inverted, after each hidden ReLU), and the retrieval
task's EmbeddingTower, now an MLPTower, bit-identical to its former implementation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snm_jax.models.towers import EmbeddingTower, MLPTower, tower_inputs

N, D, HID, OUT = 48, 20, 16, 8


def _x(seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(N, D)).astype(np.float32))


def _numpy_forward(params, x, num_hidden_layers, normalize=True):
  """x -> [relu(x W + b)] x L -> x W + b -> (L2), in float64 from the module's parameters."""
  p = params["params"]
  h = np.asarray(x, np.float64)
  for i in range(num_hidden_layers):
    h = np.maximum(h @ np.asarray(p[f"hidden_{i}"]["kernel"]) + np.asarray(p[f"hidden_{i}"]["bias"]), 0)
  q = h @ np.asarray(p["proj"]["kernel"]) + np.asarray(p["proj"]["bias"])
  return q / np.linalg.norm(q, axis=1, keepdims=True) if normalize else q


@pytest.mark.parametrize("num_hidden_layers", [0, 1, 3])
def test_output_shape_norm_and_values_match_numpy(num_hidden_layers):
  x = _x()
  tower = MLPTower(HID, OUT, num_hidden_layers=num_hidden_layers)
  params = tower.init(jax.random.key(0), x)
  shapes = {k: v["kernel"].shape for k, v in params["params"].items()}
  widths = [D] + [HID] * num_hidden_layers + [OUT]
  assert shapes == {**{f"hidden_{i}": (widths[i], widths[i + 1]) for i in range(num_hidden_layers)},
                    "proj": (widths[-2], OUT)}
  q = np.asarray(tower.apply(params, x))
  assert q.shape == (N, OUT) and q.dtype == np.float32
  np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(q, _numpy_forward(params, x, num_hidden_layers), rtol=1e-4, atol=1e-5)
  raw = MLPTower(HID, OUT, num_hidden_layers=num_hidden_layers, normalize=False)
  np.testing.assert_allclose(np.asarray(raw.apply(params, x)),
                             _numpy_forward(params, x, num_hidden_layers, normalize=False),
                             rtol=1e-4, atol=1e-5)


def test_dropout_acts_only_in_training_inverted_after_each_relu():
  x = _x()
  rate = 0.5
  plain = MLPTower(HID, OUT, num_hidden_layers=2, normalize=False)
  tower = MLPTower(HID, OUT, num_hidden_layers=2, dropout=rate, normalize=False)
  params = tower.init(jax.random.key(0), x)
  # Same parameters as the dropout-free tower; evaluation (the default call) is deterministic.
  for a, b in zip(jax.tree.leaves(plain.init(jax.random.key(0), x)), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  det = np.asarray(tower.apply(params, x))
  np.testing.assert_array_equal(det, np.asarray(plain.apply(params, x)))

  def train(key):
    return tower.apply(params, x, train=True, rngs={"dropout": jax.random.key(key)},
                       capture_intermediates=True)

  (out1, state1), (out2, _) = train(1), train(2)
  assert not np.allclose(out1, out2)
  np.testing.assert_array_equal(np.asarray(train(1)[0]), np.asarray(out1))  # same key, same masks
  # Each dropped hidden layer is 0 or relu(.) / (1 - rate), entry by entry, and the next layer
  # reads exactly that.
  p, inter = params["params"], state1["intermediates"]
  h = np.asarray(x, np.float64)
  dropped_share = []
  for i in range(2):
    pre = np.maximum(h @ np.asarray(p[f"hidden_{i}"]["kernel"]) + np.asarray(p[f"hidden_{i}"]["bias"]), 0)
    got = np.asarray(inter[f"dropout_{i}"]["__call__"][0], np.float64)
    kept = got != 0
    np.testing.assert_allclose(got[kept], pre[kept] / (1 - rate), rtol=1e-4, atol=1e-6)
    dropped_share.append(1 - kept[pre > 0].mean())
    h = got
  np.testing.assert_allclose(np.asarray(out1), h @ np.asarray(p["proj"]["kernel"]) + np.asarray(p["proj"]["bias"]),
                             rtol=1e-4, atol=1e-5)
  assert all(abs(s - rate) < 0.08 for s in dropped_share), dropped_share


def test_rate_zero_training_needs_no_rng_and_feature_dropout_drops_input_entries():
  x = _x()
  tower = MLPTower(HID, OUT)
  params = tower.init(jax.random.key(0), x)
  np.testing.assert_array_equal(np.asarray(tower.apply(params, x, train=True)),
                                np.asarray(tower.apply(params, x)))
  rate = 0.25
  fd = MLPTower(HID, OUT, feature_dropout=rate)
  _, state = fd.apply(params, x, train=True, rngs={"dropout": jax.random.key(3)},
                      capture_intermediates=True)
  got = np.asarray(state["intermediates"]["input_dropout"]["__call__"][0])
  kept = got != 0
  np.testing.assert_allclose(got[kept], np.asarray(x)[kept] / (1 - rate), rtol=1e-6)
  assert abs((~kept).mean() - rate) < 0.05
  np.testing.assert_array_equal(np.asarray(fd.apply(params, x)), np.asarray(tower.apply(params, x)))


class _FormerEmbeddingTower(nn.Module):
  """EmbeddingTower as it was written before it became an MLPTower (the reference)."""
  hidden: int
  embed_dim: int

  @nn.compact
  def __call__(self, x):
    e = nn.Dense(self.embed_dim)(nn.relu(nn.Dense(self.hidden)(x)))
    return e * jax.lax.rsqrt(jnp.sum(e * e, axis=-1, keepdims=True) + 1e-12)


def test_embedding_tower_is_bit_identical_to_its_former_implementation():
  x = _x(1)
  new, old = EmbeddingTower(HID, OUT), _FormerEmbeddingTower(HID, OUT)
  p_new, p_old = new.init(jax.random.key(7), x), old.init(jax.random.key(7), x)
  assert jax.tree.structure(p_new) == jax.tree.structure(p_old)
  for a, b in zip(jax.tree.leaves(p_new), jax.tree.leaves(p_old), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(new.apply(p_new, x)), np.asarray(old.apply(p_old, x)))

  def grads(module):
    return jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(3.0 * module.apply(p, x)))))(p_old)

  for a, b in zip(jax.tree.leaves(grads(new)), jax.tree.leaves(grads(old)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tower_inputs_picks_the_dense_or_the_sparse_arrays():
  dense = {"features": np.ones((2, 3)), "label": np.zeros(2)}
  sparse = {"feat_ids": np.zeros((2, 4), np.int32), "feat_vals": np.ones((2, 4)), "label": np.zeros(2)}
  assert len(tower_inputs(dense)) == 1 and tower_inputs(dense)[0] is dense["features"]
  ids, vals = tower_inputs(sparse)
  assert ids is sparse["feat_ids"] and vals is sparse["feat_vals"]
