"""The SOPRC retrieval experiment: runlocal end to end through the one loop, resume,
metrics, batch plumbing, the aux-vector update order."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.metrics import average_precision_score

from experiments import auprc_retrieval as exp
from experiments.configs import auprc_retrieval as configs
from snm_jax import auprc
from snm_jax import metrics
from snm_jax import sharding
from snm_jax.errors import ConfigError
from snm_jax.train.trainer import loop, retrieval
from snm_jax.train.core.task import state_fingerprint


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
  """The runlocal experiment (untrained and SOPRC, one seed): (config, results, its workdir). Its
  SOPRC run is also the uninterrupted run the resume test compares with."""
  config = configs.get_config("runlocal")
  workdir = tmp_path_factory.mktemp("auprc_experiment")
  return config, exp.run_experiment(config, workdir), workdir


def test_runlocal_trains_soprc_above_untrained_and_writes_tables(experiment):
  config, results, tmp_path = experiment
  on_disk = json.loads((tmp_path / "results.json").read_text())
  assert on_disk["tasks"].keys() == results["tasks"].keys() == {"synthetic"}
  task = on_disk["tasks"]["synthetic"]
  assert set(task["methods"]) == {"untrained", "soprc"}
  keys = ["map", "recall@1", "recall@2", "recall@4", "recall@8"]
  for r in task["methods"].values():
    assert len(r["per_seed"]) == len(config.seeds)
    vals = [r["mean"][k] for k in keys]
    assert all(0.0 <= x <= 1.0 for x in vals)
    assert vals[1] <= vals[2] <= vals[3] <= vals[4]  # recall@k grows with k
  trained = task["methods"]["soprc"]["per_seed"][0]
  assert np.isfinite(trained["final_loss"]) and trained["final_loss"] < trained["first_loss"]
  assert task["methods"]["soprc"]["mean"]["map"] > task["methods"]["untrained"]["mean"]["map"] + 0.05
  table = (tmp_path / "results.md").read_text()
  assert "| method | mAUPRC | R@1 | R@2 | R@4 | R@8 |" in table and "| soprc |" in table
  # Every run has the loop's workdir: config, metrics.jsonl, TensorBoard, checkpoints, results.
  run_dir = tmp_path / "runs" / "synthetic" / "soprc" / "seed0"
  for name in ("config.json", "metrics.jsonl", "results.json", "tensorboard", "checkpoints"):
    assert (run_dir / name).exists(), name
  assert json.loads((run_dir / "results.json").read_text())["steps"] == config.train.num_steps
  # A second call reuses the finished runs instead of retraining.
  again = exp.run_experiment(config, tmp_path)
  assert again["tasks"]["synthetic"]["methods"]["soprc"]["mean"] == task["methods"]["soprc"]["mean"]


def _run_config(method="soprc", **train):
  c = configs.run_config(configs.get_config("runlocal"), "synthetic", method, 0)
  c.unlock()
  c.train.update(train)
  return c


def test_retrieval_run_resumed_mid_run_is_bit_identical(experiment, tmp_path, monkeypatch):
  # The uninterrupted run: the experiment's SOPRC run, of this same config (60 steps, logged every
  # 10, checkpointed every 20).
  config = _run_config()
  assert (config.train.num_steps, config.train.log_every, config.train.checkpoint_every) == (60, 10, 20)
  full_dir = experiment[2] / "runs" / "synthetic" / "soprc" / "seed0"
  assert json.loads((full_dir / "config.json").read_text()) == json.loads(config.to_json_best_effort())
  full = json.loads((full_dir / "results.json").read_text())

  build = retrieval.build

  def build_then_crash_at_step_55(cfg, mesh):  # an interruption after the checkpoint of step 40
    task = build(cfg, mesh)                   # and the log of step 50
    batches, calls = task.batches, [0]

    class Crashing:
      def __next__(self):
        calls[0] += 1
        if calls[0] > 55:
          raise KeyboardInterrupt("simulated kill")
        return next(batches)
      get_state, set_state = batches.get_state, batches.set_state
      stats = property(lambda self: batches.stats)

    task.batches = Crashing()
    return task

  monkeypatch.setattr(retrieval, "build", build_then_crash_at_step_55)
  with pytest.raises(KeyboardInterrupt):
    loop.train_and_evaluate(config, tmp_path / "resumed")
  assert not (tmp_path / "resumed" / "results.json").exists()
  monkeypatch.setattr(retrieval, "build", build)
  resumed = loop.train_and_evaluate(config, tmp_path / "resumed")
  assert resumed["state_fingerprint"] == full["state_fingerprint"]
  assert resumed["final"] == full["final"]
  rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == list(range(10, 61, 10))  # each step once (50 too)
  assert [r["step"] for r in rows if "eval/map" in r] == [60]  # train.eval_every=0: at the end
  assert json.loads((tmp_path / "resumed" / "results.json").read_text())["steps"] == 60


def test_step_compiles_once_and_rejects_a_retrace():
  config = _run_config()
  mesh = sharding.make_mesh((-1, 1))
  task = retrieval.build(config, mesh)
  state = task.state
  for i in range(3):
    state, _ = task.train_step(state, next(task.batches), jax.random.key(i))
  batch = next(task.batches)
  with pytest.raises(AssertionError, match="traced 2 times"):
    task.train_step(state, {k: v[:8] for k, v in batch.items()}, jax.random.key(0))


def test_nonfinite_step_keeps_the_last_good_state_and_is_counted():
  task = retrieval.build(_run_config(), sharding.make_mesh((-1, 1)))
  state, _ = task.train_step(task.state, next(task.batches), jax.random.key(0))
  good = jax.tree.map(np.asarray, (state.params, state.aux))
  batch = next(task.batches)
  bad, out = task.train_step(state, {**batch, "x": batch["x"] * jnp.nan}, jax.random.key(1))
  assert not np.isfinite(float(out["loss"]))
  assert int(bad.nonfinite_steps) == 1 and int(bad.first_nonfinite_step) == 2 and int(bad.step) == 2
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, (bad.params, bad.aux)), good)


@pytest.mark.parametrize("order", ["before_gradient", "after_gradient"])
def test_soprc_gradient_uses_the_aux_vector_of_the_paper_order(order):
  """Algorithm 1: v_{t+1} from the batch's scores at w_t, then the loss and gradient with
  v_{t+1}. The default must use v_{t+1}; "after_gradient" (the first experiment) v_t."""
  config = _run_config()
  config.auprc.soprc.aux_update = order
  mesh = sharding.make_mesh((-1, 1))
  task = retrieval.build(config, mesh)
  batch, state = next(task.batches), task.state
  a, m = config.auprc, config.auprc.samples_per_class
  tower = retrieval.EmbeddingTower(config.model.hidden, config.model.out)
  y_train = np.asarray(task.batches.batcher.y_train)
  prior, eps = auprc.class_priors(y_train, int(y_train.max()) + 1, 0.0)

  @jax.jit  # one program, not op-by-op dispatch (~6 s of small compiles under load)
  def reference(params, aux_t, x, labels):
    e = tower.apply(params, x)
    scores = e @ e.T
    values, mask = auprc.within_group_targets(scores, labels.shape[0] // m, m)
    aux_next = auprc.update_aux_vector(aux_t, labels[::m], values, mask, beta=a.soprc.beta,
                                       score_range=(-1.0, 1.0), init_from_first_batch=True)
    return aux_next, {v: auprc.batch_loss("soprc", a, scores, labels, aux, prior, eps, m - 1)
                      for v, aux in (("v_t", aux_t), ("v_t+1", aux_next))}

  aux_next, loss_with = reference(state.params, state.aux, batch["x"], batch["label"])
  loss_with = {v: float(loss) for v, loss in loss_with.items()}
  assert abs(loss_with["v_t"] - loss_with["v_t+1"]) > 1e-3  # the test can tell them apart
  aux_next_v = np.asarray(aux_next.v)
  new_state, out = task.train_step(state, batch, jax.random.key(0))
  used = "v_t+1" if order == "before_gradient" else "v_t"
  np.testing.assert_allclose(float(out["loss"]), loss_with[used], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(new_state.aux.v), aux_next_v, atol=1e-6)  # same v_{t+1}
  assert configs.get_config().auprc.soprc.aux_update == "before_gradient"  # the paper's, default


def test_retrieval_metrics_match_library_sklearn_and_brute_force():
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(60, 5)).astype(np.float32)
  labels = rng.integers(0, 6, 60)
  labels[0] = 99  # a query without any relevant item is skipped
  got = metrics.embedding_retrieval_metrics(emb, labels, ks=(1, 3))
  sims = emb @ emb.T
  aps, hits1, hits3 = [], [], []
  for q in range(1, 60):
    others = np.delete(np.arange(60), q)
    rel = labels[others] == labels[q]
    aps.append(average_precision_score(rel, sims[q, others]))
    top = others[np.argsort(-sims[q, others])]
    hits1.append(labels[top[0]] == labels[q])
    hits3.append(np.any(labels[top[:3]] == labels[q]))
  assert got["num_queries"] == 59
  np.testing.assert_allclose(got["map"], np.mean(aps), rtol=1e-6)
  off_diag = ~np.eye(60, dtype=bool)
  lib = metrics.mean_average_precision(sims[off_diag].reshape(60, 59),
                                       (labels[:, None] == labels[None, :])[off_diag].reshape(60, 59))
  np.testing.assert_allclose(got["map"], lib, rtol=1e-6)
  np.testing.assert_allclose([got["recall@1"], got["recall@3"]], [np.mean(hits1), np.mean(hits3)])


def test_aux_targets_are_the_within_group_off_diagonal_scores():
  g, m = 3, 4
  scores = np.arange((g * m) ** 2, dtype=np.float32).reshape(g * m, g * m)
  targets = jax.jit(auprc.within_group_targets, static_argnums=(1, 2))  # one program, not op by op
  values, mask = map(np.asarray, targets(scores, g, m))
  for k in range(g):
    block = scores[k * m:(k + 1) * m, k * m:(k + 1) * m]
    np.testing.assert_array_equal(values[k].reshape(m, m), block)
  np.testing.assert_array_equal(mask[0].reshape(m, m), ~np.eye(m, dtype=bool))


def test_soprc_batch_loss_finite_and_only_var_variant_adds_regulariser():
  config = configs.get_config("runlocal")
  rng = np.random.default_rng(1)
  emb = rng.normal(size=(16, 8))
  emb /= np.linalg.norm(emb, axis=1, keepdims=True)
  scores = (emb @ emb.T).astype(np.float32)
  labels = np.repeat(np.arange(4, dtype=np.int32), 4)
  prior, eps = auprc.class_priors(np.repeat(np.arange(4), [10, 20, 30, 40]), 4, 0.0)
  np.testing.assert_allclose(prior, np.array([9, 19, 29, 39]) / 99, rtol=1e-6)
  methods = auprc.METHODS

  @jax.jit  # one program (the aux vector's initialisation included), not op by op
  def all_losses(s):
    aux = auprc.init_aux_vector(4, 8, (-1.0, 1.0))
    return {m: auprc.batch_loss(m, config.auprc, s, labels, aux, prior, eps, 3) for m in methods}

  loss = {m: float(v) for m, v in all_losses(scores).items()}
  assert all(np.isfinite(v) for v in loss.values())
  assert loss["soprc"] == loss["soprc_sg"]  # same value, different gradient
  assert loss["soprc_sg_var"] > loss["soprc_sg"]
  assert loss["untrained"] == 0.0


def test_config_rejects_typos_and_unknown_choices(tmp_path):
  config = configs.get_config()
  with pytest.raises(AttributeError):
    config.train.num_step = 3  # locked: a typo fails loudly
  with pytest.raises(ValueError, match="allowed keys: runlocal"):
    configs.get_config("big")
  config = configs.get_config("runlocal")
  config.methods = ("soprc", "lambdaloss")
  with pytest.raises(ConfigError, match="auprc.method"):
    exp.run_experiment(config, tmp_path)
  assert not (tmp_path / "runs").exists()  # every run's config is checked before any trains
