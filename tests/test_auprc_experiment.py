"""The SOPRC retrieval experiment: runlocal end to end, metrics, batch plumbing."""
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
from snm_jax.errors import ConfigError


def test_runlocal_trains_soprc_above_untrained_and_writes_tables(tmp_path):
  config = configs.get_config("runlocal")
  results = exp.train_and_evaluate(config, tmp_path)
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
  # A second call resumes from the per-run files instead of retraining.
  again = exp.train_and_evaluate(config, tmp_path)
  assert again["tasks"]["synthetic"]["methods"]["soprc"]["mean"] == task["methods"]["soprc"]["mean"]


def test_retrieval_metrics_match_library_sklearn_and_brute_force():
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(60, 5)).astype(np.float32)
  labels = rng.integers(0, 6, 60)
  labels[0] = 99  # a query without any relevant item is skipped
  got = exp.retrieval_metrics(emb, labels, ks=(1, 3))
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
  values, mask = exp._aux_targets(jnp.asarray(scores), g, m)
  for k in range(g):
    block = scores[k * m:(k + 1) * m, k * m:(k + 1) * m]
    np.testing.assert_array_equal(np.asarray(values[k]).reshape(m, m), block)
  np.testing.assert_array_equal(np.asarray(mask[0]).reshape(m, m), ~np.eye(m, dtype=bool))


def test_soprc_batch_loss_finite_and_only_var_variant_adds_regulariser():
  config = configs.get_config("runlocal")
  rng = np.random.default_rng(1)
  emb = rng.normal(size=(16, 8))
  emb /= np.linalg.norm(emb, axis=1, keepdims=True)
  scores = jnp.asarray(emb @ emb.T, jnp.float32)
  labels = jnp.repeat(jnp.arange(4), 4)
  aux = auprc.init_aux_vector(4, 8, (-1.0, 1.0))
  prior, eps = exp.class_priors(np.repeat(np.arange(4), [10, 20, 30, 40]), 4, 0.0)
  np.testing.assert_allclose(prior, np.array([9, 19, 29, 39]) / 99, rtol=1e-6)
  methods = ("soprc", "soprc_sg", "soprc_sg_var", "ap_loss", "smooth_ap", "triplet",
             "contrastive")
  all_losses = jax.jit(lambda s: {m: exp.batch_loss(m, config, s, labels, aux, prior, eps, 3)
                                  for m in methods})
  loss = {m: float(v) for m, v in all_losses(scores).items()}
  assert all(np.isfinite(v) for v in loss.values())
  assert loss["soprc"] == loss["soprc_sg"]  # same value, different gradient
  assert loss["soprc_sg_var"] > loss["soprc_sg"]


def test_config_rejects_typos_and_unknown_choices(tmp_path):
  config = configs.get_config()
  with pytest.raises(AttributeError):
    config.train.num_step = 3  # locked: a typo fails loudly
  with pytest.raises(ValueError, match="variant"):
    configs.get_config("big")
  config = configs.get_config("runlocal")
  config.methods = ("soprc", "lambdaloss")
  with pytest.raises(ConfigError, match="methods"):
    exp.train_and_evaluate(config, tmp_path)
