"""Softmax family and cosine contrastive loss vs NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import expit, logsumexp

from snm_jax import losses


def np_log_sigmoid(x):
  return -np.logaddexp(0, -x)


def np_sampled_softmax(pos, neg, lq_pos, lq_neg, mask):
  o_pos, o_neg = pos - lq_pos, (neg - lq_neg)[~mask]
  return logsumexp(np.r_[o_pos, o_neg]) - o_pos


def np_negative_sampling(pos, neg, mask):
  """Eq. 2 with the valid negatives averaged (the trainer's convention)."""
  return -np_log_sigmoid(pos) - np.sum(np_log_sigmoid(-neg[~mask])) / max(np.sum(~mask), 1)


def np_nce(pos, neg, lq_pos, lq_neg, mask):
  b = neg.shape[0]
  d_pos, d_neg = pos - np.log(b) - lq_pos, neg - np.log(b) - lq_neg
  return -np_log_sigmoid(d_pos) - np.sum(np_log_sigmoid(-d_neg)[~mask])


def np_contrastive(pos, neg, margin, mask):
  return 0.5 * (1 - pos) ** 2 + 0.5 * np.sum(np.maximum(0, margin - (1 - neg[~mask])) ** 2)


def _data(rng, n=6, b=5):
  pos = rng.normal(size=n)
  neg = rng.normal(size=(n, b))
  neg[0, :2] = neg[0, 2]  # ties
  pos[1], neg[1] = pos[1] * 300, neg[1] * 300  # large magnitudes
  lq_pos = np.log(rng.uniform(0.01, 0.2, size=n))
  lq_neg = np.log(rng.uniform(0.01, 0.2, size=(n, b)))
  mask = rng.random((n, b)) < 0.3
  mask[2] = True
  return [x.astype(np.float32) for x in (pos, neg, lq_pos, lq_neg)] + [mask]


def test_softmax_cross_entropy():
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(4, 9)) * np.array([[1], [1], [100], [1000]])
  label = rng.integers(0, 9, size=4)
  got = jax.jit(losses.softmax_cross_entropy)(jnp.asarray(scores, jnp.float32), label)
  want = logsumexp(scores, axis=1) - scores[np.arange(4), label]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_sampled_softmax_matches_reference_and_full_softmax():
  rng = np.random.default_rng(1)
  pos, neg, lq_pos, lq_neg, mask = _data(rng)
  got = jax.jit(losses.sampled_softmax)(pos, neg, lq_pos, lq_neg, mask)
  d64 = [x.astype(np.float64) for x in (pos, neg, lq_pos, lq_neg)]
  want = [np_sampled_softmax(*(x[i] for x in d64), mask[i]) for i in range(len(pos))]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # All K-1 negatives with a uniform proposal: exactly the full softmax.
  scores = rng.normal(size=7).astype(np.float32)
  y = 2
  log_q = np.log(1 / 7)
  full = jax.jit(losses.sampled_softmax)(scores[y], np.delete(scores, y), log_q, np.full(6, log_q))
  np.testing.assert_allclose(full, losses.softmax_cross_entropy(scores, y), rtol=1e-6)


def test_negative_sampling_and_nce():
  rng = np.random.default_rng(2)
  pos, neg, lq_pos, lq_neg, mask = _data(rng)
  d64 = [x.astype(np.float64) for x in (pos, neg, lq_pos, lq_neg)]
  got_ns = jax.jit(losses.negative_sampling_loss)(pos, neg, mask)
  got_nce = jax.jit(losses.nce_loss)(pos, neg, lq_pos, lq_neg, mask)
  for i in range(len(pos)):
    np.testing.assert_allclose(got_ns[i], np_negative_sampling(d64[0][i], d64[1][i], mask[i]),
                               rtol=1e-5)
    np.testing.assert_allclose(got_nce[i], np_nce(*(x[i] for x in d64), mask[i]), rtol=1e-5)
  # Eq. 2 of Bamler & Mandt in its sigmoid form, no mask, the two negatives averaged.
  want = -np.log(expit(0.3)) - np.sum(np.log(expit(-np.array([0.1, -2.0])))) / 2
  np.testing.assert_allclose(losses.negative_sampling_loss(0.3, jnp.array([0.1, -2.0])), want,
                             rtol=1e-6)


def test_cosine_contrastive():
  rng = np.random.default_rng(3)
  pos = rng.uniform(-1, 1, size=5).astype(np.float32)
  neg = rng.uniform(-1, 1, size=(5, 6)).astype(np.float32)
  mask = rng.random((5, 6)) < 0.3
  for margin in (0.5, 1.2):
    got = jax.jit(losses.cosine_contrastive_loss)(pos, neg, margin, mask)
    want = [np_contrastive(float(pos[i]), neg[i].astype(np.float64), margin, mask[i])
            for i in range(5)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  # Hand value: d_pos = 0.2, negatives at s = 0.9 (d = 0.1) and s = 0.2 (d = 0.8), margin 0.5.
  np.testing.assert_allclose(losses.cosine_contrastive_loss(0.8, jnp.array([0.9, 0.2])),
                             0.5 * 0.04 + 0.5 * 0.16, rtol=1e-6)


LOSSES = {
    "sampled_softmax": (lambda p, n, lp, ln, m: losses.sampled_softmax(p, n, lp, ln, m),
                        np_sampled_softmax),
    "negative_sampling": (lambda p, n, lp, ln, m: losses.negative_sampling_loss(p, n, m),
                          lambda p, n, lp, ln, m: np_negative_sampling(p, n, m)),
    "nce": (lambda p, n, lp, ln, m: losses.nce_loss(p, n, lp, ln, m), np_nce),
    "contrastive": (lambda p, n, lp, ln, m: losses.cosine_contrastive_loss(p, n, 0.8, m),
                    lambda p, n, lp, ln, m: np_contrastive(p, n, 0.8, m)),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_grads_finite_with_garbage_masked_entries_and_match_finite_differences(name):
  ours, ref = LOSSES[name]
  neg = np.array([0.3, np.inf, -0.4, np.nan, 0.45])
  mask = np.array([False, True, False, True, False])
  lq_neg = np.log(np.array([0.1, 0.2, 0.05, 0.3, 0.1]))
  with jax.enable_x64(True):
    g_pos, g_neg = jax.jit(jax.grad(ours, argnums=(0, 1)))(
        jnp.float64(0.2), jnp.asarray(neg), np.log(0.1), jnp.asarray(lq_neg), jnp.asarray(mask))
  assert np.isfinite(g_pos) and np.all(np.isfinite(g_neg))
  np.testing.assert_array_equal(np.asarray(g_neg)[mask], 0.0)
  clean = np.where(mask, 0.0, neg)
  f = lambda p, n: ref(p, n, np.log(0.1), lq_neg, mask)
  eps = 1e-6
  fd = [(f(0.2, clean + eps * e) - f(0.2, clean - eps * e)) / (2 * eps) for e in np.eye(5)]
  np.testing.assert_allclose(np.asarray(g_neg)[~mask], np.asarray(fd)[~mask], rtol=1e-6, atol=1e-9)
  fd_pos = (f(0.2 + eps, clean) - f(0.2 - eps, clean)) / (2 * eps)
  np.testing.assert_allclose(g_pos, fd_pos, rtol=1e-6)
