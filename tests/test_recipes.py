"""The xmc recipe: settings derived from data statistics, candidates chosen on validation only."""

import json
from unittest import mock

import pytest

from experiments.configs import xmc
from snm_jax.errors import ConfigError
from snm_jax.train.recipes import recipe as recipes
from snm_jax.train.recipes.recipe import DataStats
from run_configs import tiny_synthetic_recipe


def stats(**kw):
  base = dict(num_train=11628, num_features=500, num_labels=983, labels_per_point=19.0,
              nnz_per_point=18.5)
  return DataStats(**{**base, **kw})


def test_derive_fills_only_auto_fields_from_the_statistics():
  c = xmc.get_config("delicious")
  d = recipes.derive(c, stats())
  assert d["model.kind"] == "linear" and d["model.bag_matmul"] == "dense"
  assert d["loss.kind"] == "full_softmax" and d["mining.sampler"] == "full"
  assert d["mining.num_samples"] == 984  # K rounded up to the 8 strata
  assert d["train.batch_size"] == 512
  assert d["train.num_steps"] == round(80 * 11628 / 512)
  assert d["train.eval_every"] == d["train.num_steps"] // 20
  assert d["table.learning_rate"] == pytest.approx(0.16 * 512)
  # An explicit value is kept as given.
  c.unlock()
  c.train.batch_size = 128
  c.model.kind = "snm_tower"
  d = recipes.derive(c, stats())
  assert "train.batch_size" not in d and "model.kind" not in d
  assert d["table.learning_rate"] == pytest.approx(0.004 * 128)
  assert d["loss.logit_scale"] == 20.0
  assert (d["model.hidden"], d["model.out"], d["model.dropout"]) == (1024, 512, 0.5)
  # The linear model's settings for its kind; an explicit tower setting is kept.
  c.model.dropout = 0.2
  d = recipes.derive(c, stats())
  assert "model.dropout" not in d and d["model.hidden"] == 1024
  assert recipes.kind_settings(c, "wide_deep") == {"model.hidden": 256, "model.out": 128,
                                                   "loss.logit_scale": 1.0}


def test_derive_scales_to_large_outputs_and_small_data():
  c = xmc.get_config("x")
  big = recipes.derive(c, stats(num_labels=670_091, num_features=135_909, num_train=490_449))
  assert big["model.kind"] == "snm_tower" and big["model.bag_matmul"] == "gather"
  assert big["loss.kind"] == "sampled_softmax" and big["mining.num_samples"] == 8192
  assert big["train.num_steps"] == 4000  # clipped to recipe.max_steps
  small = recipes.derive(c, stats(num_train=700))
  assert small["train.batch_size"] == 64 and small["train.num_steps"] == 875
  assert recipes.search_spec(c, stats()) == "model.kind=linear,wide_deep;table.learning_rate*=0.5,1,2"
  assert recipes.search_spec(c, stats(num_labels=670_091, num_features=135_909)) == (
      "table.learning_rate*=0.5,1,2")


def test_search_grid_multiplies_and_sets():
  grid = recipes.parse_search("table.learning_rate*=0.5,2;model.kind=linear,wide_deep")
  assert grid == {"table.learning_rate": ("*=", [0.5, 2]), "model.kind": ("=", ["linear", "wide_deep"])}
  points = recipes.candidates({"table.learning_rate": 10.0, "model.kind": "auto"}, grid)
  assert [name for name, _ in points] == [
      "learning_rate_x0.5-kind_linear", "learning_rate_x0.5-kind_wide_deep",
      "learning_rate_x2-kind_linear", "learning_rate_x2-kind_wide_deep"]
  assert points[3][1] == {"table.learning_rate": 20.0, "model.kind": "wide_deep"}
  with pytest.raises(ConfigError, match="recipe.search"):
    recipes.parse_search("table.learning_rate")


def test_recipe_chooses_the_best_validation_candidate_and_resumes(tmp_path):
  # One learning rate that barely learns, one that does; both trained to the end (no paired test,
  # which would stop the first at its rung: test_candidate_group).
  c = tiny_synthetic_recipe(1500, 300, **{"recipe.search": "table.learning_rate*=0.01,1",
                                          "recipe.drop_behind_z": 0.0})
  res = recipes.run(c, tmp_path)
  table = res["recipe"]["candidates"]
  assert [t["name"] for t in table] == ["learning_rate_x0.01", "learning_rate_x1"]
  best = max(table, key=lambda t: t["validation"])
  assert res["recipe"]["chosen"] == best["name"] == "learning_rate_x1"
  chosen = json.loads((tmp_path / "candidates" / best["name"] / "results.json").read_text())
  assert res["final"] == chosen["final"]
  assert json.loads((tmp_path / "results.json").read_text())["recipe"]["chosen"] == best["name"]
  # Finished candidates are reused, not retrained.
  before = (tmp_path / "candidates" / best["name"] / "results.json").stat().st_mtime_ns
  again = recipes.run(c, tmp_path)
  assert again["final"] == res["final"]
  assert (tmp_path / "candidates" / best["name"] / "results.json").stat().st_mtime_ns == before


