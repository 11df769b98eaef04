"""`ExactSampler` (mining.sampler="exact"): Reddi et al.'s Algorithm 1 draws, B distinct labels
per example uniformly from [K] minus its positives, and Lemma 2 under those draws."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from np_reference import NP_PHI, np_owl
from snm_jax import losses
from snm_jax.errors import ConfigError
from snm_jax.mining.samplers import (ExactSampler, StratifiedSampler, skip_positives,
                                     sorted_distinct_positives)
import run_configs

K, B = 20, 10
LABEL_SET = np.array([[3, 7, -1], [0, 19, 0], [-1, -1, -1], [5, 6, 7], [12, -1, 12]], np.int32)
LABEL = np.array([3, 0, 2, 5, 12], np.int32)  # row 2: the label alone (its label_set is empty)


def _batch():
  n = len(LABEL)
  return {"label_set": jnp.asarray(LABEL_SET), "label": jnp.asarray(LABEL),
          "example_id": jnp.arange(n, dtype=jnp.int32)}


def _positives(i):
  return set(LABEL_SET[i][LABEL_SET[i] >= 0]) | {LABEL[i]}


@functools.cache
def _many_draws(sampler, reps, seed=1):
  """(reps, N, B) `sampler`'s draws on `_batch()`, vmapped over keys, jitted at run_configs.OPTIMIZED
  (20,000 draws), kept: the two tests of the draws' distribution read the same draws."""
  batch = _batch()
  draws = jax.jit(jax.vmap(lambda k: sampler.draw(k, batch)[0]), compiler_options=run_configs.OPTIMIZED)
  return np.asarray(draws(jax.random.split(jax.random.key(seed), reps)))


# One program per sampler and batch shape, not op-by-op dispatch (each op compiled on first use).
_draw = jax.jit(lambda sampler, key, batch: sampler.draw(key, batch), static_argnums=0)


def test_skip_map_enumerates_the_non_positives_in_order():
  # Every case's arrays padded to one shape (label sets to 44 entries with -1, the queries to 40;
  # the map is elementwise in x, only the first K - P are compared): the ops compile once, not
  # once per case (20 shapes took ~25 s under load).
  rng = np.random.default_rng(0)
  for _ in range(20):
    k = int(rng.integers(2, 40))
    pos = rng.choice(k, size=int(rng.integers(0, k)), replace=False)
    label_set = np.concatenate([pos, pos[:2], [-1, -1]]).astype(np.int32)  # repeats, padding
    label_set = np.pad(label_set, (0, 44 - len(label_set)), constant_values=-1)[None]
    sorted_pos, count = sorted_distinct_positives(jnp.asarray(label_set), k)
    assert int(count[0]) == len(pos)
    others = np.setdiff1d(np.arange(k), pos)
    mapped = skip_positives(jnp.arange(40, dtype=jnp.int32), sorted_pos[0], k)
    np.testing.assert_array_equal(np.asarray(mapped)[:len(others)], others)


def test_draws_are_distinct_non_positives_with_probability_b_over_k_minus_p():
  reps = 20000
  draws = _many_draws(ExactSampler(K, B), reps)
  ids, log_q, log_q_pos = _draw(ExactSampler(K, B), jax.random.key(0), _batch())
  assert ids.shape == log_q.shape == (len(LABEL), B) and log_q_pos.shape == (len(LABEL),)
  for i in range(len(LABEL)):
    positives = _positives(i)
    m = K - len(positives)
    p = B / m
    np.testing.assert_allclose(np.exp(np.asarray(log_q[i])), p, rtol=1e-6)
    np.testing.assert_allclose(np.exp(float(log_q_pos[i])), p, rtol=1e-6)
    d = draws[:, i]
    assert ((d >= 0) & (d < K)).all()
    srt = np.sort(d, axis=1)
    assert (np.diff(srt, axis=1) > 0).all(), "a label was drawn twice"
    assert not np.isin(d, list(positives)).any(), "a positive was drawn"
    freq = np.bincount(d.ravel(), minlength=K) / reps
    negatives = np.setdiff1d(np.arange(K), list(positives))
    se = np.sqrt(p * (1 - p) / reps)
    assert np.abs(freq[negatives] - p).max() < 4 * se, (i, freq[negatives], p)
    # Chi-square over the inclusion counts: under uniform B-subsets each label's count is
    # Binomial(reps, p); the sum of (O - E)^2 / (reps p (1 - p)) over m labels has mean ~m.
    chi2 = np.sum((freq[negatives] * reps - reps * p) ** 2 / (reps * p * (1 - p)))
    assert chi2 < m + 5 * np.sqrt(2 * m), (i, chi2, m)


def test_pairwise_inclusion_is_that_of_a_uniform_subset():
  """Beyond the marginals: P(a and b both drawn) = B (B-1) / (m (m-1)) for a uniform B-subset."""
  reps = 20000
  d = _many_draws(ExactSampler(K, B), reps)[:, 2]  # example 2: one positive, m = 19
  m = K - 1
  onehot = np.zeros((reps, K), bool)
  np.put_along_axis(onehot, d, True, axis=1)
  pair = (onehot[:, :, None] & onehot[:, None, :]).mean(0)
  expected = B * (B - 1) / (m * (m - 1))
  off = ~np.eye(K, dtype=bool)
  off[2, :] = off[:, 2] = False
  se = np.sqrt(expected * (1 - expected) / reps)
  assert np.abs(pair[off] - expected).max() < 5 * se


