"""SOPRC estimator (Eq. 8), AP loss (Eq. 5), Smooth-AP and the semi-variance
regulariser (Eq. 9) against NumPy references and closed-form identities."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.metrics import average_precision_score

from snm_jax import auprc


def _np_huber(x, tau):
  return np.where(x < 0, 1 - 2 * x / tau, np.where(x < tau, (1 - x / tau) ** 2, 0.0))


def _np_sigmoid(x, tau):
  return np.where(x < 0, np.tanh(-x / (2 * tau)), 0.0)


def _np_soprc(scores, pos, valid, v, prior, tau1, tau2, eps):
  """Loop-by-loop Eq. 8."""
  pos_idx = [i for i in range(len(scores)) if pos[i] and valid[i]]
  neg_idx = [i for i in range(len(scores)) if not pos[i] and valid[i]]
  terms = []
  for i in pos_idx:
    num = (1 - prior) / prior * np.mean([_np_huber(scores[i] - scores[j], tau1)
                                         for j in neg_idx])
    den = np.mean([_np_sigmoid(scores[i] - u, tau2) for u in v]) + eps
    t = num / den
    terms.append(t / (1 + t))
  return np.mean(terms)


def _np_ap_loss(scores, pos, valid, tau1, tau2, eps):
  pos_idx = [i for i in range(len(scores)) if pos[i] and valid[i]]
  neg_idx = [i for i in range(len(scores)) if not pos[i] and valid[i]]
  terms = []
  for i in pos_idx:
    num = sum(_np_huber(scores[i] - scores[j], tau1) for j in neg_idx)
    den = sum(_np_sigmoid(scores[i] - scores[j], tau2) for j in pos_idx) + eps
    terms.append(num / (num + den))
  return np.mean(terms)


def _batch(seed, b=40, n_pos=7):
  rng = np.random.default_rng(seed)
  scores = rng.normal(size=b).astype(np.float32)
  pos = np.zeros(b, bool)
  pos[rng.choice(b, n_pos, replace=False)] = True
  valid = rng.random(b) > 0.1
  valid[np.flatnonzero(pos)[0]] = True
  return scores, pos, valid, rng


@pytest.mark.parametrize("max_positives", [None, 8])
def test_soprc_loss_matches_numpy_reference(max_positives):
  scores, pos, valid, rng = _batch(0)
  v = np.sort(rng.normal(0.5, 1.0, 25)).astype(np.float32)
  epss = (None, 0.01)
  gots = jax.jit(lambda s, p, v, m: [auprc.soprc_loss(s, p, v, 0.03, tau1=0.2, tau2=0.05, eps=eps,
                                                      valid_mask_B=m, max_positives=max_positives)
                                     for eps in epss])(scores, pos, v, valid)
  for eps, got in zip(epss, gots, strict=True):
    want = _np_soprc(scores, pos, valid, v, 0.03, 0.2, 0.05,
                     1 / len(v) if eps is None else eps)
    np.testing.assert_allclose(float(got), want, rtol=2e-5)


@pytest.mark.parametrize("max_positives", [None, 8])
def test_ap_loss_matches_numpy_reference(max_positives):
  scores, pos, valid, _ = _batch(1)
  got = jax.jit(lambda s, p, m: auprc.ap_loss(s, p, tau1=0.2, tau2=0.05, valid_mask_B=m,
                                               max_positives=max_positives))(scores, pos, valid)
  np.testing.assert_allclose(float(got), _np_ap_loss(scores, pos, valid, 0.2, 0.05, 1.0),
                             rtol=2e-5)


def test_with_indicator_surrogates_both_estimators_equal_one_minus_ap():
  """On the full list, l1 = 1[x <= 0], l2 = 1[x < 0] and the default guards give
  exactly 1 - AP: eps restores each positive's own count."""
  rng = np.random.default_rng(2)
  scores = rng.normal(size=300).astype(np.float32)
  pos = rng.random(300) < 0.2
  scores[pos] += 1.0
  ind_le = lambda x: (x <= 0).astype(jnp.float32)
  ind_lt = lambda x: (x < 0).astype(jnp.float32)
  one_minus_ap = 1 - average_precision_score(pos, scores)
  soprc, ap, sap = jax.jit(lambda s, p, v: (  # one program
      auprc.soprc_loss(s, p, v, pos.mean(), l1=ind_le, l2=ind_lt),
      auprc.ap_loss(s, p, l1=ind_le, l2=ind_lt),
      auprc.smooth_ap_loss(s, p, temperature=1e-5)))(scores, pos, scores[pos])
  np.testing.assert_allclose(float(soprc), one_minus_ap, rtol=1e-5)
  np.testing.assert_allclose(float(ap), one_minus_ap, rtol=1e-5)
  # Smooth-AP tends to the same value as its temperature goes to 0.
  np.testing.assert_allclose(float(sap), one_minus_ap, atol=2e-3)


