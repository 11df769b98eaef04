"""Claim check, SOPRC Prop. 2 / Fig. 1: the estimator's mean does not depend on
the batch positive rate pi0, while the mini-batch AP loss (Eq. 5) drifts with
pi0 - pi.

Scores are simulated from three score distributions; v is the exact sorted
vector of all positive scores. Batches have a fixed size with a boolean positive
mask, so one compiled function serves every pi0.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snm_jax import auprc

NUM_POS, NUM_NEG = 500, 9500  # prior pi = 0.05
BATCH = 224                   # the paper's batch size
PI0S = (0.05, 0.1, 0.2, 0.3, 0.5)
REPLICATES = 400
TAU1, TAU2 = 0.1, 0.01


def _scores(kind, rng):
  if kind == "binormal":
    return 0.25 * rng.normal(2.0, 1.0, NUM_POS), 0.25 * rng.normal(0.0, 1.0, NUM_NEG)
  if kind == "bibeta":
    return rng.beta(4, 2, NUM_POS), rng.beta(2, 4, NUM_NEG)
  return rng.uniform(0.3, 1.3, NUM_POS), rng.uniform(0.0, 1.0, NUM_NEG)


def _batches(pos, neg, n_pos, n_neg, rng, replicates=REPLICATES):
  """(R, n_pos + n_neg) scores and positive mask, positives first."""
  scores = [np.concatenate([rng.choice(pos, n_pos, replace=False),
                            rng.choice(neg, n_neg, replace=False)])
            for _ in range(replicates)]
  masks = np.broadcast_to(np.arange(n_pos + n_neg) < n_pos, (replicates, n_pos + n_neg))
  return jnp.asarray(np.stack(scores), jnp.float32), jnp.asarray(masks)


@functools.partial(jax.jit, static_argnames="max_positives")
def _batch_means(scores_RxB, masks_RxB, v_N, prior, max_positives):
  soprc = jax.vmap(lambda s, m: auprc.soprc_loss(
      s, m, v_N, prior, tau1=TAU1, tau2=TAU2, max_positives=max_positives))(
          scores_RxB, masks_RxB)
  ap = jax.vmap(lambda s, m: auprc.ap_loss(
      s, m, tau1=TAU1, tau2=TAU2, max_positives=max_positives))(
          scores_RxB, masks_RxB)
  return soprc.mean(), ap.mean()


@jax.jit
def _full_surrogate_jit(scores, v_N, prior):
  mask = jnp.arange(NUM_POS + NUM_NEG) < NUM_POS
  return auprc.soprc_loss(scores, mask, v_N, prior, tau1=TAU1, tau2=TAU2,
                          max_positives=NUM_POS)


def _full_surrogate(pos, neg, v_N, prior):
  """The full-data objective: every positive, every negative, v exact."""
  scores = jnp.asarray(np.concatenate([pos, neg]), jnp.float32)
  return float(_full_surrogate_jit(scores, v_N, prior))


@pytest.mark.parametrize("kind", ["binormal", "bibeta", "offset_uniform"])
def test_soprc_mean_invariant_to_batch_rate_ap_loss_drifts(kind):
  rng = np.random.default_rng(0)
  pos, neg = _scores(kind, rng)
  prior = NUM_POS / (NUM_POS + NUM_NEG)
  v_N = jnp.sort(jnp.asarray(pos, jnp.float32))
  full = _full_surrogate(pos, neg, v_N, prior)
  assert 0.3 < full < 0.9  # a non-trivial ranking

  soprc_means, ap_means = [], []
  for pi0 in PI0S:
    n_pos = int(round(pi0 * BATCH))
    s, b = _batches(pos, neg, n_pos, BATCH - n_pos, rng)
    soprc_mean, ap_mean = _batch_means(s, b, v_N, prior, round(max(PI0S) * BATCH))
    soprc_means.append(float(soprc_mean))
    ap_means.append(float(ap_mean))
  soprc_means, ap_means = np.array(soprc_means), np.array(ap_means)

  # SOPRC: close to the full-data surrogate at every pi0 and nearly flat. The
  # residual gap is the Jensen gap of the concave s(.) over the n- sampled
  # negatives (n- = 112 at pi0 = 0.5), not a function of pi0: see the two
  # tests below.
  np.testing.assert_array_less(np.abs(soprc_means - full), 0.07)
  assert np.ptp(soprc_means) < 0.035
  # AP loss: its implicit prior is pi0, so it falls as pi0 - pi grows.
  assert np.all(np.diff(ap_means) < 0)
  assert full - ap_means[-1] > 0.2
  assert np.ptp(ap_means) > 8 * np.ptp(soprc_means)


def test_soprc_exactly_unbiased_when_only_positives_are_subsampled():
  """With all negatives in the batch, E[f] = full surrogate for any pi0 (Prop. 2)."""
  rng = np.random.default_rng(1)
  pos, neg = _scores("bibeta", rng)
  pos, neg = pos[:200], neg[:1800]  # pi = 0.1
  prior = 0.1
  v_N = jnp.sort(jnp.asarray(pos, jnp.float32))
  scores = jnp.asarray(np.concatenate([pos, neg]), jnp.float32)
  full = float(auprc.soprc_loss(scores, jnp.arange(2000) < 200, v_N, prior,
                                tau1=TAU1, tau2=TAU2))
  # Random subsets of n+ positives, always with every negative; the other
  # positives are left out of the batch through the validity mask.
  fn = jax.jit(jax.vmap(lambda m: auprc.soprc_loss(
      scores, m, v_N, prior, tau1=TAU1, tau2=TAU2, max_positives=20,
      valid_mask_B=m | (jnp.arange(2000) >= 200))))
  for n_pos in (2, 20):
    masks = np.zeros((400, 2000), bool)
    for r in range(400):
      masks[r, rng.choice(200, n_pos, replace=False)] = True
    f = np.asarray(fn(jnp.asarray(masks)))
    assert abs(f.mean() - full) < 4 * f.std() / np.sqrt(len(f))


def test_negative_subsampling_gap_shrinks_with_more_negatives():
  """The remaining bias comes from the nonlinearity of s over sampled negatives."""
  rng = np.random.default_rng(2)
  pos, neg = _scores("binormal", rng)
  prior = NUM_POS / (NUM_POS + NUM_NEG)
  v_N = jnp.sort(jnp.asarray(pos, jnp.float32))
  full = _full_surrogate(pos, neg, v_N, prior)
  gaps = []
  for n_neg in (100, 400, 1600):
    s, b = _batches(pos, neg, 10, n_neg, rng, replicates=300)
    mean, _ = _batch_means(s, b, v_N, prior, 10)
    gaps.append(full - float(mean))
  assert gaps[0] > gaps[1] > gaps[2] > -0.005
  assert gaps[2] < 0.35 * gaps[0]
