"""Ensembles of the recipe's candidates (snm_jax/train/recipes/ensemble.py, recipes.choose_ensemble): the
concatenated-query retrieval equals the sum of the members' score matrices (NumPy reference, 1 and
8 devices); m is chosen on validation only; the recipe records it; bad config values are refused."""

import json

import jax
import numpy as np
import pytest

from snm_jax import sharding
from snm_jax.mining.retrieval import make_top_k_retrieval
from snm_jax.train.config import validation
from snm_jax.train.recipes import recipe as recipes
from snm_jax.train.recipes.ensemble import Member, make_ensemble
from run_configs import tiny_synthetic_recipe

NUM_LABELS, K_PAD, D, N = 203, 208, 9, 16   # K not a multiple of the row block or shard count


def _members(mesh, rng):
  """Three linear 'towers' x @ W_i of widths 4, 6, 5; the second normalises its classes and has
  logit scale 20 (as an SNM tower), the third scale 0.5."""
  out, ref = [], []
  for h, scale, normalize in ((4, 1.0, False), (6, 20.0, True), (5, 0.5, False)):
    w = rng.normal(size=(D, h)).astype(np.float32)
    table = rng.normal(size=(K_PAD, h)).astype(np.float32)
    out.append(Member(tower_apply=lambda p, x: x @ p, params=jax.numpy.asarray(w),
                      table=jax.device_put(table, sharding.named(mesh, jax.P(sharding.MODEL, None))),
                      scale=scale, normalize=normalize))
    ref.append((w.astype(np.float64), table.astype(np.float64), scale, normalize))
  return out, ref


def _reference_scores(x, ref):
  """sum_i s_i (x W_i) . rows_i (rows L2-normalised where the member normalises), float64 (n, K)."""
  total = 0.0
  for w, table, scale, normalize in ref:
    rows = table[:NUM_LABELS]
    if normalize:
      rows = rows / np.sqrt((rows ** 2).sum(1, keepdims=True) + 1e-12)
    total = total + scale * (x.astype(np.float64) @ w) @ rows.T
  return total


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)])
def test_concatenated_queries_score_the_sum_of_the_members_logits(mesh_shape):
  mesh = sharding.make_mesh(mesh_shape)
  rng = np.random.default_rng(0)
  members, ref = _members(mesh, rng)
  x = rng.normal(size=(N, D)).astype(np.float32)
  tower_apply, state = make_ensemble(members)
  q = jax.jit(tower_apply)(state.tower_params(), jax.device_put(x, sharding.named(mesh, jax.P(sharding.DATA))))
  assert q.shape == (N, 15) and state.table.shape == (K_PAD, 15)
  s_ref = _reference_scores(x, ref)
  # The whole score matrix ...
  np.testing.assert_allclose(np.asarray(q) @ np.asarray(state.table)[:NUM_LABELS].T, s_ref,
                             rtol=1e-4, atol=1e-4)
  # ... and the library's sharded chunked top-k over it (row blocks of 12: partial last blocks).
  k = 7
  vals, ids = make_top_k_retrieval(mesh, k=k, num_labels=NUM_LABELS, row_block=12,
                                   normalize_classes=False)(q, state.table)
  vals, ids = np.asarray(vals), np.asarray(ids)
  ref_vals = -np.sort(-s_ref, axis=1)[:, :k]
  assert (ids >= 0).all() and (ids < NUM_LABELS).all() and all(len(set(r)) == k for r in ids)
  np.testing.assert_allclose(np.take_along_axis(s_ref, ids, 1), ref_vals, rtol=0, atol=1e-4)
  np.testing.assert_allclose(vals, ref_vals, rtol=1e-5, atol=1e-4)


def test_members_need_equal_table_rows():
  a = Member(tower_apply=lambda p, x: x, params=None, table=jax.numpy.zeros((8, 2)))
  b = Member(tower_apply=lambda p, x: x, params=None, table=jax.numpy.zeros((16, 2)))
  with pytest.raises(ValueError, match="rows"):
    make_ensemble([a, b])


def _table(values):
  return [{"name": f"c{i}", "validation": v} for i, v in enumerate(values)]


