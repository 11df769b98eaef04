"""Tree probabilities, padding and ancestral sampling against NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from snm_jax import adversarial as adv


def _np_log_prob(tree, x_Nxk, labels):
  """Independent float64 reference: walk each label's leaf up to the root."""
  w = np.asarray(tree.weights_Lxk, np.float64)
  b = np.asarray(tree.biases_L, np.float64)
  leaf_of_label = np.asarray(tree.leaf_of_label_C)
  x = np.asarray(x_Nxk, np.float64)
  out = np.zeros((x.shape[0], len(labels)))
  for j, y in enumerate(labels):
    node = tree.num_leaves + leaf_of_label[y]
    while node > 1:
      parent = node // 2
      s = x @ w[parent] + b[parent]
      z = s if node % 2 == 1 else -s  # odd heap index = right child = zeta +1
      out[:, j] += -np.logaddexp(0.0, -z)
      node = parent
  return out


_RNG = np.random.default_rng(0)
_X_3x3 = _RNG.normal(size=(3, 3)).astype(np.float32)  # shared shapes: one compilation each


@pytest.fixture(scope="module")
def tree13():
  # C = 13 -> L = 16, three padding leaves at random positions.
  return adv.random_tree(0, num_labels=13, dim=3, scale=0.7)


def test_log_prob_matches_numpy_reference(tree13):
  ref = _np_log_prob(tree13, _X_3x3, range(13))
  np.testing.assert_allclose(adv.log_prob_all(tree13, _X_3x3), ref, atol=1e-5)
  labels = _RNG.integers(0, 13, (3, 7))
  np.testing.assert_allclose(adv.log_prob(tree13, _X_3x3, labels),
                             np.take_along_axis(ref, labels, 1), atol=1e-5)
  # Leaf-order chunks (whole subtrees) cover every label once; padding leaves are -inf.
  for size in (1, 4, 16):
    pieces = [adv.log_prob_leaf_chunk(tree13, _X_3x3, jnp.int32(j), size)
              for j in range(16 // size)]
    labels = np.concatenate([np.asarray(lab) for lab, _ in pieces])
    logp = np.concatenate([np.asarray(lp) for _, lp in pieces], axis=1)
    np.testing.assert_array_equal(labels, np.asarray(tree13.label_of_leaf_L))
    np.testing.assert_allclose(logp[:, labels >= 0], ref[:, labels[labels >= 0]], atol=1e-5)
    assert np.all(np.isneginf(logp[:, labels < 0]))


def test_probabilities_sum_to_one_and_padding_is_zero(tree13):
  x = np.concatenate([_RNG.normal(size=(32, 3)), 30.0 * _RNG.normal(size=(32, 3))])
  p = np.exp(np.asarray(adv.log_prob_all(tree13, x), np.float64))
  np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=2e-6)
  leaf_lp = np.asarray(adv.leaf_log_probs(tree13, x))
  padding = np.asarray(tree13.label_of_leaf_L) < 0
  assert padding.sum() == 3
  assert np.all(leaf_lp[:, padding] <= -adv.SATURATION_LOGIT)
  assert np.all(np.exp(leaf_lp[:, padding]) == 0.0)  # exactly zero in float32
  assert np.all(np.isfinite(leaf_lp))


def test_saturated_nodes_for_a_known_layout():
  # C = 5, L = 8, labels at leaves 0, 1, 2, 3, 6; leaves 4, 5, 7 are padding.
  tree = adv.make_tree(np.ones((8, 2)), np.ones(8), [0, 1, 2, 3, 6])
  w, b = np.asarray(tree.weights_Lxk), np.asarray(tree.biases_L)
  # Node 3 = leaves 4..7: child 6 (leaves 4, 5) is all padding -> always right.
  assert b[3] == adv.SATURATION_LOGIT and np.all(w[3] == 0)
  # Node 7 = leaves 6, 7: child 15 (leaf 7) is padding -> always left.
  assert b[7] == -adv.SATURATION_LOGIT and np.all(w[7] == 0)
  # Nodes 1, 2, 4, 5 have real labels on both sides; node 6 is unreachable.
  np.testing.assert_array_equal(b[[1, 2, 4, 5, 6]], 1.0)
  np.testing.assert_array_equal(np.asarray(tree.label_of_leaf_L), [0, 1, 2, 3, -1, -1, 4, -1])


_NUM_DRAWS = 20_000


def test_sampling_frequencies_match_p_within_chi_square_bound(tree13):
  labels, logp = adv.sample_with_log_prob(tree13, _X_3x3, jax.random.key(4), _NUM_DRAWS)
  labels = np.asarray(labels)
  assert labels.dtype == np.int32 and labels.shape == (3, _NUM_DRAWS)
  assert labels.min() >= 0 and labels.max() < 13  # padding (label -1) never drawn
  # The log-probability accumulated while sampling equals log_prob of the drawn labels.
  np.testing.assert_allclose(logp, adv.log_prob(tree13, _X_3x3, labels), atol=1e-5)
  p = np.exp(_np_log_prob(tree13, _X_3x3, range(13)))
  for i in range(3):
    expected = _NUM_DRAWS * p[i]
    counts = np.bincount(labels[i], minlength=13)
    # Pool the labels expected fewer than 5 times into one cell (chi-square validity).
    rare = expected < 5
    if rare.any():
      expected = np.append(expected[~rare], expected[rare].sum())
      counts = np.append(counts[~rare], counts[rare].sum())
    assert rare.sum() <= 2 and counts.sum() == _NUM_DRAWS
    stat = np.sum((counts - expected) ** 2 / expected)
    assert stat < scipy.stats.chi2.ppf(1 - 1e-3, df=len(expected) - 1), (i, stat)


def test_padding_next_to_a_dominant_node_is_never_sampled():
  # Huge weights push every decision hard; saturated nodes must still never let a
  # draw into padding, even where the unsaturated logit would prefer it.
  tree = adv.random_tree(5, num_labels=13, dim=3, scale=50.0)
  labels = np.asarray(adv.sample(tree, 10.0 * _X_3x3, jax.random.key(7), _NUM_DRAWS))
  assert labels.min() >= 0 and labels.max() < 13


def test_sampler_adapter_is_a_pytree_and_uses_the_projection():
  raw = _RNG.normal(size=(50, 6)).astype(np.float32)
  proj = adv.fit_projection(raw, 3)
  sampler = adv.TreeTrainingSampler(adv.random_tree(8, num_labels=10, dim=3, projection=proj),
                                    num_samples=6)
  feat_ids = jnp.tile(jnp.arange(6, dtype=jnp.int32), (3, 1))  # the dense rows as padded sparse rows
  x = sampler.project_sparse(feat_ids, jnp.asarray(raw[:3]))
  np.testing.assert_allclose(x, adv.project(raw[:3], proj), atol=1e-5)
  np.testing.assert_allclose(sampler.project_sparse_host(raw[:3]), x, atol=1e-5)
  batch = {"feat_ids": feat_ids, "feat_vals": jnp.asarray(raw[:3]), "label": jnp.arange(3)}
  draw = jax.jit(lambda smp, key: smp.draw(key, batch))  # the sampler as a jit argument
  ids, log_q, log_q_pos = draw(sampler, jax.random.key(9))
  assert ids.shape == (3, 6) and ids.dtype == jnp.int32 and log_q.dtype == jnp.float32
  log_p = _np_log_prob(sampler.tree, x, range(10))
  # log expected counts among the 6 draws: log(6 p_n(y|x)), for draws and positives alike.
  np.testing.assert_allclose(log_q, np.log(6) + log_p[np.arange(3)[:, None], np.asarray(ids)], atol=1e-5)
  np.testing.assert_allclose(log_q_pos, np.log(6) + log_p[np.arange(3), np.arange(3)], atol=1e-5)
