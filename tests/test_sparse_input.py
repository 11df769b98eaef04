"""model.input_update="sparse": the tower's input table updated row-wise like the class table.

SGD equals the dense (optax) update of the same gradient; lazy momentum and row-wise Adagrad
touch only the rows a batch names (and match their NumPy formulas); sharded meshes equal one
device; the evaluators' tower equals the dense tower; config checks; a run resumes bit-exactly
and its checkpoint (with the new state fields) restores bitwise onto other meshes."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import default
from snm_jax import losses, sharding
from snm_jax.errors import ConfigError
from snm_jax.mining.samplers import StratifiedSampler
from snm_jax.models.towers import SNMTower, WideDeepQuery
from snm_jax.train.config import builders, validation
from snm_jax.train.core import row_optimizers
from snm_jax.train.trainer.checkpointing import Checkpointer
from snm_jax.train.core.input_table import InputTable, SparseTowerParams, input_table_rows, split_params
from snm_jax.train.trainer.loop import train_and_evaluate
from snm_jax.train.core.step import LossSpec, SparseInputTrainState, TrainState, make_train_step
import run_configs

K, D, H, N, B, NNZ, V = 64, 100, 8, 16, 16, 4, 8
D_PAD = input_table_rows(D, V)
KEY = jax.random.key(7)
TOWER_LR, TABLE_LR = 0.3, 0.5


def _batch(seed=0):
  """N examples of NNZ features among the first D - 20 ids (the last 20 are never named); in
  example 0 the last two entries are padding (value 0) naming ids 90 and 91; example N - 1 is
  an invalid (padding) example naming ids 92..95."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, D - 20, (N, NNZ)).astype(np.int32)
  vals = (rng.random((N, NNZ)) + 0.1).astype(np.float32)
  ids[0, 2:], vals[0, 2:] = (90, 91), 0.0
  ids[-1] = np.arange(92, 96)
  label = rng.integers(0, K, N).astype(np.int32)
  valid = np.ones(N, bool)
  valid[-1] = False
  return {"feat_ids": ids, "feat_vals": vals, "label": label,
          "label_set": np.stack([label, np.full(N, -1, np.int32)], 1), "valid": valid,
          "example_id": np.arange(N, dtype=np.int32)}


def _touched(*batches):
  """Rows named with a nonzero value by a valid example of any of `batches`."""
  out = np.zeros(D_PAD, bool)
  for b in batches:
    mask = (b["feat_vals"] != 0) & b["valid"][:, None]
    out[b["feat_ids"][mask]] = True
  return out


def _spec():
  head, tail = losses.split_vartheta(losses.top_k_vartheta(4, B, K, scale="mean"))
  return LossSpec(kind="bowl", phi=losses.hinge, head_minus_tail=tuple(float(h - tail) for h in head),
                  tail=float(tail))