def test_m_is_chosen_on_validation_and_only_the_chosen_ensemble_sees_test():
  config = tiny_synthetic_recipe()
  table = _table([0.50, 0.70, 0.60, 0.65])          # order by validation: c1, c3, c2, c0
  val_by_m = {1: 0.70, 2: 0.74, 3: 0.74, 4: 0.72}   # m = 2 and 3 tie: the smaller wins
  calls = []

  def fake(names, split, garbage=0.0):
    calls.append((tuple(names), split))
    if split == "test":
      return {"nDCG@5": garbage, "P@1": garbage}
    return {"nDCG@5": val_by_m[len(names)], "P@1": 0.1 * len(names), "recall@r": [0.0]}

  rec = recipes.choose_ensemble(config, None, table, {}, None, 4, evaluate_fn=fake)
  assert rec["order"] == ["c1", "c3", "c2", "c0"]
  assert [v["m"] for v in rec["validation"]] == [1, 2, 3, 4]
  assert [v["value"] for v in rec["validation"]] == [0.70, 0.74, 0.74, 0.72]
  assert rec["validation"][2]["metrics"] == {"nDCG@5": 0.74, "P@1": pytest.approx(0.3)}
  assert rec["m"] == 2 and rec["members"] == ["c1", "c3"]
  # Every validation evaluation comes first; test is read once, for the chosen members only.
  assert [s for _, s in calls] == ["validation"] * 4 + ["test"]
  assert calls[-1] == (("c1", "c3"), "test") and rec["test"] == {"nDCG@5": 0.0, "P@1": 0.0}
  # Whatever the test split holds, the choice is the same.
  calls.clear()
  rec2 = recipes.choose_ensemble(config, None, table, {}, None, 4,
                                 evaluate_fn=lambda n, s: fake(n, s, garbage=123.0))
  assert (rec2["m"], rec2["members"]) == (rec["m"], rec["members"]) and rec2["test"]["P@1"] == 123.0
  # No ensemble beats the best candidate: m = 1, test not evaluated here (the candidate's stands).
  val_by_m.update({2: 0.69, 3: 0.70, 4: 0.1})
  calls.clear()
  rec3 = recipes.choose_ensemble(config, None, table, {}, None, 3, evaluate_fn=fake)
  assert rec3["m"] == 1 and "test" not in rec3 and all(s == "validation" for _, s in calls)
  assert len(calls) == 3  # max_members = 3: m = 1..3


def test_ensemble_size_clips_and_zero_means_every_candidate():
  c = tiny_synthetic_recipe(**{"recipe.ensemble": 0})
  assert recipes.ensemble_size(c, 6) == 6
  c = tiny_synthetic_recipe(**{"recipe.ensemble": 3})
  assert recipes.ensemble_size(c, 6) == 3 and recipes.ensemble_size(c, 2) == 2
  assert recipes.ensemble_size(tiny_synthetic_recipe(**{"recipe.ensemble": 1}), 6) == 1


def test_an_ensemble_of_one_may_be_refit():  # the bad values: test_config_validation.BAD
  validation.validate(tiny_synthetic_recipe(**{"recipe.ensemble": 1, "recipe.refit": True}))


def test_recipe_with_ensemble_records_m_and_members_and_resumes(tmp_path):
  c = tiny_synthetic_recipe(**{"recipe.search": "table.learning_rate*=0.5,1",
                             "recipe.ensemble": 0, "recipe.drop_behind_z": 0.0})  # both to the end
  res = recipes.run(c, tmp_path)
  rec = res["recipe"]["ensemble"]
  table = res["recipe"]["candidates"]
  assert rec["max_members"] == 2 and rec["order"] == recipes.ensemble_order(table)
  assert rec["order"][0] == res["recipe"]["chosen"]
  # m = 1 is the best candidate at its selected checkpoint: the same validation value it was chosen by.
  best = max(t["validation"] for t in table)
  assert rec["validation"][0]["value"] == pytest.approx(best, abs=1e-6)
  assert rec["m"] == max(rec["validation"], key=lambda v: (v["value"], -v["m"]))["m"]
  assert rec["members"] == rec["order"][:rec["m"]]
  chosen = json.loads((tmp_path / "candidates" / rec["order"][0] / "results.json").read_text())
  assert res["final"] == (rec["test"] if rec["m"] > 1 else chosen["final"])
  assert json.loads((tmp_path / "results.json").read_text())["recipe"]["ensemble"] == rec
  # The ensemble record is reused on a rerun (like the candidates).
  before = (tmp_path / "ensemble.json").stat().st_mtime_ns
  again = recipes.run(c, tmp_path)
  assert again["recipe"]["ensemble"] == rec
  assert (tmp_path / "ensemble.json").stat().st_mtime_ns == before
