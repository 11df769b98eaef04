"""Mined sampled softmax (`loss.kind=mined_softmax`, `losses.sampled.mined_softmax_loss`):
sampled softmax's logQ value with the gradient of the k largest corrected logits only.

(a) value, gradient and tail mass against a float64 NumPy transcription; the
    gradient through re-scored rows reaches only the selected rows;
(b) k = B is plain sampled softmax, value and gradient, through the registry;
(c) sharded over a 4-device `model` axis equals unsharded (loss level, re-scored and
    dense score gradient; train step on (2, 4) vs (1, 1), shared / per-example / exact samplers);
(d) a tiny end-to-end run learns and is bit-for-bit reproducible with the same seed.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.sweeps.spec import apply_overrides
from snm_jax import losses
from snm_jax.errors import ConfigError
from snm_jax.losses import registry, sampled
from snm_jax.mining.samplers import ExactSampler
from snm_jax.train.config import builders, validation
from snm_jax.train.core.step import LossSpec
import np_reference as ref
from step_fixtures import B as STEP_B, K as STEP_K, make
from test_train_loop import synthetic_config

P = jax.P
N, S, H, M = 5, 16, 6, 4
KEY = jax.random.key(3)


def _inputs(seed=0):
  """Scores with non-uniform log expected counts, an example with no valid negative and
  one with fewer valid negatives than the largest k tested."""
  rng = np.random.default_rng(seed)
  pos = rng.normal(size=N).astype(np.float32)
  neg = (2 * rng.normal(size=(N, S))).astype(np.float32)
  valid = rng.random((N, S)) > 0.2
  valid[0] = False
  valid[1, 2:] = False
  log_q = np.log(rng.uniform(0.1, 2.0, (N, S))).astype(np.float32)
  log_q_pos = np.log(rng.uniform(0.1, 2.0, N)).astype(np.float32)
  return pos, neg, valid, log_q, log_q_pos


def _value_and_grads(fn, pos, neg, *rest):
  """One program: per-example losses, d(sum of losses)/d(pos, neg) and fn's other outputs, for fn
  returning (losses, aux): examples are independent, so these are each example's own derivatives."""
  def run(pos, neg, *rest):
    f = lambda p, s: (jnp.sum(fn(p, s, *rest)[0]), fn(p, s, *rest))  # noqa: E731
    (_, (out, aux)), (g_pos, g_neg) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(pos, neg)
    return out, g_pos, g_neg, aux
  return jax.tree.map(np.asarray, jax.jit(run)(pos, neg, *rest))


# ---- (a) the estimator against NumPy --------------------------------------------------

@pytest.fixture(scope="module")
def sampled_softmax_of_inputs():
  """Sampled softmax's value and gradients on `_inputs()` (the same program for every k)."""
  ssm = lambda p, s, v, lq, lqp: (sampled.sampled_softmax_loss(p, s, v, lq, log_q_pos=lqp), None)  # noqa: E731
  return _value_and_grads(ssm, *_inputs())[:3]