def test_smooth_ap_matches_numpy_reference():
  scores, pos, valid, _ = _batch(3)
  sig = lambda z: 1 / (1 + np.exp(-z))
  p_idx = np.flatnonzero(pos & valid)
  a_idx = np.flatnonzero(valid)
  aps = []
  for i in p_idx:
    r_pos = 1 + sum(sig((scores[j] - scores[i]) / 0.1) for j in p_idx if j != i)
    r_all = 1 + sum(sig((scores[j] - scores[i]) / 0.1) for j in a_idx if j != i)
    aps.append(r_pos / r_all)
  gots = jax.jit(lambda s, p, m: [auprc.smooth_ap_loss(s, p, temperature=0.1, valid_mask_B=m,
                                                       max_positives=mp) for mp in (None, 8)])(
      scores, pos, valid)
  for got in gots:
    np.testing.assert_allclose(float(got), 1 - np.mean(aps), rtol=1e-5)


def test_top_positive_guard_no_nan_in_value_or_gradient():
  # All scores tied: the denominator is 0 for every positive.
  pos = np.arange(16) < 4
  none = np.zeros(16, bool)
  v = np.zeros(8, np.float32)

  @jax.jit
  def values_and_grads(s):
    fns = {"soprc": lambda s, p: auprc.soprc_loss(s, p, v, 0.1),
           "ap": lambda s, p: auprc.ap_loss(s, p),
           "smooth_ap": lambda s, p: auprc.smooth_ap_loss(s, p)}
    return {(k, has): jax.value_and_grad(f)(s, p)
            for k, f in fns.items() for has, p in ((True, pos), (False, none))}

  zeros = np.zeros(16, np.float32)
  for (name, has_pos), (val, grad) in values_and_grads(zeros).items():
    assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(grad))), name
    if not has_pos:  # no positive at all: 0, not NaN
      assert float(val) == 0.0 and np.all(np.asarray(grad) == 0.0), name
  # l1(0) = 1 for all negatives, l2(0) = 0: f = c / (c + eps) with c = 9, eps = 1/8.
  np.testing.assert_allclose(float(values_and_grads(zeros)[("soprc", True)][0]),
                             9 / 9.125, rtol=1e-6)


def test_non_positive_eps_rejected():
  with pytest.raises(ValueError, match="eps"):
    auprc.soprc_loss(jnp.zeros(4), jnp.arange(4) < 2, jnp.zeros(3), 0.1, eps=0.0)
  with pytest.raises(ValueError, match="eps"):
    auprc.ap_loss(jnp.zeros(4), jnp.arange(4) < 2, eps=-1.0)


