"""Auxiliary vector: interpolation (Alg. 2), its error bound (Prop. 3), the EMA
(Eq. 10) and its convergence in expectation (Prop. 1), and the state handling."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from scipy import interpolate, stats

from snm_jax import auprc

_interp = jax.jit(auprc.interpolate_to_quantiles, static_argnums=(2, 3))


def _np_interp(values, num_out, lo, hi):
  """Reference: scipy linear interpolation with linear extrapolation, clipped."""
  y = np.sort(values)
  n = len(y)
  if n == 1:
    return np.full(num_out, np.clip(y[0], lo, hi))
  x = (np.arange(n) + 0.5) / n
  f = interpolate.interp1d(x, y, kind="linear", fill_value="extrapolate")
  return np.clip(f((np.arange(num_out) + 0.5) / num_out), lo, hi)


def test_interpolation_matches_scipy_with_masks_and_clipping():
  rng = np.random.default_rng(0)
  for n_valid in (1, 2, 3, 7, 16):
    values = rng.normal(0, 0.6, 16).astype(np.float32)
    mask = np.zeros(16, bool)
    mask[rng.choice(16, n_valid, replace=False)] = True
    values[~mask] = 1e6  # must be ignored
    out, has = _interp(values, mask, 50, (-1.0, 1.0))
    want = _np_interp(values[mask], 50, -1.0, 1.0)
    assert bool(has)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    assert np.all(np.diff(np.asarray(out)) >= 0)
  # Same number in and out: the sorted input comes back.
  values = rng.uniform(-0.5, 0.5, 9).astype(np.float32)
  out, _ = _interp(values, np.ones(9, bool), 9, (-1.0, 1.0))
  np.testing.assert_allclose(np.asarray(out), np.sort(values), rtol=1e-6)
  # Nothing valid: flagged, finite.
  out, has = _interp(values, np.zeros(9, bool), 9, (-1.0, 1.0))
  assert not bool(has) and np.all(np.asarray(out) == 0)


def _quantile_fns():
  """Smooth quantile functions on [0, 1], kept away from the tails."""
  a = 0.05
  yield "gaussian", lambda q: stats.norm.ppf(a + (1 - 2 * a) * q)
  yield "beta", lambda q: stats.beta.ppf(a + (1 - 2 * a) * q, 2.0, 5.0)


@pytest.mark.parametrize("name,p", list(_quantile_fns()))
def test_interpolation_error_within_prop3_bound(name, p):
  big_n = 2000
  grid = np.linspace(0, 1, 20001)
  h = grid[1] - grid[0]
  p2_abs = np.abs(np.diff(p(grid), 2)) / h ** 2  # |p''| at grid[1:-1]
  q_out = (np.arange(big_n) + 0.5) / big_n
  errors = {}
  for n in (8, 16, 32):
    q_in = (np.arange(n) + 0.5) / n
    out, _ = _interp(p(q_in).astype(np.float32), np.ones(n, bool), big_n, (-10.0, 10.0))
    err = np.abs(np.asarray(out, np.float64) - p(q_out))
    inside = (q_out >= q_in[0]) & (q_out <= q_in[-1])
    bound = np.max(p2_abs) / (8 * n ** 2)  # Prop. 3
    assert np.max(err[inside]) <= bound + 2e-6
    # End pieces are extrapolated over half a spacing: (1/2)(3/2)/2 = 3/8.
    assert np.max(err[~inside]) <= 3 * bound + 2e-6
    # The same bound with ||p''|| taken on each segment only, and it is tight.
    seg = np.clip(np.floor(q_out * n - 0.5).astype(int), 0, n - 2)[inside]
    local = np.array([np.max(p2_abs[(grid[1:-1] >= q_in[i]) & (grid[1:-1] <= q_in[i + 1])])
                      for i in range(n - 1)]) / (8 * n ** 2)
    ratio = err[inside] / local[seg]
    assert np.max(ratio) <= 1.0 + 1e-3 and np.max(ratio) > 0.5
    errors[n] = np.max(err[(q_out > 0.2) & (q_out < 0.8)])
  # Second-order accuracy: halving the spacing divides the error by ~4 (on a
  # fixed middle range; the largest errors sit in the end segments, which move
  # towards the steeper tails as n grows).
  assert 3.0 < errors[8] / errors[16] < 5.0 and 3.0 < errors[16] / errors[32] < 5.0


def _scan_ema(v0, targets_TxN, beta):
  def body(v, t):
    v = auprc.ema_update(v, t, beta)
    return v, None
  return jax.lax.scan(body, v0, targets_TxN)[0]


def test_ema_deterministic_recursion_closed_form():
  beta, steps = 0.02, 250
  v0 = np.linspace(-1, 1, 10, dtype=np.float32)
  c = np.linspace(0.2, 0.8, 10, dtype=np.float32)
  v_t = jax.jit(_scan_ema, static_argnums=2)(v0, np.tile(c, (steps, 1)), beta)
  np.testing.assert_allclose(v_t, c + (1 - beta) ** steps * (v0 - c), rtol=1e-5,
                             atol=1e-6)


def test_ema_expectation_converges_at_rate_prop1():
  """v_T = EMA of interpolations of random batches: E[v_T] - m = (1-beta)^T (v0 - m)."""
  beta, n, num_aux, reps = 0.1, 6, 20, 1000
  lo, hi = 0.0, 1.0
  v0 = np.zeros(num_aux, np.float32)

  def interp_batch(key):
    x = jax.random.uniform(key, (n,)) ** 2  # a skewed score distribution on [0, 1]
    return auprc.interpolate_to_quantiles(x, jnp.ones(n, bool), num_aux, (lo, hi))[0]

  @jax.jit
  def run(key, steps_mask):
    """steps_mask (T,) turns the update off after T_eff steps (one compile)."""
    def body(v, inp):
      k, on = inp
      return jnp.where(on, auprc.ema_update(v, interp_batch(k), beta), v), None
    keys = jax.random.split(key, (reps, steps_mask.shape[0]))
    return jax.vmap(lambda ks: jax.lax.scan(body, v0, (ks, steps_mask))[0])(keys)

  # m = E[interp]: independent draws.
  m = np.asarray(jax.jit(lambda key: jax.vmap(interp_batch)(jax.random.split(key, 10000)))(
      jax.random.key(99)))
  m_mean, m_std = m.mean(0), m.std(0)
  for t_eff, seed in ((5, 1), (20, 2)):
    v_t = np.asarray(run(jax.random.key(seed), np.arange(20) < t_eff))
    predicted = (1 - beta) ** t_eff * (v0 - m_mean) + m_mean
    # sd of v_T: sqrt(beta / (2 - beta) (1 - (1-beta)^{2T})) * sd(interp).
    sd = m_std * np.sqrt(beta / (2 - beta) * (1 - (1 - beta) ** (2 * t_eff)))
    tol = 5 * sd / np.sqrt(reps) + 5 * m_std / np.sqrt(10000)
    np.testing.assert_array_less(np.abs(v_t.mean(0) - predicted), tol)
    # The remaining gap really is (1-beta)^T times the initial one.
    gap = np.abs(v_t.mean(0) - m_mean).sum() / np.abs(v0 - m_mean).sum()
    np.testing.assert_allclose(gap, (1 - beta) ** t_eff, rtol=0.05)


def test_update_aux_vector_rows_counts_first_batch_and_no_gradient():
  state = auprc.init_aux_vector(5, 4, (-1.0, 1.0))
  np.testing.assert_allclose(np.asarray(state.v)[0], [-0.75, -0.25, 0.25, 0.75])
  rows = np.array([3, 1], np.int32)
  values = np.array([[0.1, 0.3, 0.5], [0.0, 0.0, 0.0]], np.float32)
  mask = np.array([[True, True, True], [False, False, False]])
  update = jax.jit(auprc.update_aux_vector,
                   static_argnames=("beta", "score_range", "init_from_first_batch"))
  new = update(state, rows, values, mask, beta=0.5, score_range=(-1.0, 1.0))
  target = _np_interp(np.array([0.1, 0.3, 0.5]), 4, -1.0, 1.0)
  np.testing.assert_allclose(np.asarray(new.v)[3], 0.5 * np.asarray(state.v)[3] + 0.5 * target,
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(new.v)[[0, 1, 2, 4]],
                             np.asarray(state.v)[[0, 1, 2, 4]])  # row 1: no data
  np.testing.assert_array_equal(new.count, [0, 0, 0, 1, 0])
  first = update(state, rows, values, mask, beta=0.5,
                 score_range=(-1.0, 1.0), init_from_first_batch=True)
  np.testing.assert_allclose(np.asarray(first.v)[3], target, rtol=1e-6)
  again = update(first, rows, values * 0, mask, beta=0.5,
                 score_range=(-1.0, 1.0), init_from_first_batch=True)
  np.testing.assert_allclose(np.asarray(again.v)[3], 0.5 * target, rtol=1e-6)  # EMA from now on
  grad = jax.jit(jax.grad(lambda x: jnp.sum(auprc.update_aux_vector(
      state, rows, x, mask, beta=0.5, score_range=(-1.0, 1.0)).v)))(values)
  np.testing.assert_array_equal(grad, 0.0)


def test_update_does_not_retrace_and_state_checkpoints(tmp_path):
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, values):
    return auprc.update_aux_vector(state, jnp.array([0, 2]), values,
                                   jnp.ones((2, 3), bool), beta=0.1,
                                   score_range=(-1.0, 1.0))
  state = auprc.init_aux_vector(3, 6, (-1.0, 1.0))
  for i in range(3):
    state = step(state, np.full((2, 3), 0.1 * i, np.float32))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "aux", state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "aux", auprc.init_aux_vector(3, 6, (-1.0, 1.0)))
  assert isinstance(restored, auprc.AuxVectorState)
  np.testing.assert_array_equal(restored.v, state.v)
  np.testing.assert_array_equal(restored.count, [3, 0, 3])
