"""Reduced precision: model.dtype (bfloat16 compute, float32 accumulation and loss) and table.dtype
(a bfloat16 class table, float32 row updates rounded back).

Tolerances, derived. bfloat16 keeps 8 significant bits (7 stored): rounding to nearest has a
relative error of at most u = 2^-8 (half the spacing 2^-7 at 1), so a product of two rounded factors
is within (2u + u^2) |a b| < 2^-7 |a b| of the exact one (up to float32's own 2^-24), and a
float32-accumulated dot product q . r within 2^-7 sum_i |q_i r_i| <= 2^-7 |q| |r| (Cauchy-Schwarz)
of its float32 value. With L2-normalised queries and rows (cosine scores) every score
s = c q . r (c = loss.logit_scale) moves by at most c 2^-7. The
per-example losses are Lipschitz in the scores in the max norm: BOWL / POWL with hinge (slope 1)
and mean top-k weights (sum 1) by 2 (the positive and the weighted negatives), the sampled
softmax (log-sum-exp minus the positive) by 2; so is their mean over the minibatch. Hence
|loss_bf16 - loss_f32| <= 2 c 2^-7 when only the scores are in bfloat16. When the tower also
computes in bfloat16 its query moves by |dq| (measured, and bounded below by 2^-5: a few
roundings of 2^-8 through two layers); the bound is then 2 c (2^-7 + max |dq|).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from snm_jax import losses, sharding
from snm_jax.errors import ConfigError
from snm_jax.mining.samplers import StratifiedSampler
from snm_jax.models import precision
from snm_jax.models.towers import LinearQuery, MLPTower, SNMTower, WideDeepQuery
from snm_jax.train.config import validation
from snm_jax.train.core import row_optimizers
from snm_jax.train.trainer.checkpointing import check_resume_config
from snm_jax.train.core.input_table import InputTable, SparseTowerParams, input_table_rows, split_params
from snm_jax.train.trainer.loop import train_and_evaluate
from snm_jax.train.core.step import (LossSpec, SparseInputTrainState, TrainState, make_loss_and_grads,
                                make_train_step)
import run_configs
from step_fixtures import commit

K, D, H, N, B, NNZ, V = 64, 100, 16, 16, 16, 6, 8
SCALE = 8.0  # loss.logit_scale of the small configs
U = 2.0 ** -7  # the relative error of a product of two bfloat16-rounded factors (docstring)
BF16 = jnp.bfloat16
U16 = jnp.uint16  # a bfloat16 table's storage: its bit patterns (snm_jax/models/precision.py)


def _batch(seed=0, dense=False):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, D, (N, NNZ)).astype(np.int32)
  vals = rng.random((N, NNZ)).astype(np.float32)
  vals /= np.linalg.norm(vals, axis=1, keepdims=True)
  label = rng.integers(0, K, N).astype(np.int32)
  b = {"feat_ids": ids, "feat_vals": vals, "label": label,
       "label_set": np.stack([label, np.full(N, -1, np.int32)], 1), "valid": np.ones(N, bool),
       "example_id": np.arange(N, dtype=np.int32)}
  if dense:
    x = np.zeros((N, D), np.float32)
    np.add.at(x, (np.arange(N)[:, None], ids), vals)
    b = {**{k: v for k, v in b.items() if k not in ("feat_ids", "feat_vals")}, "features": x}
  return b


def _spec(kind):
  if kind == "sampled_softmax":
    return LossSpec(kind=kind, logit_scale=SCALE)
  head, tail = losses.split_vartheta(losses.top_k_vartheta(4, B, K, scale="mean"))
  return LossSpec(kind=kind, phi=losses.hinge, head_minus_tail=tuple(float(h - tail) for h in head),
                  tail=float(tail), logit_scale=SCALE)


def _tower(kind, dtype):
  kw = {} if dtype == jnp.float32 else {"dtype": dtype}
  return {"snm_tower": lambda: (SNMTower(D, H, H, **kw), H, True),
          "wide_deep": lambda: (WideDeepQuery(D, H, H, **kw), D + 1 + H, False),
          "linear": lambda: (LinearQuery(D), D + 1, False),
          "mlp": lambda: (MLPTower(H, H, **kw), H, True)}[kind]()


@functools.cache
def _model(model_kind, tower_dtype):
  """(tower, params, table, inputs, normalize) for the loss tests: params and class table drawn in
  one jitted program (not op by op); snm_tower / wide_deep with the sparse input table's params."""
  tower, width, normalize = _tower(model_kind, tower_dtype)
  b = _batch(dense=model_kind == "mlp")
  inputs = (b["features"],) if model_kind == "mlp" else (b["feat_ids"], b["feat_vals"])

  @jax.jit
  def init(inputs):
    params = tower.init(jax.random.key(0), *inputs)
    rows = jax.random.normal(jax.random.key(1), (K, width))
    table = rows if normalize else 0.3 * rows / np.sqrt(width)
    if model_kind in ("snm_tower", "wide_deep"):
      params, emb = split_params(params)
      params = SparseTowerParams(params, jnp.pad(emb, ((0, input_table_rows(D, V) - D), (0, 0))))
    return params, table

  return tower, *init(inputs), inputs, normalize