@functools.cache  # the steps do not donate their state: set-ups are shared between tests
def _setup(mesh_shape, *, sparse, opt="sgd", model="snm", dropout=0.0, wd=0.0):
  """A step and its state on `mesh_shape`: the tower's optimiser `opt` (optax) on the whole
  model (dense) or, sparse, on the dense layers with its row-wise counterpart on the input table."""
  mesh = sharding.make_mesh(mesh_shape)
  if model == "snm":
    tower, width, normalize = SNMTower(D, H, H, dropout=dropout, feature_dropout=dropout), H, True
  else:
    tower, width, normalize = WideDeepQuery(D, H, H, dropout=dropout, feature_dropout=dropout), D + 1 + H, False
  b = _batch()
  params = _init_params(tower, b["feat_ids"], b["feat_vals"])
  tx = {"sgd": optax.sgd(TOWER_LR), "momentum": optax.sgd(TOWER_LR, momentum=0.9),
        "adagrad": optax.adagrad(TOWER_LR)}[opt]
  ropt = row_optimizers.sgd()
  rows = lambda x: jax.device_put(x, sharding.named(mesh, jax.P(sharding.MODEL, *[None] * (x.ndim - 1))))  # noqa: E731
  table = rows(0.3 * jax.random.normal(jax.random.key(1), (K, width)))
  input_table = None
  if sparse:
    kw = {"beta": 0.9} if opt == "momentum" else {}
    in_opt = row_optimizers.get_row_optimizer(opt, **kw)._replace(weight_decay=wd)
    input_table = InputTable(mesh=mesh, row_opt=in_opt, lr=lambda s: TOWER_LR)
    params, emb = split_params(params)
    state = SparseInputTrainState.create(
        params=params, opt_state=tx.init(params), table=table, table_state=ropt.init(K, width),
        input_table=rows(jnp.pad(emb, ((0, D_PAD - D), (0, 0)))),
        input_table_state=jax.tree.map(rows, in_opt.init(D_PAD, H)))
  else:
    state = TrainState.create(params=params, opt_state=tx.init(params), table=table,
                              table_state=ropt.init(K, width))
  # Placed as the step's outputs are (replicated, tables row-sharded): one compilation per set-up.
  placed = jax.tree.map(lambda _: sharding.named(mesh, sharding.REPLICATED), state)
  placed = placed.replace(**{f: jax.tree.map(lambda x: x.sharding, getattr(state, f))
                             for f in ("table", "table_state") + (("input_table", "input_table_state")
                                                                  if sparse else ())})
  state = jax.device_put(state, placed)
  sampler = StratifiedSampler(K, B, num_strata=V)
  step = make_train_step(tower_apply=tower.apply, tx=tx, row_opt=ropt, table_lr=lambda s: TABLE_LR,
                         sampler=sampler, loss=_spec(), mesh=mesh, normalize_classes=normalize,
                         donate=False, input_table=input_table)
  put = lambda b: {k: jax.device_put(v, sharding.named(mesh, jax.P(sharding.DATA))) for k, v in b.items()}  # noqa: E731
  return dict(mesh=mesh, tower=tower, state=state, step=step, put=put, input_table=input_table)


# One jitted program per tower (a static argument: the set-ups of one tower share it), not op by op.
_init_params = jax.jit(lambda tower, ids, vals: tower.init(jax.random.key(0), ids, vals), static_argnums=0)


def _bag_path(params):
  p = params["params"]
  return p["bag"]["embedding"] if "bag" in p else p["tower"]["bag"]["embedding"]


def _without_bag(params):
  return split_params(params)[0]


