"""The xmc recipe: settings derived from data statistics, candidates chosen on validation only."""

import json

import pytest

from experiments.configs import xmc
from snm_jax.errors import ConfigError
from snm_jax.train import recipes
from snm_jax.train.recipes import DataStats
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
  # One learning rate that barely learns, one that does.
  c = tiny_synthetic_recipe(1500, 300, **{"recipe.search": "table.learning_rate*=0.01,1"})
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
  # What xmc.py ships: linear and wide_deep x learning rate {0.5, 1, 2}.
  c = tiny_synthetic_recipe(**{"recipe.search": "auto", "recipe.min_steps": 10, "recipe.max_steps": 10})
  res = recipes.run(c, tmp_path)
  names = [t["name"] for t in res["recipe"]["candidates"]]
  assert len(names) == 6 and sum("wide_deep" in n for n in names) == 3
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