def test_recipe_needs_a_validation_split(tmp_path):
  c = xmc.get_config("synthetic,runlocal")
  c.unlock()
  c.dataset.validation_fraction = 0.0
  with pytest.raises(ConfigError, match="dataset.validation_fraction"):
    recipes.run(c, tmp_path)


def test_the_shipped_auto_search_runs_both_models(tmp_path):
  # What xmc.py ships: linear and wide_deep x learning rate {0.5, 1, 2} (the grid's seven points are
  # checked without training in test_one_vs_rest_candidates_join_the_auto_search_for_small_k; here
  # one wide_deep point stands for the six, to keep the suite short) and the one-vs-rest linear
  # candidate (K = 64), which trains with its squared-hinge BOWL over every label.
  # Both train to the end (no paired stop rule: either may trail at a rung of these 10 steps).
  c = tiny_synthetic_recipe(**{"recipe.search": "auto", "recipe.min_steps": 10, "recipe.max_steps": 10,
                               "recipe.drop_behind_z": 0.0})
  with mock.patch.object(recipes, "search_spec", return_value="model.kind=wide_deep"):
    res = recipes.run(c, tmp_path)
  names = [t["name"] for t in res["recipe"]["candidates"]]
  assert names == ["kind_wide_deep", "ovr_pairs"]
  ovr = json.loads((tmp_path / "candidates" / "ovr_pairs" / "config.json").read_text())
  assert (ovr["loss"]["kind"], ovr["loss"]["phi"], ovr["mining"]["sampler"]) == ("bowl", "squared_hinge", "full")
  assert ovr["mining"]["num_samples"] == 64 and ovr["model"]["kind"] == "linear"
  assert ovr["dataset"]["conversion"] == "expand_all_positives"  # the softmax candidates' stays
  soft = json.loads((tmp_path / "candidates" / names[0] / "config.json").read_text())
  assert soft["dataset"]["conversion"] == "sample_one_positive"
  assert res["recipe"]["derived"]["model.bag_matmul"] == "dense"


def test_refit_retrains_the_chosen_candidate_on_the_whole_training_file(tmp_path):
  c = tiny_synthetic_recipe(**{"recipe.search": "table.learning_rate*=1", "recipe.refit": True})
  res = recipes.run(c, tmp_path)
  cand = json.loads((tmp_path / "candidates" / "learning_rate_x1" / "results.json").read_text())
  refit_cfg = json.loads((tmp_path / "refit" / "config.json").read_text())
  assert refit_cfg["dataset"]["validation_fraction"] == 0.0
  assert res["steps"] == refit_cfg["train"]["num_steps"] == cand["selected"]["step"]
  assert res["recipe"]["refit"]["candidate_final"] == cand["final"]
  assert res["final"] == json.loads((tmp_path / "refit" / "results.json").read_text())["final"]
  assert json.loads((tmp_path / "results.json").read_text())["final"] == res["final"]


BIBTEX_LIKE = dict(num_train=3953, num_features=1836, num_labels=159, labels_per_point=2.38,
                   nnz_per_point=69.1)