def test_stop_gradient_option_removes_exactly_the_denominator_path():
  scores, pos, _, rng = _batch(4, b=30, n_pos=6)
  v = np.sort(rng.normal(0.3, 1.0, 20)).astype(np.float32)
  prior, tau1, tau2, eps = 0.05, 0.5, 0.3, 1 / 20
  f = lambda s, sg: auprc.soprc_loss(s, jnp.asarray(pos), jnp.asarray(v), prior,
                                     tau1=tau1, tau2=tau2,
                                     stop_gradient_denominator_positive=sg)
  vg = jax.jit(jax.value_and_grad(f), static_argnums=1)
  (val_paper, g_paper), (val_code, g_code) = vg(jnp.asarray(scores), False), vg(
      jnp.asarray(scores), True)
  np.testing.assert_allclose(float(val_code), float(val_paper), rtol=1e-7)
  g_paper, g_code = np.asarray(g_paper), np.asarray(g_code)
  # Denominator path by hand: d f / d den_i * d den_i / d h_i for each positive i.
  expected = np.zeros_like(scores)
  neg = ~pos
  n_pos = pos.sum()
  for i in np.flatnonzero(pos):
    num = (1 - prior) / prior * np.mean(_np_huber(scores[i] - scores[neg], tau1))
    den = np.mean(_np_sigmoid(scores[i] - v, tau2))
    x = scores[i] - v
    dl2 = np.where(x < 0, -(1 - np.tanh(-x / (2 * tau2)) ** 2) / (2 * tau2), 0.0)
    expected[i] = -num / (num + den + eps) ** 2 * np.mean(dl2) / n_pos
  np.testing.assert_allclose(g_paper - g_code, expected, rtol=1e-4, atol=1e-7)
  assert np.max(np.abs(expected)) > 1e-3  # the path is not negligible here


def test_soprc_gradient_matches_finite_differences_float64():
  scores, pos, valid, rng = _batch(5, b=20, n_pos=5)
  v = np.sort(rng.normal(0.0, 1.0, 15))
  with jax.enable_x64(True):
    f = jax.jit(jax.vmap(lambda s: auprc.soprc_loss(
        s, jnp.asarray(pos), jnp.asarray(v), 0.2, tau1=0.5, tau2=0.3,
        valid_mask_B=jnp.asarray(valid))))
    h = 1e-6
    eye = np.eye(len(scores))

    @jax.jit
    def grad_and_differences(s):  # one program
      g = jax.vmap(jax.grad(lambda t: f(t[None])[0]))(s[None])[0]
      return g, f(s[None] + h * eye) - f(s[None] - h * eye)

    g, diff = map(np.asarray, grad_and_differences(scores.astype(np.float64)))
    fd = diff / (2 * h)
  np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-9)
  assert np.all(g[~valid] == 0)


def test_vmap_over_queries_equals_loop_and_jit():
  rng = np.random.default_rng(6)
  scores = rng.normal(size=(5, 24)).astype(np.float32)
  pos = rng.random((5, 24)) < 0.25
  v = np.sort(rng.normal(size=(5, 12)), axis=1).astype(np.float32)
  priors = np.asarray([0.01, 0.02, 0.05, 0.1, 0.2], np.float32)
  fn = jax.jit(jax.vmap(lambda s, m, a, p: auprc.soprc_loss(s, m, a, p, max_positives=24)))
  batched = fn(scores, pos, v, priors)
  one = jax.jit(auprc.soprc_loss)
  looped = [one(scores[q], pos[q], v[q], priors[q]) for q in range(5)]
  np.testing.assert_allclose(batched, looped, rtol=1e-5)


def test_semi_variance_matches_numpy_reference():
  scores, pos, valid, _ = _batch(7)
  p = scores[pos & valid]
  n = scores[~pos & valid]
  want = (2.0 / len(p) * np.sum(np.where(p < p.mean(), (p - p.mean()) ** 2, 0))
          + 0.5 / len(n) * np.sum(np.where(n > n.mean(), (n - n.mean()) ** 2, 0)))
  got, constant, g = jax.jit(lambda s, p, m, c: (  # one program
      auprc.semi_variance(s, p, 2.0, 0.5, valid_mask_B=m), auprc.semi_variance(c, p, 1.0, 1.0),
      jax.grad(auprc.semi_variance)(s, p, 1.0, 1.0, m)))(
          scores, pos, valid, np.where(pos, 1.0, -1.0).astype(np.float32))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  # Zero when positives and negatives are each constant; gradient pushes low
  # positives up and high negatives down.
  np.testing.assert_allclose(float(constant), 0.0)
  g = np.asarray(g)
  lowest_pos = np.flatnonzero(pos & valid)[np.argmin(p)]
  highest_neg = np.flatnonzero(~pos & valid)[np.argmax(n)]
  assert g[lowest_pos] < 0 and g[highest_neg] > 0