@pytest.mark.parametrize("model,dropout", [("snm", 0.3), ("wide_deep", 0.0)])
def test_sgd_sparse_update_equals_dense_update(model, dropout):
  """Two steps: the same losses; the input rows equal the dense model's embedding (float
  tolerance), the rows no step touched are bitwise unchanged; the rest of the state agrees."""
  dense, sparse = _setup((1, 1), sparse=False, model=model, dropout=dropout), _setup(
      (1, 1), sparse=True, model=model, dropout=dropout)
  s_d, s_s = dense["state"], sparse["state"]
  emb0 = np.asarray(_bag_path(s_d.params))
  batches = [_batch(0), _batch(1)]
  for i, b in enumerate(batches):
    key = jax.random.fold_in(KEY, i)
    s_d, m_d = dense["step"](s_d, dense["put"](b), key)
    s_s, m_s = sparse["step"](s_s, sparse["put"](b), key)
    np.testing.assert_allclose(float(m_s["loss"]), float(m_d["loss"]), rtol=1e-6)
  got, want = np.asarray(s_s.input_table), np.asarray(_bag_path(s_d.params))
  np.testing.assert_allclose(got[:D], want, rtol=0, atol=1e-6)
  touched = _touched(*batches)
  assert 0 < touched.sum() < D - 20
  np.testing.assert_array_equal(got[:D][~touched[:D]], emb0[~touched[:D]])
  np.testing.assert_array_equal(got[D:], 0.0)  # padding rows
  moved = np.abs(got[:D] - emb0).max(axis=1) > 0
  assert moved[touched[:D]].mean() > 0.5  # (a row whose example's hinges are inactive gets no gradient)
  np.testing.assert_allclose(np.asarray(s_s.table), np.asarray(s_d.table), atol=1e-6)
  for a, b in zip(jax.tree.leaves(s_s.params), jax.tree.leaves(_without_bag(s_d.params)), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_lazy_momentum_moves_only_touched_rows():
  """Step 1 (momentum 0) is an SGD step; in step 2 the rows touched only by batch 1 keep their
  values and momentum (optax's momentum would move them by lr beta m), those touched by both
  follow m <- 0.9 m + g, rows neither batch touched keep value and zero momentum."""
  sgd, mom = _setup((1, 1), sparse=True), _setup((1, 1), sparse=True, opt="momentum")
  b1, b2 = _batch(0), _batch(1)
  t0 = np.asarray(mom["state"].input_table)
  s1, _ = mom["step"](mom["state"], mom["put"](b1), KEY)
  r1, _ = sgd["step"](sgd["state"], sgd["put"](b1), KEY)
  np.testing.assert_allclose(np.asarray(s1.input_table), np.asarray(r1.input_table), atol=1e-7)
  g1 = (t0 - np.asarray(s1.input_table)) / TOWER_LR
  np.testing.assert_allclose(np.asarray(s1.input_table_state["momentum"]), g1, atol=2e-6)
  key2 = jax.random.fold_in(KEY, 1)
  s2, _ = mom["step"](s1, mom["put"](b2), key2)
  # Step 2's gradient: an SGD step of the same dense layers and tables from s1.
  r2, _ = sgd["step"](sgd["state"].replace(params=s1.params, table=s1.table,
                                            input_table=s1.input_table), sgd["put"](b2), key2)
  g2 = (np.asarray(s1.input_table) - np.asarray(r2.input_table)) / TOWER_LR
  m2 = np.asarray(s2.input_table_state["momentum"])
  only1, in2, none = _touched(b1) & ~_touched(b2), _touched(b2), ~_touched(b1, b2)
  assert only1.any() and in2.any() and none.any()
  np.testing.assert_array_equal(np.asarray(s2.input_table)[only1], np.asarray(s1.input_table)[only1])
  np.testing.assert_array_equal(m2[only1], np.asarray(s1.input_table_state["momentum"])[only1])
  np.testing.assert_allclose(m2[in2], 0.9 * g1[in2] + g2[in2], atol=1e-5)
  np.testing.assert_allclose(np.asarray(s2.input_table)[in2],
                             np.asarray(s1.input_table)[in2] - TOWER_LR * m2[in2], atol=1e-6)
  np.testing.assert_array_equal(np.asarray(s2.input_table)[none], t0[none])
  np.testing.assert_array_equal(m2[none], 0.0)


def test_rowwise_adagrad_and_decay_touch_only_the_batch_rows():
  """One step of row-wise Adagrad with decoupled decay wd: touched rows follow
  (r - lr g / sqrt(0.1 + mean g^2)) (1 - lr wd) with g the SGD step's gradient; the others,
  padding entries (value 0) and the invalid example's ids included, keep value and accumulator."""
  wd = 0.1
  sgd, ada = _setup((1, 1), sparse=True), _setup((1, 1), sparse=True, opt="adagrad", wd=wd)
  b = _batch(0)
  t0 = np.asarray(ada["state"].input_table)
  s1, _ = ada["step"](ada["state"], ada["put"](b), KEY)
  r1, _ = sgd["step"](sgd["state"], sgd["put"](b), KEY)
  g = (t0 - np.asarray(r1.input_table)) / TOWER_LR
  touched = _touched(b)
  assert not touched[[90, 91, 92, 93, 94, 95]].any()
  acc = 0.1 + np.mean(g ** 2, axis=-1)
  want = (t0 - TOWER_LR * g / (np.sqrt(acc)[:, None] + 1e-10)) * (1 - TOWER_LR * wd)
  got = np.asarray(s1.input_table)
  np.testing.assert_allclose(got[touched], want[touched], atol=1e-6)
  np.testing.assert_allclose(np.asarray(s1.input_table_state["accumulator"])[touched], acc[touched],
                             rtol=1e-6)
  np.testing.assert_array_equal(got[~touched], t0[~touched])
  np.testing.assert_array_equal(np.asarray(s1.input_table_state["accumulator"])[~touched], np.float32(0.1))


def test_nonfinite_step_leaves_the_input_table_and_its_state():
  s = _setup((1, 1), sparse=True, opt="momentum")
  s1, _ = s["step"](s["state"], s["put"](_batch(0)), KEY)
  bad = _batch(1)
  bad["feat_vals"][3, 1] = np.nan
  s2, m = s["step"](s1, s["put"](bad), KEY)
  assert not np.isfinite(float(m["loss"])) and int(s2.nonfinite_steps) == 1
  assert np.abs(np.asarray(s1.input_table_state["momentum"])).max() > 0  # a nonzero m, kept as is
  for a, b in zip(jax.tree.leaves(s2.fingerprint_leaves()), jax.tree.leaves(s1.fingerprint_leaves()),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)])