def test_one_vs_rest_candidates_join_the_auto_search_for_small_k():
  c = xmc.get_config("bibtex")
  st = stats(**BIBTEX_LIKE)
  points = recipes.candidate_list(c, st, recipes.derive(c, st))
  names = [n for n, _, _ in points]
  assert names[:6] == [f"kind_{m}-learning_rate_x{x}" for m in ("linear", "wide_deep") for x in (0.5, 1, 2)]
  assert names[6:] == ["ovr_pairs"]
  for (_, _, soft), x in zip(points[:3], (0.5, 1, 2)):
    assert soft["loss.kind"] == "full_softmax" and "mining.k" not in soft
    assert soft["table.learning_rate"] == pytest.approx(0.16 * 256 * x)
  _, over, f = points[6]
  assert over == {k: f[k] for k in over}  # the record names every loss field it sets
  assert (f["loss.kind"], f["loss.phi"], f["mining.sampler"]) == ("bowl", "squared_hinge", "full")
  assert (f["mining.vartheta"], f["mining.vartheta_norm"]) == ("negative_sampling", "expectation")
  assert f["mining.k"] == 2 and f["mining.num_samples"] == 160  # round(2.38); K up to the 8 strata
  assert f["model.kind"] == "linear" and f["loss.logit_scale"] == 1.0
  assert f["table.learning_rate"] == pytest.approx(5.12)  # not scaled with the batch
  assert f["dataset.conversion"] == "expand_all_positives" and "table.weight_decay" not in f
  # A grid of its own is named per point.
  with mock.patch.object(recipes, "OVR_SEARCH", "table.learning_rate*=0.5,1"):
    ovr = recipes.candidate_list(c, st, recipes.derive(c, st))[6:]
  assert [n for n, _, _ in ovr] == ["ovr_pairs-learning_rate_x0.5", "ovr_pairs-learning_rate_x1"]
  assert ovr[0][2]["table.learning_rate"] == pytest.approx(2.56)
  # Delicious-like: k = round(19.06).
  st = stats(labels_per_point=19.06)
  ovr = recipes.ovr_settings(c, st, recipes.derive(c, st))
  assert ovr["mining.k"] == 19 and ovr["table.learning_rate"] == pytest.approx(5.12)


@pytest.mark.parametrize("case", ["large_k", "explicit_loss", "explicit_search", "snm_tower"])
def test_no_one_vs_rest_candidates_outside_their_range(case):
  c = xmc.get_config("bibtex")
  st = stats(**BIBTEX_LIKE)
  c.unlock()
  if case == "large_k":  # beyond exact scoring of every label (and the linear table)
    st = stats(num_labels=670_091, num_features=135_909, num_train=490_449)
  elif case == "explicit_loss":
    c.loss.kind = "full_softmax"
    c.mining.sampler = "full"
  elif case == "explicit_search":
    c.recipe.search = "table.learning_rate*=1"
  else:
    c.model.kind = "snm_tower"
  c.lock()
  derived = recipes.derive(c, st)
  assert recipes.ovr_settings(c, st, derived) is None
  assert not any(n.startswith(recipes.OVR_NAME) for n, _, _ in recipes.candidate_list(c, st, derived))


def test_one_vs_rest_candidate_builds_the_squared_hinge_ovr_loss():
  """The candidate's config builds BOWL with a constant vartheta = (K-1)/(k B): against a NumPy
  one-vs-rest reference sq_hinge(v_y) + (K-1)/(k B) sum_{j not in Y} sq_hinge(-v_j)."""
  import jax
  import numpy as np
  from snm_jax.losses import registry
  from snm_jax.train.config import builders, validation
  from snm_jax.train.config.overrides import with_overrides

  c = xmc.get_config("bibtex")
  st = stats(**BIBTEX_LIKE)
  fields = dict(recipes.candidate_list(c, st, recipes.derive(c, st))[6][2])
  cand = with_overrides(c, {**fields, "recipe.name": ""})
  validation.validate(cand, num_labels=st.num_labels)
  spec = builders.make_loss_spec(cand, st.num_labels)
  num_k, b, k = st.num_labels, fields["mining.num_samples"], fields["mining.k"]
  assert spec.head_minus_tail == () and spec.tail == pytest.approx((num_k - 1) / (k * b))
  rng = np.random.default_rng(0)
  n = 4
  scores = rng.normal(size=(n, b)).astype(np.float32) * 1.5
  label_sets = [rng.choice(num_k, size=m, replace=False) for m in (1, 2, 3, 5)]
  pos = np.array([scores[i, s[0]] for i, s in enumerate(label_sets)], np.float32)
  valid = np.broadcast_to(np.arange(b) < num_k, (n, b)).copy()  # the padding labels are no negatives
  for i, s in enumerate(label_sets):
    valid[i, s] = False
  # Jitted as the step runs it: one compile, not one per eager op.
  loss = jax.jit(lambda *a: registry.get_loss("bowl")(*a, spec=spec, num_samples=b, axis_name=None,
                                                      score_at=None)[0])(
      pos, scores, valid, np.zeros_like(scores), np.zeros(n))
  sq = lambda u: np.maximum(1.0 - u, 0.0) ** 2
  want = sq(pos) + (num_k - 1) / (k * b) * np.where(valid, sq(-scores), 0.0).sum(-1)
  np.testing.assert_allclose(np.asarray(loss), want, rtol=1e-5)