@functools.cache
def _loss(model_kind, loss_kind, tower_dtype, score_dtype):
  """The step's loss (and queries) on one batch with the tower in `tower_dtype` and the scores in
  `score_dtype`; snm_tower / wide_deep with the sparse input table (the default). One jitted
  program computes both (the gradients unused: XLA drops them; the same loss bits, 2026-11-28)."""
  mesh = sharding.make_mesh((1, 1))
  tower, params, table, inputs, normalize = _model(model_kind, tower_dtype)
  b = _batch(dense=model_kind == "mlp")
  input_table = None
  apply = tower.apply
  if model_kind in ("snm_tower", "wide_deep"):
    input_table = InputTable(mesh=mesh, row_opt=row_optimizers.sgd(), lr=lambda s: 0.1)
    apply = input_table.apply_fn(tower.apply)
  fn, _ = make_loss_and_grads(tower_apply=tower.apply, sampler=StratifiedSampler(K, B, num_strata=V),
                              loss=_spec(loss_kind), mesh=mesh, normalize_classes=normalize,
                              input_table=input_table, compute_dtype=score_dtype)
  loss, q = jax.jit(lambda p, t, b, k, inputs: (fn(p, t, b, k).loss, apply(p, *inputs)))(
      params, table, b, jax.random.key(3), inputs)
  assert q.dtype == jnp.float32 and loss.dtype == jnp.float32
  return float(loss), np.asarray(q)


@pytest.mark.parametrize("loss_kind", ["bowl", "sampled_softmax"])
def test_bf16_scores_keep_the_loss_within_the_derived_bound(loss_kind):
  """Only the scores in bfloat16 (the tower in float32): |dloss| <= 2 c 2^-7 (module docstring)."""
  ref, _ = _loss("snm_tower", loss_kind, jnp.float32, jnp.float32)
  got, _ = _loss("snm_tower", loss_kind, jnp.float32, BF16)
  assert got != ref  # the scores were rounded
  assert abs(got - ref) <= 2 * SCALE * U + 1e-5, (got, ref)


@pytest.mark.parametrize("model_kind,loss_kind", [
    ("snm_tower", "bowl"), ("snm_tower", "sampled_softmax"), ("wide_deep", "bowl"), ("linear", "bowl"),
    ("mlp", "sampled_softmax")])
def test_model_dtype_bf16_loss_agrees_with_float32(model_kind, loss_kind):
  """The whole model.dtype=bfloat16 path (tower + scores; the sparse input table for snm_tower and
  wide_deep): |dloss| <= 2 c (2^-7 + max |dq|), with the tower's query error |dq| <= 2^-5."""
  ref, q32 = _loss(model_kind, loss_kind, jnp.float32, jnp.float32)
  got, q16 = _loss(model_kind, loss_kind, BF16, BF16)
  dq = float(np.max(np.abs(q16 - q32)))
  assert dq <= 2.0 ** -5, dq
  if model_kind == "linear":  # no tower computation: its query is the input itself
    assert dq == 0.0
  assert abs(got - ref) <= 2 * SCALE * (U + dq) + 1e-5, (got, ref, dq)