def test_sharded_sparse_step_equals_single_device(mesh_shape):
  ref, sh = _setup((1, 1), sparse=True, opt="momentum"), _setup(mesh_shape, sparse=True, opt="momentum")
  s_ref, s_sh = ref["state"], sh["state"]
  for i in range(2):
    b, key = _batch(i), jax.random.fold_in(KEY, i)
    s_ref, m_ref = ref["step"](s_ref, ref["put"](b), key)
    s_sh, m_sh = sh["step"](s_sh, sh["put"](b), key)
    np.testing.assert_allclose(float(m_sh["loss"]), float(m_ref["loss"]), rtol=1e-5)
  assert {s.data.shape[0] for s in s_sh.input_table.addressable_shards} == {D_PAD // mesh_shape[1]}
  for a, b in zip(jax.tree.leaves(s_sh), jax.tree.leaves(s_ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6)


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)])
def test_evaluation_tower_equals_the_dense_tower(mesh_shape):
  """`InputTable.apply_fn(tower.apply)` on `SparseTowerParams` = `tower.apply` on the flax
  params (to float summation order)."""
  s = _setup(mesh_shape, sparse=True)
  b = _batch(3)
  full = _init_params(s["tower"], b["feat_ids"], b["feat_vals"])  # as _setup's
  ids, vals = (jax.device_put(b[k], sharding.named(s["mesh"], jax.P(sharding.DATA)))
               for k in ("feat_ids", "feat_vals"))
  got = jax.jit(s["input_table"].apply_fn(s["tower"].apply))(s["state"].tower_params(), ids, vals)
  want = jax.jit(s["tower"].apply)(full, b["feat_ids"], b["feat_vals"])
  assert isinstance(s["state"].tower_params(), SparseTowerParams)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def _config(**overrides):
  return run_configs.runlocal(
      {"dataset.name": "synthetic", "dataset.synthetic.num_labels": 256, "dataset.synthetic.num_train": 2000,
       "dataset.synthetic.num_test": 256, "dataset.synthetic.dim": 200, "model.input_update": "sparse",
       "train.num_steps": 8, "train.checkpoint_every": 4, "train.eval_every": 0, "train.log_every": 4,
       "eval.max_examples": 128}, **overrides)


@pytest.mark.parametrize("overrides,field,message", [
    ({"optimizer.name": "adam"}, "model.input_update", "has none"),
    ({"model.input_update": "lazy"}, "model.input_update", "['sparse', 'dense']"),
    ({"optimizer.weight_decay": 20.0}, "optimizer.weight_decay", "must be < 1"),
])
def test_config_errors(overrides, field, message):
  with pytest.raises(ConfigError, match=message) as e:
    validation.validate(_config(**overrides))
  assert e.value.field == field


