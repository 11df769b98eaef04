"""recipe.split_search="first": candidates chosen on one validation split, only the chosen trained on
the others, and the same result as the search over every split when it chooses the same members."""

import json

import pytest

from snm_jax.errors import ConfigError
from snm_jax.train.config import validation
from snm_jax.train.recipes import recipe as recipes
from run_configs import tiny_synthetic_recipe

# Two candidates whose validation values are far apart (a 100x smaller learning rate barely trains),
# so both searches choose the same one and their results can be compared.
FIELDS = {"recipe.search": "table.learning_rate*=0.01,1", "recipe.splits": 2, "recipe.ensemble": 2,
          "recipe.halving": 0}


def _trained(workdir) -> set:
  return {(p.parent.parent.parent.name if p.parent.parent.parent != workdir else "0", p.parent.name)
          for p in workdir.rglob("candidates/*/results.json")}


def test_first_split_search_trains_only_the_chosen_on_the_other_splits(tmp_path):
  everywhere = recipes.run(tiny_synthetic_recipe(1000, 100, **FIELDS, **{"recipe.split_search": "all"}),
                           tmp_path / "all")
  first = recipes.run(tiny_synthetic_recipe(1000, 100, **FIELDS, **{"recipe.split_search": "first"}),
                      tmp_path / "first")
  ens_all, ens = everywhere["recipe"]["ensemble"], first["recipe"]["ensemble"]
  names = [row["name"] for row in first["recipe"]["candidates"]]
  assert len(names) == 2 and ens["splits"] == 1 and ens["summed_splits"] == 2
  # Chosen on split 0 alone: its values are the candidates' own selected values on split 0.
  for row in first["recipe"]["candidates"]:
    run0 = json.loads((tmp_path / "first" / "candidates" / row["name"] / "results.json").read_text())
    assert row["validation"] == run0["selected"]["value"] and "splits" not in row
  # Every candidate on split 0, only the chosen members on split 1 (the "all" search: both everywhere).
  assert _trained(tmp_path / "first") == {("0", n) for n in names} | {("1", n) for n in ens["members"]}
  assert _trained(tmp_path / "all") == {(s, n) for n in names for s in ("0", "1")}
  assert [m["split"] for m in ens["other_splits"]] == [1] * len(ens["members"])
  # The same members chosen: the same models (same seeds, data and steps), summed the same way.
  assert ens["members"] == ens_all["members"]
  for k, v in ens_all["test"].items():
    if isinstance(v, float) and k != "eval_seconds":
      assert ens["test"][k] == pytest.approx(v, abs=1e-6), k
  assert first["final"] == ens["test"]
  # A rerun trains nothing and reads the same result back.
  stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "first").rglob("results.json") if "candidates" in str(p)}
  again = recipes.run(tiny_synthetic_recipe(1000, 100, **FIELDS, **{"recipe.split_search": "first"}),
                      tmp_path / "first")
  assert again["final"] == first["final"]
  assert stamps == {p: p.stat().st_mtime_ns for p in stamps}


def test_an_unknown_split_search_is_refused():
  with pytest.raises(ConfigError, match=r"recipe\.split_search"):
    validation.validate(tiny_synthetic_recipe(**{"recipe.split_search": "some"}))