def test_bf16_towers_keep_float32_parameters():
  b = _batch()
  for tower in (SNMTower(D, H, H, dtype=BF16), MLPTower(H, H, dtype=BF16)):
    inputs = (b["feat_ids"], b["feat_vals"]) if isinstance(tower, SNMTower) else (_batch(dense=True)["features"],)
    params = tower.init(jax.random.key(0), *inputs)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    assert tower.apply(params, *inputs).dtype == jnp.float32


# ---- the bfloat16 class table ---------------------------------------------------------------------

@functools.cache
def _table_step(mesh_shape, table_dtype, row_opt, rounding="nearest", compute=jnp.float32):
  """A toy SNM step with its class table stored in `table_dtype` (values: a bfloat16 draw, so the
  float32 and bfloat16 tables start equal). Cached: the step is not donating, tests share it."""
  mesh = sharding.make_mesh(mesh_shape)
  tower = SNMTower(D, H, H, **({} if compute == jnp.float32 else {"dtype": compute}))
  b = _batch()
  tx = optax.sgd(0.1)
  ropt = row_optimizers.get_row_optimizer(row_opt)

  @jax.jit  # one program, not op by op
  def init(ids, vals):
    params = tower.init(jax.random.key(0), ids, vals)
    table = precision.to_storage(jax.random.normal(jax.random.key(1), (K, H)).astype(BF16).astype(jnp.float32),
                                 table_dtype)
    return params, table, ropt.init(K, H)

  params, table, table_state = init(b["feat_ids"], b["feat_vals"])
  rows = lambda x: jax.device_put(x, sharding.named(mesh, jax.P(sharding.MODEL, *[None] * (x.ndim - 1))))  # noqa: E731
  state = TrainState.create(params=params, opt_state=tx.init(params), table=rows(table),
                            table_state=jax.tree.map(rows, table_state))
  state = commit(state, mesh)
  step = make_train_step(tower_apply=tower.apply, tx=tx, row_opt=ropt, table_lr=lambda s: 0.5,
                         sampler=StratifiedSampler(K, B, num_strata=V), loss=_spec("bowl"), mesh=mesh,
                         normalize_classes=True, donate=False, compute_dtype=compute,
                         table_rounding=rounding)
  put = lambda x: jax.device_put(x, sharding.named(mesh, jax.P(sharding.DATA)))  # noqa: E731
  return state, step, {k: put(v) for k, v in b.items()}


@pytest.mark.parametrize("row_opt", ["momentum", "sgd"])
def test_bf16_table_update_is_the_float32_update_rounded_to_nearest(row_opt):
  s32, step32, batch = _table_step((1, 1), jnp.float32, row_opt)
  s16, step16, _ = _table_step((1, 1), U16, row_opt)
  new32, m32 = step32(s32, batch, jax.random.key(5))
  new16, m16 = step16(s16, batch, jax.random.key(5))
  assert new16.table.dtype == s16.table.dtype == U16  # bfloat16 bits (precision.STORAGE)
  assert float(m16["loss"]) == float(m32["loss"])  # the same float32 rows were gathered
  got, want = np.asarray(precision.upcast(new16.table)), np.asarray(new32.table).astype(BF16).astype(np.float32)
  moved = np.any(np.asarray(new32.table) != np.asarray(s32.table), axis=1)
  assert moved.sum() >= B // 2
  if row_opt == "momentum":  # the same merged float32 update, rounded once: equal bits
    np.testing.assert_array_equal(got, want)
    for a, b in zip(jax.tree.leaves(new16.table_state), jax.tree.leaves(new32.table_state), strict=True):
      assert a.dtype == jnp.float32
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the optimiser state stays float32
  else:  # float32 SGD scatter-adds duplicates one by one (another summation order): within one ulp
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=0)
    assert np.mean(got == want) > 0.99