def test_the_default_is_sparse_and_the_base_configs_validate():
  """model.input_update defaults to sparse (it matched the dense update on the demo, docs/design.md);
  every run trained before the field existed is reproduced with model.input_update=dense."""
  assert default.get_config().model.input_update == "sparse"
  validation.validate(default.get_config())


def test_input_row_optimiser_follows_the_tower_optimiser():
  mesh = sharding.make_mesh((1, 1))
  assert builders.make_input_table(_config(**{"model.input_update": "dense"}), mesh) is None
  assert builders.sparse_input_table(_config()) and builders.sparse_input_table(
      _config(**{"model.kind": "wide_deep"}))
  for kind in ("linear", "mlp"):  # no EmbeddingBag: nothing to update sparsely
    assert not builders.sparse_input_table(_config(**{"model.kind": kind}))
  # A dense-matmul bag is a dense layer (its gradient is the whole table): optax updates it.
  for bag in ("dense", "auto"):
    assert not builders.sparse_input_table(_config(**{"model.bag_matmul": bag}))
  validation.validate(_config(**{"model.kind": "linear", "optimizer.name": "adam"}))
  validation.validate(_config(**{"model.bag_matmul": "dense", "optimizer.name": "adam"}))
  retrieval = _config(**{"optimizer.name": "adam"})
  retrieval.task = "retrieval"
  assert not builders.sparse_input_table(retrieval)
  it = builders.make_input_table(_config(**{"optimizer.name": "sgd"}), mesh)
  assert it.row_opt.additive and it.row_opt.weight_decay == 0.0
  it = builders.make_input_table(_config(**{"optimizer.momentum": 0.5, "optimizer.weight_decay": 0.01,
                                             "optimizer.warmup_steps": 4}), mesh)
  assert it.row_opt.weight_decay == 0.01 and not it.row_opt.additive
  lr = _config().optimizer.learning_rate
  # Each jitted (one program, as in the step), not op by op.
  np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(it.lr))(np.array([0, 2, 4, 7], np.int32))),
                             [0.0, lr / 2, lr, lr], rtol=1e-6)
  # Lazy momentum with beta = optimizer.momentum: m <- 0.5 m + g.
  ones = np.ones((1, 2), np.float32)
  rows, state = jax.jit(it.row_opt.update)(ones, ones, {"momentum": ones}, 1.0)
  np.testing.assert_allclose(np.asarray(state["momentum"]), 1.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """8 steps on a (1, 2) mesh, straight (with the sampler diagnostics every 4 steps) and as 4 steps
  + a resumed run of 8."""
  root = tmp_path_factory.mktemp("sparse_runs")
  full = train_and_evaluate(_config(**{"mesh.shape": (1, 2), "diagnostics.every": 4,
                                       "diagnostics.snr_draws": 2}), root / "full", return_state=True)
  train_and_evaluate(_config(**{"mesh.shape": (1, 2), "train.num_steps": 4}), root / "part")
  resumed = train_and_evaluate(_config(**{"mesh.shape": (1, 2)}), root / "part", return_state=True)
  return root, full, resumed


def test_resume_is_bit_exact(runs):
  """(Also: the diagnostics, run on the straight run only, read the sparse state and leave its
  bits alone.)"""
  root, (full, state), (resumed, _) = runs
  diag = [json.loads(line) for line in (root / "full" / "metrics.jsonl").read_text().splitlines()]
  snr = [r["diag/grad_snr"] for r in diag if "diag/grad_snr" in r]
  assert len(snr) == 2 and all(np.isfinite(snr) & (np.asarray(snr) > 0))
  assert isinstance(state, SparseInputTrainState) and state.input_table.shape == (200, 32)
  assert resumed["steps"] == full["steps"] == 8
  assert resumed["state_fingerprint"] == full["state_fingerprint"]
  assert resumed["final"] == {**full["final"], "eval_seconds": resumed["final"]["eval_seconds"]}


def test_checkpoint_with_input_table_restores_bitwise_onto_other_meshes(runs):
  root, (_, saved), _ = runs
  ckpt = Checkpointer(root / "full" / "checkpoints", async_save=False)
  try:
    for mesh_shape in ((1, 1), (2, 2)):
      mesh = sharding.make_mesh(mesh_shape)
      rows = lambda x: jax.ShapeDtypeStruct(  # noqa: E731
          x.shape, x.dtype, sharding=sharding.named(mesh, jax.P(sharding.MODEL, *[None] * (x.ndim - 1))))
      rep = sharding.named(mesh, sharding.REPLICATED)
      target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), saved)
      target = target.replace(table=rows(saved.table), table_state=jax.tree.map(rows, saved.table_state),
                              input_table=rows(saved.input_table),
                              input_table_state=jax.tree.map(rows, saved.input_table_state))
      step, restored, _ = ckpt.restore_latest(target, on_unreadable="fail")
      assert step == 8 and isinstance(restored, SparseInputTrainState)
      assert restored.input_table.sharding == target.input_table.sharding
      for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  finally:
    ckpt.close()