def test_fewer_non_positives_than_b_pads_with_k():
  s = ExactSampler(6, 4)
  batch = {"label_set": jnp.asarray([[0, 1, 2, -1]], jnp.int32), "label": jnp.asarray([0], jnp.int32),
           "example_id": jnp.zeros((1,), jnp.int32)}
  ids = np.asarray(_draw(s, jax.random.key(0), batch)[0][0])
  assert sorted(ids[ids < 6]) == [3, 4, 5] and (ids[ids >= 6] == 6).sum() == 1


def test_draws_depend_on_the_example_id_not_the_batch_position():
  s = ExactSampler(K, B)
  batch = _batch()
  flipped = {k: v[::-1] for k, v in batch.items()}
  a = np.asarray(_draw(s, jax.random.key(5), batch)[0])
  b = np.asarray(_draw(s, jax.random.key(5), flipped)[0])
  np.testing.assert_array_equal(a, b[::-1])


def test_b_must_be_below_k():
  with pytest.raises(ConfigError, match="mining.num_samples"):
    ExactSampler(8, 8)


@functools.cache
def _lemma2_draws(y, reps, seed):
  """(reps, B) draws for one example of label `y` (its only positive) by the exact sampler and by
  the old with-replacement per-example one; kept: both kinds of loss read the same draws."""
  batch = {"label_set": jnp.asarray([[y, -1]], jnp.int32), "label": jnp.asarray([y], jnp.int32),
           "example_id": jnp.zeros((1,), jnp.int32)}
  keys = jax.random.split(jax.random.key(seed + 1), reps)
  # The draws jitted: one program each, not op-by-op dispatch (~15 s of compiles under load).
  exact_ids = np.asarray(jax.jit(jax.vmap(lambda kk: ExactSampler(K, B).draw(kk, batch)[0][0]))(keys))
  old = StratifiedSampler(K, B, num_strata=1, per_example=True)
  old_ids = np.asarray(jax.jit(jax.vmap(
      lambda kk: old.sample_strata(kk, jnp.arange(1), jnp.zeros(1, jnp.int32))[0][0]))(keys))
  return exact_ids, old_ids


def _lemma2_means(kind, k, reps=20000, seed=0):
  """MC mean and standard error of the SNM loss of one example (K = 20, B = 10, top-k vartheta
  with Lemma 2's scale) under the exact sampler and the old with-replacement per-example one,
  and the Lemma 2 OWL value."""
  rng = np.random.default_rng(seed)
  v = rng.normal(size=K).astype(np.float32)
  y = 4
  vartheta = losses.top_k_vartheta(k, B, K)
  loss = jax.jit(jax.vmap(functools.partial(losses.snm_loss, v[y], vartheta=vartheta, phi="hinge",
                                            kind=kind)))
  exact_ids, old_ids = _lemma2_draws(y, reps, seed)
  out = {}
  for name, ids in (("exact", exact_ids), ("with_replacement", old_ids)):
    samples = np.asarray(loss(jnp.asarray(v[ids]), neg_mask=jnp.asarray(ids == y)), np.float64)
    out[name] = (samples.mean(), samples.std() / np.sqrt(reps))
  theta = losses.expected_owl_theta(vartheta, K)
  # np_owl's OWL is over the labels other than y, as Lemma 2's theta (K-1,).
  out["lemma2"] = np_owl(v.astype(np.float64), y, theta, NP_PHI["hinge"], kind)
  return out


@pytest.mark.parametrize("kind,k", [("bowl", 1), ("powl", 3)])
def test_lemma2_holds_for_exact_draws_not_for_draws_with_replacement(kind, k):
  """Lemma 2 by Monte Carlo (K = 20, B = 10): E[SNM loss] over the exact sampler's draws is the
  OWL with theta = expected_owl_theta(vartheta) within 3 standard errors; the with-replacement
  sampler (duplicates, the positive drawn and masked) misses it by many."""
  out = _lemma2_means(kind, k)
  mean, se = out["exact"]
  assert abs(mean - out["lemma2"]) < 3 * se, out
  old_mean, old_se = out["with_replacement"]
  assert abs(old_mean - out["lemma2"]) > 10 * old_se, out


def test_config_builds_the_exact_sampler_and_validates_b_against_k():
  from experiments.configs import default  # pylint: disable=g-import-not-at-top
  from snm_jax.train.config import builders, validation  # pylint: disable=g-import-not-at-top
  c = default.get_config("paper,runlocal")
  c.mining.sampler, c.mining.num_samples, c.mining.k = "exact", 16, 4
  validation.validate(c, 40)
  sampler, cdf = builders.make_sampler(c, 40)
  assert isinstance(sampler, ExactSampler) and cdf is None
  assert (sampler.num_labels, sampler.num_samples) == (40, 16)
  with pytest.raises(ConfigError, match="mining.num_samples"):
    validation.validate(c, 16)