def test_bf16_table_stochastic_update_rounds_to_a_neighbour():
  s32, step32, batch = _table_step((1, 1), jnp.float32, "momentum")
  s16, step16, _ = _table_step((1, 1), U16, "momentum", "stochastic")
  new32, _ = step32(s32, batch, jax.random.key(5))
  new16, _ = step16(s16, batch, jax.random.key(5))
  x = np.asarray(new32.table)
  got = np.asarray(precision.upcast(new16.table))
  down, up = (np.asarray(r) for r in jax.jit(lambda x: [  # the two neighbours, in one program
      precision.stochastic_round_bf16(x, jnp.full(x.shape, bits, jnp.uint32)).astype(jnp.float32)
      for bits in (0, 0xFFFF)])(x))
  assert np.all((got == down) | (got == up))
  moved = x != np.asarray(s32.table)
  assert 0.2 < np.mean(got[moved] == up[moved]) < 0.8  # both neighbours are taken
  again, _ = step16(s16, batch, jax.random.key(5))
  np.testing.assert_array_equal(np.asarray(precision.upcast(again.table)), got)  # deterministic


def test_stochastic_rounding_is_unbiased_and_keeps_small_updates():
  """Over 4096 keys the mean of the rounded values is x within 4 standard errors of a two-point
  draw (ulp sqrt(p (1 - p) / n)); an update of -1e-4 on 1.0 (half the spacing below 1.0 is 2^-9 = 0.002) is lost by
  round-to-nearest and kept on average by stochastic rounding."""
  x = np.concatenate([1.0 + np.linspace(0, 2.0 ** -7, 16, endpoint=False),
                      -3.0 - np.linspace(0, 2.0 ** -6, 16, endpoint=False),
                      [1.0 - 1e-4] * 32]).astype(np.float32)
  n = 4096

  @jax.jit  # one program for the n vmapped draws and their mean (op by op: dozens of compiles)
  def mean_of_rounded(x):
    rounded = jax.vmap(lambda k: precision.round_rows(x[None], BF16, "stochastic", k, jnp.zeros(1, jnp.int32)))(
        jax.random.split(jax.random.key(0), n))[:, 0].astype(jnp.float32)
    return jnp.mean(rounded, axis=0)

  mean = np.asarray(mean_of_rounded(x))
  ulp = np.where(np.abs(x) >= 2, 2.0 ** -6, np.where(x >= 1, 2.0 ** -7, 2.0 ** -8))
  np.testing.assert_array_less(np.abs(mean - x), 4 * ulp * 0.5 / np.sqrt(n) + 1e-7)
  assert float(x[-1].astype(BF16)) == 1.0  # nearest: the update is gone
  np.testing.assert_allclose(mean[-32:], 1.0 - 1e-4, atol=4 * 2.0 ** -8 * 0.5 / np.sqrt(n))


def test_sharded_bf16_step_equals_one_device():
  """model.dtype and table.dtype bfloat16 with stochastic rounding: a (2, 4) mesh gives the (1, 1)
  loss and table (the rounding bits follow the global row id, not the shard), up to the float32
  summation order of the sharded step, which can flip a rounding: within one ulp, nearly all equal."""
  out = {}
  for shape in ((1, 1), (2, 4)):
    state, step, batch = _table_step(shape, U16, "sgd", "stochastic", compute=BF16)
    new, metrics = step(state, batch, jax.random.key(10))
    moved = np.any(np.asarray(new.table) != np.asarray(state.table), axis=1)
    out[shape] = (np.asarray(precision.upcast(new.table)), float(metrics["loss"]), moved)
  (t1, l1, m1), (t8, l8, m8) = out[(1, 1)], out[(2, 4)]
  assert abs(l1 - l8) < 1e-5
  assert m1.sum() >= B // 2 and np.array_equal(m1, m8)
  np.testing.assert_allclose(t8, t1, rtol=2.0 ** -7, atol=0)
  assert np.mean(t8[m1] == t1[m1]) > 0.99


# ---- runs: config, resume, quality ---------------------------------------------------------------

def _config(**overrides):
  return run_configs.runlocal(
      {"dataset.name": "synthetic", "dataset.synthetic.num_labels": 256, "dataset.synthetic.num_train": 2000,
       "dataset.synthetic.num_test": 256, "dataset.synthetic.dim": 64, "train.num_steps": 8,
       "train.checkpoint_every": 4, "train.eval_every": 0, "train.log_every": 4, "eval.max_examples": 256},
      **overrides)