@pytest.mark.parametrize("name,wd", [("momentum", 0.0), ("adagrad", 0.1)])
def test_capped_merge_equals_the_full_merge(name, wd):
  """`apply_row_update(cap_unique=True)` (the input table's: T = N nnz ids may far exceed the rows)
  merges into R + 1 rows instead of T and gives the same table and state."""
  rng = np.random.default_rng(0)
  opt = row_optimizers.get_row_optimizer(name)._replace(weight_decay=wd)
  r, t, h = 40, 300, 8
  table = jnp.asarray(rng.normal(size=(r, h)).astype(np.float32))
  state = jax.tree.map(lambda x: x + 0.3, opt.init(r, h))
  ids = rng.integers(-5, r - 10, t).astype(np.int32)  # duplicates, "not mine" ids, 10 rows untouched
  ids[::7] = r + 2
  ids = jnp.asarray(ids)
  grads = jnp.asarray(rng.normal(size=(t, h)).astype(np.float32))
  # Each jitted (one program, as in the step), not op by op (both cases: 12 s of small compiles
  # under load).
  update = jax.jit(functools.partial(row_optimizers.apply_row_update, lr=0.3, opt=opt),
                   static_argnames="cap_unique")
  full = update(table, state, ids, grads)
  capped = update(table, state, ids, grads, cap_unique=True)
  for a, b in zip(jax.tree.leaves(capped), jax.tree.leaves(full), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  untouched = ~np.isin(np.arange(r), np.asarray(ids))
  assert untouched.any()
  np.testing.assert_array_equal(np.asarray(capped[0])[untouched], np.asarray(table)[untouched])


def test_resuming_an_older_workdir_with_a_sparse_input_table_is_refused():
  """A config.json written before model.input_update existed meant the dense update: resuming it
  with input_update=sparse (another state pytree) is a config error, not an unreadable checkpoint."""
  from snm_jax.train.trainer.checkpointing import check_resume_config  # pylint: disable=g-import-not-at-top
  new = _config().to_dict()
  saved = _config(**{"model.input_update": "dense"}).to_dict()
  del saved["model"]["input_update"]
  with pytest.raises(ConfigError, match="saved 'dense', now 'sparse'") as e:
    check_resume_config(saved, new, "the workdir")
  assert e.value.field == "model.input_update"
  check_resume_config(saved, _config(**{"model.input_update": "dense"}).to_dict(), "the workdir")
  # Where no model has a gathered bag the field is inert: an older workdir resumes under the default.
  for inert in ({"model.bag_matmul": "dense"}, {"model.kind": "linear"}):
    old = _config(**inert).to_dict()
    del old["model"]["input_update"]
    check_resume_config(old, _config(**inert).to_dict(), "the workdir")
