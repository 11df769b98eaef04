"""Post-hoc logit adjustment (snm_jax/train/core/logit_adjust.py, recipes.choose_logit_adjust): the
evaluator's adjusted top-k equals a NumPy reference (z - tau log prior, then top-k; 1 and 8
devices), the prior is the Laplace-smoothed training frequency, tau is chosen on validation only,
the recipe records it and reuses it, and bad `recipe.logit_adjust` values are refused."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

from snm_jax import sharding
from snm_jax.train.config import validation
from snm_jax.train.core import logit_adjust
from snm_jax.train.recipes import recipe as recipes
from snm_jax.train.core.evaluate import Evaluator, label_bias_fn
from run_configs import tiny_synthetic_recipe

N, D, H, K, K_PAD = 24, 6, 5, 37, 40   # K not a multiple of the row block or the shard count


def test_log_label_prior_is_the_laplace_smoothed_training_frequency():
  labels = sp.csr_matrix(np.array([[1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], np.float32))
  # n_y = (3, 1, 1, 0) over N = 3 points: (n_y + 1) / (N + 2).
  np.testing.assert_allclose(logit_adjust.log_label_prior(labels),
                             np.log(np.array([4, 2, 2, 1]) / 5.0), rtol=1e-12)


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)])
@pytest.mark.parametrize("tau", [0.0, 0.7])
def test_adjusted_top_k_equals_the_numpy_reference(mesh_shape, tau):
  rng = np.random.default_rng(1)
  features = sp.csr_matrix(rng.normal(size=(N, D)).astype(np.float32))
  # Long-tailed training labels: label y on the first ~200 / (y + 1) of 200 points.
  counts = 200 // (np.arange(K) + 1)
  train_labels = sp.csc_matrix((np.ones(counts.sum(), np.float32), np.concatenate(
      [np.arange(c) for c in counts]), np.concatenate([[0], np.cumsum(counts)])), shape=(200, K))
  log_prior = logit_adjust.log_label_prior(train_labels)
  assert np.ptp(log_prior) > 2.0   # priors that differ enough to reorder labels
  w = rng.normal(size=(D, H)).astype(np.float32)
  table = rng.normal(size=(K_PAD, H)).astype(np.float32)

  def tower_apply(params, ids, vals):  # a linear map of the densified rows
    dense = jnp.zeros((ids.shape[0], D)).at[jnp.arange(ids.shape[0])[:, None], ids].add(vals)
    return dense @ params

  mesh = sharding.make_mesh(mesh_shape)
  bias_fn, extra_fn = label_bias_fn(-tau * log_prior)
  k = 6
  ev = Evaluator(tower_apply=tower_apply, features=features, labels=features[:, :1] != 0, mesh=mesh,
                 num_labels=K, k=k, query_chunk=16, row_block=8, normalize_classes=False, max_nnz=D,
                 max_labels=1, bias_fn=bias_fn, extra_fn=extra_fn)
  pred, _ = ev.predict(jnp.asarray(w), jax.device_put(table, sharding.named(mesh, sharding.TABLE)))
  z = (features.toarray().astype(np.float64) @ w) @ table[:K].astype(np.float64).T
  scores = z - tau * log_prior[None, :]
  ref = np.argsort(-scores, axis=1, kind="stable")[:, :k]
  assert pred.shape == (N, k) and (pred >= 0).all() and (pred < K).all()
  # Same labels in the same order (up to float32 near-ties: compare the reference scores).
  np.testing.assert_allclose(np.take_along_axis(scores, pred, 1), np.take_along_axis(scores, ref, 1),
                             rtol=0, atol=1e-4)
  if tau > 0:  # the adjustment changed the ranking (else the test would not test it)
    assert (np.argsort(-z, axis=1, kind="stable")[:, :k] != ref).any()


def _fake_run_data(num_labels=5):
  labels = sp.csr_matrix(np.array([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 1, 0, 0]], np.float32))
  return types.SimpleNamespace(train=types.SimpleNamespace(labels=labels[:, :num_labels]))


def test_tau_is_chosen_on_validation_and_only_the_chosen_tau_sees_test():
  config = tiny_synthetic_recipe()
  run_data = _fake_run_data()
  log_prior = logit_adjust.log_label_prior(run_data.train.labels)
  val_by_tau = {0.0: 0.60, 0.25: 0.63, 0.5: 0.65, 1.0: 0.65}   # 0.5 and 1 tie: the smaller wins
  calls = []

  def fake(names, split, label_bias, garbage=0.0):
    tau = float(np.round(label_bias[0] / -log_prior[0], 6))  # the tau the bias was made with
    np.testing.assert_allclose(label_bias, -tau * log_prior)
    calls.append((tuple(names), split, tau))
    if split == "test":
      return {"nDCG@5": garbage, "P@1": garbage}
    return {"nDCG@5": val_by_tau[tau], "P@1": 0.5, "recall@r": [0.0]}

  taus = logit_adjust.parse_grid("1,0.25,0.5")
  assert taus == (0.0, 0.25, 0.5, 1.0)
  rec = recipes.choose_logit_adjust(config, run_data, ["a", "b"], {}, None, taus, evaluate_fn=fake)
  assert rec["tau"] == 0.5 and [v["value"] for v in rec["validation"]] == [0.60, 0.63, 0.65, 0.65]
  assert rec["validation"][1]["metrics"] == {"nDCG@5": 0.63, "P@1": 0.5}
  # Every validation evaluation comes first; test is read once, at the chosen tau.
  assert [c[1] for c in calls] == ["validation"] * 4 + ["test"] and calls[-1] == (("a", "b"), "test", 0.5)
  # Whatever the test split holds, the choice is the same.
  rec2 = recipes.choose_logit_adjust(config, run_data, ["a", "b"], {}, None, taus,
                                     evaluate_fn=lambda n, s, b: fake(n, s, b, garbage=123.0))
  assert rec2["tau"] == rec["tau"] and rec2["test"]["P@1"] == 123.0
  # No tau beats the unadjusted model: tau = 0, test not evaluated here (the unadjusted result stands).
  val_by_tau.update({0.0: 0.70})
  calls.clear()
  rec3 = recipes.choose_logit_adjust(config, run_data, ["a"], {}, None, taus, evaluate_fn=fake)
  assert rec3["tau"] == 0.0 and "test" not in rec3 and all(c[1] == "validation" for c in calls)


def test_logit_adjust_grid_parsing():  # the bad values: test_config_validation.BAD
  validation.validate(tiny_synthetic_recipe(**{"recipe.logit_adjust": "", "recipe.ensemble": 1,
                                             "recipe.refit": True}))
  assert logit_adjust.parse_grid("") == (0.0,) and logit_adjust.parse_grid(" 0 , 2 ") == (0.0, 2.0)


def test_recipe_records_tau_and_reuses_it(tmp_path):
  # One candidate, no ensemble: the adjustment applies to the best candidate alone.
  c = tiny_synthetic_recipe(**{"recipe.search": "table.learning_rate*=1", "recipe.ensemble": 1,
                             "recipe.logit_adjust": "0.5,2"})
  res = recipes.run(c, tmp_path)
  rec, (cand,) = res["recipe"]["logit_adjust"], res["recipe"]["candidates"]
  assert rec["members"] == [cand["name"]] and rec["taus"] == [0.0, 0.5, 2.0]
  # tau = 0 through the bias path scores exactly the unadjusted candidate at its selected checkpoint.
  assert rec["validation"][0]["value"] == pytest.approx(cand["validation"], abs=1e-6)
  assert rec["tau"] == max(rec["validation"], key=lambda v: (v["value"], -v["tau"]))["tau"]
  unadjusted = json.loads((tmp_path / "candidates" / cand["name"] / "results.json").read_text())["final"]
  assert res["final"] == (rec["test"] if rec["tau"] > 0 else unadjusted)
  assert ("test" in rec) == (rec["tau"] > 0)
  assert json.loads((tmp_path / "results.json").read_text())["recipe"]["logit_adjust"] == rec
  before = (tmp_path / "logit_adjust.json").stat().st_mtime_ns
  again = recipes.run(c, tmp_path)
  assert again["recipe"]["logit_adjust"] == rec and again["final"] == res["final"]
  assert (tmp_path / "logit_adjust.json").stat().st_mtime_ns == before
