"""Eq. 6 loss against a NumPy reference, and Eq. 5 bias removal (Theorem 1) on a tiny problem."""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
import scipy.stats

from snm_jax import adversarial as adv


def _np_loss(xi_pos, lp_pos, xi_neg, lp_neg, lam):
  log_sig = lambda z: -np.logaddexp(0.0, -z)
  pos = -log_sig(xi_pos) + lam * (xi_pos + lp_pos) ** 2
  neg = -log_sig(-xi_neg) + lam * (xi_neg + lp_neg) ** 2
  return pos + (neg.mean(-1) if neg.ndim > pos.ndim else neg)


def test_loss_matches_numpy_and_ignores_logp_gradients():
  rng = np.random.default_rng(0)
  xi_pos, lp_pos = rng.normal(size=6), -rng.random(6) * 5
  xi_neg, lp_neg = rng.normal(size=(6, 4)) * 3, -rng.random((6, 4)) * 5
  lams = (0.0, 0.1)
  # One program: S negatives and one negative per example (shapes (N,) and (N,)) for each lam,
  # and the gradient w.r.t. log p.
  got, got_one, g = jax.jit(lambda xp, lp, xn, ln: (
      [adv.adversarial_ns_loss(xp, lp, xn, ln, lam) for lam in lams],
      [adv.adversarial_ns_loss(xp, lp, xn[:, 0], ln[:, 0], lam) for lam in lams],
      jax.grad(lambda l: adv.adversarial_ns_loss(1.0, l, jnp.ones(3), jnp.zeros(3), 0.1))(-2.0)))(
      xi_pos, lp_pos, xi_neg, lp_neg)
  for lam, loss, loss_one in zip(lams, got, got_one, strict=True):
    np.testing.assert_allclose(loss, _np_loss(xi_pos, lp_pos, xi_neg, lp_neg, lam), rtol=1e-5)
    np.testing.assert_allclose(loss_one, _np_loss(xi_pos, lp_pos, xi_neg[:, 0], lp_neg[:, 0], lam),
                               rtol=1e-5)
  assert g == 0.0
  np.testing.assert_allclose(adv.debias_scores(xi_neg, lp_neg), xi_neg + lp_neg)


def test_bias_removal_ranks_labels_like_the_full_softmax():
  """Theorem 1 in the nonparametric limit: xi* + log p_n = log p_D + const (lam -> 0).

  x takes M discrete values and xi is a free (M, C) table trained to convergence
  on Eq. 6 with 32 tree samples per positive; the full softmax's maximum-likelihood
  solution on the same positives is the log empirical frequency table. The
  auxiliary tree is random, far from p_D, so the raw xi ranks labels badly.
  """
  rng = np.random.default_rng(0)
  m, c, num_neg, per_x, lam = 25, 8, 32, 1000, 1e-3
  x = rng.normal(size=(m, 2)).astype(np.float32)
  true_logits = x @ rng.normal(size=(2, c)) * 0.8 + rng.normal(size=c) * 0.5
  p_true = np.exp(true_logits - true_logits.max(1, keepdims=True))
  p_true /= p_true.sum(1, keepdims=True)
  m_idx = np.repeat(np.arange(m), per_x)
  y = np.minimum((rng.random(m_idx.size)[:, None] > np.cumsum(p_true[m_idx], 1)).sum(1), c - 1)

  tree = adv.random_tree(1, c, 2, scale=0.7)
  logp_MxC = np.asarray(adv.log_prob_all(tree, x))
  neg = np.asarray(adv.sample(tree, x[m_idx], jax.random.key(2), num_neg))

  # The (25000, 32) index and log p arrays are arguments, not constants folded into the program.
  data = jax.device_put((m_idx, y, neg, logp_MxC[m_idx, y], logp_MxC[m_idx[:, None], neg]))

  @jax.jit
  @jax.value_and_grad
  def objective(table_flat, data):
    m_idx, y, neg, logp_pos, logp_neg = data
    table = table_flat.reshape(m, c)
    return jnp.mean(adv.adversarial_ns_loss(
        table[m_idx, y], logp_pos, table[m_idx[:, None], neg], logp_neg, lam))

  res = scipy.optimize.minimize(
      lambda t: tuple(np.asarray(v, np.float64) for v in objective(jnp.asarray(t, jnp.float32), data)),
      np.zeros(m * c), jac=True, method="L-BFGS-B", options=dict(maxiter=1000, gtol=1e-9))
  xi = res.x.reshape(m, c)
  # Converged: each cell carries ~1/(m c) of the mean loss, so this is ~1e-2 per cell.
  assert np.abs(objective(jnp.asarray(xi, jnp.float32), data)[1]).max() < 5e-5

  counts = np.zeros((m, c))
  np.add.at(counts, (m_idx, y), 1)
  softmax_logits = np.log(np.maximum(counts, 1e-3) / per_x)  # log of 0 counts clipped; ranks kept
  debiased = adv.debias_scores(xi, logp_MxC)
  spearman = lambda a, b: np.mean([scipy.stats.spearmanr(a[i], b[i])[0] for i in range(m)])
  agree = debiased.argmax(1) == softmax_logits.argmax(1)
  # Top-2 softmax gaps below 0.05 nats are within the negatives' sampling noise.
  top2 = np.sort(softmax_logits, 1)[:, -2:]
  clear = top2[:, 1] - top2[:, 0] > 0.05
  assert clear.mean() >= 0.8 and agree[clear].mean() >= 0.95 and agree.mean() >= 0.85
  assert spearman(debiased, softmax_logits) > 0.95
  assert spearman(debiased, true_logits) > 0.9
  # Without bias removal the ranking is far off, so the checks above are not vacuous.
  assert np.mean(xi.argmax(1) == softmax_logits.argmax(1)) < 0.8
  assert spearman(xi, softmax_logits) < spearman(debiased, softmax_logits) - 0.1