@pytest.mark.parametrize("k", [1, 3, S])
def test_value_gradient_and_tail_mass_match_numpy(k, sampled_softmax_of_inputs):
  args = _inputs()
  pos, neg, valid, log_q, log_q_pos = args
  want, want_pos, want_neg, want_tail = ref.np_mined_softmax(*args, k)
  fn = lambda p, s, v, lq, lqp: sampled.mined_softmax_loss(p, s, v, lq, k=k, log_q_pos=lqp)  # noqa: E731
  got, g_pos, g_neg, tail = _value_and_grads(fn, pos, neg, valid, log_q, log_q_pos)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g_pos, want_pos, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g_neg, want_neg, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(tail, want_tail, rtol=1e-5, atol=1e-6)
  # Gradient only at the k largest corrected logits, and sampled softmax's gradient there.
  n_valid = valid.sum(-1)
  np.testing.assert_array_equal((g_neg != 0).sum(-1), np.minimum(n_valid, k))
  o = np.where(valid, neg - log_q, -np.inf)
  kth = -np.sort(-o, axis=-1)[:, min(k, S) - 1]
  assert np.all((g_neg == 0) | (o >= kth[:, None]))
  want_value, ssm_pos, ssm_neg = sampled_softmax_of_inputs
  np.testing.assert_array_equal(got, want_value)  # the value is sampled softmax's, bit for bit
  np.testing.assert_allclose(g_pos, ssm_pos, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(g_neg, np.where(g_neg != 0, ssm_neg, 0.0), rtol=1e-6, atol=1e-7)
  if k < 3:  # a real selection: the tail carries mass, and sampled softmax differentiates it
    assert want_tail[2:].min() > 1e-3 and np.abs(ssm_neg - g_neg).max() > 1e-3


def test_public_wrapper_is_the_trained_loss():
  pos, neg, valid, log_q, log_q_pos = _inputs(1)
  wrapper = jax.jit(functools.partial(losses.mined_softmax, k=3))  # one program per shape
  got = wrapper(pos, neg, log_q_pos, log_q, neg_mask=~valid)
  want, *_ = ref.np_mined_softmax(pos, neg, valid, log_q, log_q_pos, 3)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  # Leading batch dims broadcast as in losses.sampled_softmax.
  batched = wrapper(pos.reshape(1, N), neg.reshape(1, N, S), log_q_pos.reshape(1, N),
                    log_q.reshape(1, N, S), neg_mask=~valid.reshape(1, N, S))
  np.testing.assert_array_equal(np.asarray(batched)[0], np.asarray(got))


def _shared_problem(seed=2):
  """Queries q (N, H), shared sampled rows R (S, H), positive rows (N, H): scores q R^T."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(N, H)).astype(np.float32)
  rows = rng.normal(size=(S, H)).astype(np.float32)
  pos_rows = rng.normal(size=(N, H)).astype(np.float32)
  _, _, valid, log_q, log_q_pos = _inputs(seed)
  return q, rows, pos_rows, valid, log_q, log_q_pos


def _rescorer(q, rows):
  # The step's `negatives._rescorer` for shared draws: the picked rows re-scored, differentiably.
  return lambda idx: jnp.einsum("nh,nkh->nk", q, jnp.take(rows, idx, axis=0, mode="clip"))


def _loss_of_rows(kind, k, dense, axis_name=None):
  """sum over examples of the registry loss `kind` of scores q R^T, as a function of (q, R, pos_rows)."""
  spec = types.SimpleNamespace(kind=kind, mined_k=k, dense_score_grad=dense)

  def fn(q, rows, pos_rows, valid, log_q, log_q_pos):
    scores = q @ rows.T
    pos = jnp.sum(q * pos_rows, -1)
    per_ex, hardest = registry.get_loss(kind)(pos, scores, valid, log_q, log_q_pos, spec=spec,
                                              num_samples=S, axis_name=axis_name,
                                              score_at=_rescorer(q, rows))
    assert hardest is None
    return jnp.sum(per_ex), per_ex
  return fn


def test_rescored_gradient_reaches_only_the_selected_rows():
  """Through `score_at` the gradient w.r.t. the query and the rows is the chain rule of the
  NumPy score gradient (G: zero outside the top-k); rows no example selected get exactly 0."""
  q, rows, pos_rows, valid, log_q, log_q_pos = _shared_problem()
  k = 2
  fn = _loss_of_rows("mined_softmax", k, dense=False)
  (_, per_ex), (g_q, g_rows, g_pos_rows) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True))(
      q, rows, pos_rows, valid, log_q, log_q_pos)
  scores = q.astype(np.float64) @ rows.T.astype(np.float64)
  pos = np.sum(q.astype(np.float64) * pos_rows, -1)
  want, d_pos, d_neg, _ = ref.np_mined_softmax(pos, scores, valid, log_q, log_q_pos, k)
  np.testing.assert_allclose(np.asarray(per_ex), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(g_q), d_pos[:, None] * pos_rows + d_neg @ rows, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(g_rows), d_neg.T @ q, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(g_pos_rows), d_pos[:, None] * q, rtol=1e-5, atol=1e-5)
  untouched = ~(d_neg != 0).any(0)
  assert untouched.sum() >= S - N * k and np.all(np.asarray(g_rows)[untouched] == 0.0)


# ---- (b) k = B is sampled softmax ------------------------------------------------------

@pytest.mark.parametrize("dense", [False, True])
def test_k_equal_to_b_is_sampled_softmax_through_the_registry(dense):
  args = _shared_problem(3)
  grad = lambda kind, k: jax.jit(jax.value_and_grad(  # noqa: E731
      _loss_of_rows(kind, k, dense), argnums=(0, 1, 2), has_aux=True))(*args)
  (_, mined), g_mined = grad("mined_softmax", S)
  (_, ssm), g_ssm = grad("sampled_softmax", 0)
  np.testing.assert_allclose(np.asarray(mined), np.asarray(ssm), rtol=1e-6, atol=1e-6)
  for a, b in zip(g_mined, g_ssm):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  # ... while a smaller k changes the gradient (and not the value).
  (_, small), g_small = grad("mined_softmax", 2)
  np.testing.assert_allclose(np.asarray(small), np.asarray(ssm), rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(g_small[1]) - np.asarray(g_ssm[1])).max() > 1e-3


# ---- (c) sharded over the model axis ---------------------------------------------------

# k = 6 > S / M = 4: a shard holds fewer draws than k.
@pytest.mark.parametrize("k,dense", [(6, False), (3, True)])
def test_sharded_loss_and_gradient_equal_unsharded(k, dense):
  """The draws (rows, log_q, valid columns) split over M = 4 devices: local top-k, merge of
  the M k candidates, psum'd normaliser; value and gradient w.r.t. (q, R, pos rows) as on one device."""
  args = _shared_problem(4)
  mesh = jax.make_mesh((M,), ("x",), devices=jax.devices()[:M])
  col = P(None, "x")
  specs = (P(), P("x", None), P(), col, col, P())
  sharded = jax.shard_map(_loss_of_rows("mined_softmax", k, dense, axis_name="x"), mesh=mesh,
                          in_specs=specs, out_specs=(P(), P()))
  put = [jax.device_put(a, jax.NamedSharding(mesh, sp)) for a, sp in zip(args, specs)]
  (_, got), g_got = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2), has_aux=True))(*put)
  (_, want), g_want = jax.jit(jax.value_and_grad(_loss_of_rows("mined_softmax", k, dense),
                                                 argnums=(0, 1, 2), has_aux=True))(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  q, rows, pos_rows, valid, log_q, log_q_pos = args
  want_np, *_ = ref.np_mined_softmax(np.sum(q * pos_rows, -1), q @ rows.T, valid, log_q, log_q_pos, k)
  np.testing.assert_allclose(np.asarray(got), want_np, rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _run(mesh_shape, spec, layout="shared"):
  """One step of the toy problem (`step_fixtures`) with the sampler of `layout`, cached: each
  set-up compiles a step (a second step would compile again, for the state committed to devices)."""
  sampler = ExactSampler(STEP_K, STEP_B) if layout == "exact" else None
  setup = make(mesh_shape, per_example=layout == "per_example", spec=spec, sampler=sampler)
  st, metrics = setup["step"](setup["state"], setup["batch"], KEY)
  return st, metrics, setup["state"]


def _assert_same_state(a, b, atol=2e-6):
  np.testing.assert_allclose(np.asarray(a.table), np.asarray(b.table), atol=atol)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol)


def _moved_rows(st, init):
  return int((np.abs(np.asarray(st.table) - np.asarray(init.table)).max(-1) > 0).sum())


SPEC = LossSpec(kind="mined_softmax", mined_k=4)


@pytest.mark.parametrize("layout", ["shared", "per_example", "exact"])
def test_train_step_on_8_devices_equals_one_device(layout):
  """A step on a (2, 4) mesh equals the step on (1, 1): the stratified samplers draw the same
  negatives on any mesh, the exact sampler draws outside the shard_map."""
  one, m_one, init = _run((1, 1), SPEC, layout)
  eight, m_eight, _ = _run((2, 4), SPEC, layout)
  np.testing.assert_allclose(float(m_eight["loss"]), float(m_one["loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(m_eight["hardest_neg_score"]), float(m_one["hardest_neg_score"]),
                             rtol=1e-6)
  _assert_same_state(one, eight)
  assert np.abs(np.asarray(one.table) - np.asarray(init.table)).max() > 1e-3


def test_train_step_has_sampled_softmax_loss_and_moves_fewer_rows():
  """Through the step (`LossSpec.mined_k` reaching the loss): the loss is sampled softmax's (the
  value never depends on k), and with k = 4 < B fewer table rows move. (Re-scored vs dense and
  k = B: the registry-level tests above; any mesh: the test above.)"""
  mined, m_mined, init = _run((1, 1), SPEC)
  ssm, m_ssm, _ = _run((1, 1), LossSpec(kind="sampled_softmax"))
  np.testing.assert_allclose(float(m_mined["loss"]), float(m_ssm["loss"]), rtol=1e-6)
  assert 0 < _moved_rows(mined, init) < _moved_rows(ssm, init)


# ---- config --------------------------------------------------------------------------

def test_config_gives_k_to_the_loss_and_rejects_what_it_cannot_run():
  c = synthetic_config(**{"loss.kind": "mined_softmax", "mining.num_samples": 32, "mining.k": 5})
  validation.validate(c)
  spec = builders.make_loss_spec(c, 256)
  # S = 32 < 8 k: the dense score gradient (builders.dense_score_grad); S = 64 >= 8 k: rescored
  assert spec.kind == "mined_softmax" and spec.mined_k == 5 and spec.dense_score_grad
  assert not builders.make_loss_spec(apply_overrides(c.copy_and_resolve_references(),
                                                     {"mining.num_samples": 64}), 256).dense_score_grad
  assert builders.make_loss_spec(synthetic_config(**{"loss.kind": "sampled_softmax"}), 256).mined_k == 0
  assert registry.masks_accidental_hits("mined_softmax") is True
  for overrides, field in [({"mining.k": 33}, "mining.k"), ({"mining.k": 0}, "mining.k"),
                           ({"mining.sampler": "unigram"}, "loss.kind"),
                           ({"mining.sampler": "tree"}, "mining.sampler"),
                           ({"mining.sampler": "full"}, "mining.sampler"),
                           ({"loss.mask_accidental_hits": False}, "loss.mask_accidental_hits")]:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
      validation.validate(apply_overrides(c.copy_and_resolve_references(), overrides))


# ---- (d) end to end --------------------------------------------------------------------

def test_training_learns_and_is_reproducible_bit_for_bit(tmp_path):
  """100 steps on 256 synthetic labels: R@5 far above an untrained model's (0.01 measured;
  chance 5/256 = 0.02) and within the Bayes-optimal R@5, and the same seed gives the same state, bit for bit."""
  from snm_jax.train.trainer.loop import train_and_evaluate  # pylint: disable=g-import-not-at-top
  run = {"loss.kind": "mined_softmax", "mining.num_samples": 64, "mining.k": 8, "loss.logit_scale": 8.0,
         "train.batch_size": 64, "train.num_steps": 100, "train.log_every": 25}
  first = train_and_evaluate(synthetic_config(**run), tmp_path / "a")
  again = train_and_evaluate(synthetic_config(**run), tmp_path / "b")
  r5 = first["final"]["R@5"]
  assert r5 > 0.3, r5
  assert r5 <= first["final"]["bayes/R@5"] + 0.05
  assert again["state_fingerprint"] == first["state_fingerprint"]
  metrics = lambda r: {k: v for k, v in r["final"].items() if not k.endswith("seconds")}  # noqa: E731
  assert metrics(again) == metrics(first)