def test_one_vs_rest_pairs_weigh_every_positive_once():
  """Summed over a point's examples, expand_all_positives gives LinearSVC's per-label weighting of
  the positives, sum_{y in Y} sq_hinge(v_y) + |Y| c sum_{j not in Y} sq_hinge(-v_j), c = (K-1)/(kB)
  (one drawn positive per point weighs each 1/|Y| instead: recipes.OVR_LOSS_SETTINGS)."""
  import jax
  import numpy as np
  import scipy.sparse as sp
  from snm_jax.data import conversions
  from snm_jax.losses import registry
  from snm_jax.train.config import builders
  from snm_jax.train.config.overrides import with_overrides

  c = xmc.get_config("bibtex")
  st = stats(**BIBTEX_LIKE)
  num_k, b = st.num_labels, 160
  rng = np.random.default_rng(1)
  label_sets = [np.sort(rng.choice(num_k, size=m, replace=False)) for m in (1, 3, 6)]
  labels = sp.csr_matrix((np.ones(10), np.concatenate(label_sets), [0, 1, 4, 10]), shape=(3, num_k))
  scores = (rng.normal(size=(3, b)) * 1.5).astype(np.float32)
  negative = np.broadcast_to(np.arange(b) < num_k, (3, b)).copy()
  for i, s in enumerate(label_sets):
    negative[i, s] = False
  sq = lambda u: np.maximum(1.0 - u, 0.0) ** 2
  neg_sum = np.where(negative, sq(-scores), 0.0).sum(-1)
  pos_sum = np.array([sq(scores[i, s]).sum() for i, s in enumerate(label_sets)])
  sizes = np.array([len(s) for s in label_sets])

  def per_point(name, rows, pos_ids):
    fields = dict(next(f for n, _, f in recipes.candidate_list(c, st, recipes.derive(c, st)) if n == name))
    cand = with_overrides(c, {**fields, "recipe.name": ""})
    spec = builders.make_loss_spec(cand, num_k)
    pos = scores[rows, pos_ids]
    loss = jax.jit(lambda *a: registry.get_loss("bowl")(*a, spec=spec, num_samples=b, axis_name=None,
                                                        score_at=None)[0])(  # one compile, as the step
        pos, scores[rows], negative[rows], np.zeros((len(rows), b)), np.zeros(len(rows)))
    return np.bincount(rows, np.asarray(loss, np.float64), minlength=3), spec.tail

  got, cneg = per_point("ovr_pairs", *conversions.expand_all_positives(labels))
  assert cneg == pytest.approx((num_k - 1) / (2 * b))
  np.testing.assert_allclose(got, pos_sum + sizes * cneg * neg_sum, rtol=1e-5)


def test_a_diverged_candidate_is_left_out_not_fatal(tmp_path):
  # The one-vs-rest loss (squared hinge over every label) at a step far past stable diverges.
  ovr = {**recipes.OVR_LOSS_SETTINGS, "mining.k": 1, "mining.num_samples": 64,
         "recipe.search": "table.learning_rate*=0.01,1e5", "recipe.ensemble": 2}
  c = tiny_synthetic_recipe(**ovr)
  res = recipes.run(c, tmp_path)
  assert [t["name"] for t in res["recipe"]["candidates"]] == ["learning_rate_x0.01"]
  assert [d["name"] for d in res["recipe"]["diverged"]] == ["learning_rate_x100000.0"]
  assert "non-finite" in res["recipe"]["diverged"][0]["error"]
  assert res["recipe"]["chosen"] == "learning_rate_x0.01" and "ensemble" not in res["recipe"]
  assert (tmp_path / "candidates" / "learning_rate_x100000.0" / "diverged.json").exists()
  again = recipes.run(c, tmp_path)  # read back, not retrained
  assert again["recipe"]["diverged"] == res["recipe"]["diverged"] and again["final"] == res["final"]


def test_the_full_sampler_takes_the_ordered_weighted_losses_only_besides_full_softmax():
  from snm_jax.train.config import validation
  from snm_jax.train.config.overrides import with_overrides
  c = xmc.get_config("bibtex")
  st = stats(**BIBTEX_LIKE)
  fields = dict(recipes.candidate_list(c, st, recipes.derive(c, st))[6][2])
  for kind in ("sampled_softmax", "logistic_ns", "nce"):
    bad = with_overrides(c, {**fields, "recipe.name": "", "loss.kind": kind})
    with pytest.raises(ConfigError, match="mining.sampler.*full_softmax, bowl or powl"):
      validation.validate(bad, num_labels=st.num_labels)
  validation.validate(with_overrides(c, {**fields, "recipe.name": "", "loss.kind": "powl"}),
                    num_labels=st.num_labels)