BF16_RUN = {"model.dtype": "bfloat16", "table.dtype": "bfloat16", "table.rounding": "stochastic"}


@pytest.mark.parametrize("overrides,field", [
    ({"model.dtype": "float16"}, "model.dtype"),
    ({"table.dtype": "bf16"}, "table.dtype"),
    ({"table.rounding": "down"}, "table.rounding"),
])
def test_config_errors(overrides, field):
  with pytest.raises(ConfigError) as e:
    validation.validate(_config(**overrides))
  assert e.value.field == field
  retrieval = _config(**{"model.dtype": "bfloat16"})
  retrieval.task = "retrieval"
  with pytest.raises(ConfigError, match="float32 only"):
    validation.validate(retrieval)


def test_older_workdirs_compare_as_float32():
  saved = _config().to_dict()
  del saved["model"]["dtype"], saved["table"]["dtype"], saved["table"]["rounding"]
  check_resume_config(saved, _config().to_dict(), "the workdir")
  with pytest.raises(ConfigError, match="saved 'float32', now 'bfloat16'") as e:
    check_resume_config(saved, _config(**{"table.dtype": "bfloat16"}).to_dict(), "the workdir")
  assert e.value.field == "table.dtype"


def test_resume_is_bit_exact_with_a_bf16_table(tmp_path):
  """8 steps straight vs 4 + resumed to 8 on a (1, 2) mesh, bfloat16 compute and table with
  stochastic rounding: the same fingerprint, the checkpoint holds the bfloat16 table."""
  cfg = lambda **kw: _config(**{**BF16_RUN, "mesh.shape": (1, 2), **kw})  # noqa: E731
  full, state = train_and_evaluate(cfg(), tmp_path / "full", return_state=True)
  train_and_evaluate(cfg(**{"train.num_steps": 4}), tmp_path / "part")
  resumed, rstate = train_and_evaluate(cfg(), tmp_path / "part", return_state=True)
  assert isinstance(state, SparseInputTrainState) and state.table.dtype == U16  # bfloat16 bits
  assert rstate.table.dtype == U16 and state.input_table.dtype == jnp.float32
  assert resumed["steps"] == full["steps"] == 8
  assert resumed["state_fingerprint"] == full["state_fingerprint"]
  assert resumed["final"] == {**full["final"], "eval_seconds": resumed["final"]["eval_seconds"]}


def test_short_bf16_run_reaches_float32_quality(tmp_path):
  """600 steps of 64 on synthetic data (K = 256), 1,024 test points: bfloat16 compute + a bfloat16
  table (stochastic rounding) within 0.04 of float32's P@1 and R@5. Measured on seeds 0-2
  (benchmarks/RESULTS.md, "bf16"): float32 R@5 0.567 / 0.538 / 0.600 (the seed-to-seed spread),
  bfloat16 - float32 = +0.006 / +0.017 / -0.016 (P@1: -0.002 / -0.006 / -0.021)."""
  def config(**kw):
    # One device (the default mesh (-1, 1) is (8, 1) on the tests' 8 forced CPU devices: 3.5x
    # slower per step on 2 cores). Measured on (1, 1) vs (8, 1): float32 P@1 / R@5 0.3145 / 0.5947
    # on both, bfloat16 0.3174 / 0.6035 vs 0.3145 / 0.5986.
    c = _config(**kw, **{"train.num_steps": 600, "train.batch_size": 64, "train.checkpoint_every": -1,
                         "train.log_every": 300, "eval.max_examples": 1024, "mesh.shape": (1, 1)})
    c.dataset.synthetic.num_test = 1024
    return c
  ref = train_and_evaluate(config(), tmp_path / "f32")["final"]
  got = train_and_evaluate(config(**BF16_RUN), tmp_path / "bf16")["final"]
  assert ref["R@5"] > 0.5  # it learned (chance: 5 / 256)
  for metric in ("P@1", "R@5"):
    assert abs(got[metric] - ref[metric]) <= 0.04, (metric, got, ref)