def test_the_number_of_validation_splits_follows_the_validation_size():
  c = xmc.get_config("bibtex")
  assert (c.recipe.splits, c.recipe.min_validation) == (-1, 1000)  # shipped: from the validation size
  assert xmc.get_config("bibtex,runlocal").recipe.splits == 1
  c.unlock()
  # ceil(1000 / M) while M < 1000, at most MAX_SPLITS; 1 from M = 1000 on.
  assert recipes.num_splits(c, 488) == 3   # Bibtex: 10% of 4,880
  assert recipes.num_splits(c, 439) == 3   # its 90/10 carve
  assert recipes.num_splits(c, 500) == 2 and recipes.num_splits(c, 999) == 2
  assert recipes.num_splits(c, 1000) == 1 and recipes.num_splits(c, 1292) == 1  # Delicious
  assert recipes.num_splits(c, 50) == recipes.MAX_SPLITS == 5
  c.recipe.splits = 2  # explicit: as given
  assert recipes.num_splits(c, 1292) == 2
  assert recipes.split_fields(c, 0) == {"dataset.validation_seed": c.dataset.validation_seed}
  assert recipes.split_fields(c, 2) == {"dataset.validation_seed": c.dataset.validation_seed + 2}


@pytest.mark.parametrize("field,value", [("recipe.splits", 0), ("recipe.splits", -2),
                                         ("recipe.min_validation", -1)])
def test_bad_split_fields_are_refused(field, value):
  from snm_jax.train.config import validation
  c = tiny_synthetic_recipe(**{field: value})
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    validation.validate(c)


def test_several_splits_choose_on_the_mean_and_score_every_splits_models(tmp_path):
  from snm_jax.train.trainer.run_data import load_run_data
  from snm_jax.train.config.overrides import with_overrides
  c = tiny_synthetic_recipe(1000, 100, **{"recipe.search": "table.learning_rate*=0.01,1",
                                          "recipe.splits": 2, "recipe.ensemble": 2,
                                          "recipe.split_search": "all"})
  # The two splits hold out as many points, not the same ones, from the same training file.
  parts = [load_run_data(with_overrides(c, recipes.split_fields(c, i))) for i in range(2)]
  assert parts[0].validation.num_points == parts[1].validation.num_points == 100
  v0, v1 = (p.validation.features.toarray() for p in parts)
  assert not (v0 == v1).all()
  res = recipes.run(c, tmp_path)
  rec = res["recipe"]
  assert rec["splits"] == 2
  for row in rec["candidates"]:
    runs = [json.loads((recipes.split_dir(tmp_path, i) / "candidates" / row["name"] / "results.json")
                       .read_text()) for i in range(2)]
    cfgs = [json.loads((recipes.split_dir(tmp_path, i) / "candidates" / row["name"] / "config.json")
                       .read_text()) for i in range(2)]
    assert [g["dataset"]["validation_seed"] for g in cfgs] == [0, 1]
    values = [r["selected"]["value"] for r in runs]
    assert [s["validation"] for s in row["splits"]] == values
    assert row["validation"] == pytest.approx(sum(values) / 2)  # the choice reads the mean
  best = max(rec["candidates"], key=lambda t: t["validation"])
  assert rec["chosen"] == best["name"] == rec["ensemble"]["order"][0]
  # m = 1 on validation: each split's model of the best candidate on its own held-out part, averaged
  # -- the mean of the values its runs selected their checkpoints on.
  assert rec["ensemble"]["validation"][0]["value"] == pytest.approx(best["validation"], abs=1e-5)
  # The result sums every split's models, so even m = 1 is scored on test.
  assert res["final"] == rec["ensemble"]["test"]
  assert (tmp_path / "splits" / "1" / "candidates" / best["name"] / "results.json").exists()


def test_with_several_splits_even_one_member_is_scored_on_test():
  # The result sums every split's models of its members, so m = 1 is no longer a candidate's own run.
  c = tiny_synthetic_recipe()
  table = [{"name": "a", "validation": 0.6}, {"name": "b", "validation": 0.5}]
  calls = []

  def fake(names, split):
    calls.append((tuple(names), split))
    return {"nDCG@5": 0.6 if len(names) == 1 else 0.55}

  rec = recipes.choose_ensemble(c, [None, None], table, {}, None, 2, evaluate_fn=fake)
  assert rec["splits"] == 2 and rec["m"] == 1 and rec["members"] == ["a"]
  assert calls == [(("a",), "validation"), (("a", "b"), "validation"), (("a",), "test")]
  calls.clear()
  one = recipes.choose_ensemble(c, None, table, {}, None, 2, evaluate_fn=fake)  # one split
  assert one["splits"] == 1 and "test" not in one and all(s == "validation" for _, s in calls)
