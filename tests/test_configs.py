"""Every shipped config constructs and validates; the paper-scale configs pass a
2-step smoke test on synthetic data with the paper's K, width and B."""

import importlib

import pytest

from snm_jax.train.config import validation
from snm_jax.train.trainer.loop import train_and_evaluate

pytestmark = pytest.mark.optimized  # (tests/conftest.py: the paper-scale smoke runs a 325k-label table)

SMALL = [("default", ""), ("default", "runlocal"), ("default", "paper"), ("default", "paper,runlocal"), ("snm", ""), ("snm", "delicious,k=64"),
         ("snm", "synthetic,kind=powl"), ("negative_sampling", "bibtex"), ("s2m", "delicious,kprime=32"),
         ("full_softmax", "bibtex")]
PAPER = ["amazoncat13k", "wikilshtc325k", "amazon670k", "amazon3m"]


def load(module, arg):
  return importlib.import_module(f"experiments.configs.{module}").get_config(arg)


@pytest.mark.parametrize("module,arg", SMALL + [(m, v) for m in ("snm", "negative_sampling", "s2m")
                                                 for v in PAPER])
def test_config_constructs_and_validates(module, arg):
  c = load(module, arg)
  k = c.dataset.synthetic.num_labels if c.dataset.name not in ("bibtex", "delicious") else 983
  validation.validate(c, k)
  with pytest.raises(AttributeError):
    c.mining.typo_field = 1  # locked: a typo in an override fails


def test_paper_hyperparameters():
  assert load("snm", "amazoncat13k").mining.num_samples == 1024
  assert load("snm", "amazon670k").mining.num_samples == 32_768
  s2m = load("s2m", "amazon3m,kprime=512")
  assert (s2m.train.batch_size, s2m.mining.num_samples, s2m.mining.k, s2m.loss.k_prime) == (2048, 4096, 64, 512)


# Bibtex's training file less its 10% validation split (4880 - 488 points), as recipe.DataStats sees it.
BIBTEX_STATS = dict(num_train=4392, num_features=1836, num_labels=159, labels_per_point=2.4,
                    nnz_per_point=68.0)


def test_default_is_one_snm_tower_model_chosen_on_validation():
  """default.py: the recipe's SNM-tower settings, one candidate (the derived learning rate), one
  validation split, no ensemble, the number of steps chosen on validation nDCG@5, then refit."""
  from snm_jax.train.recipes import recipe as recipes  # pylint: disable=g-import-not-at-top
  c = load("default", "")
  assert (c.dataset.name, c.dataset.validation_fraction, c.eval.select_metric) == ("bibtex", 0.1, "nDCG@5")
  assert (c.model.kind, c.model.hidden, c.model.out, c.model.dropout, c.loss.logit_scale) == (
      "snm_tower", 1024, 512, 0.5, 20.0)
  assert {f: c[f.split(".")[0]][f.split(".")[1]] for f in recipes.KIND_SETTINGS["snm_tower"]} == (
      recipes.KIND_SETTINGS["snm_tower"])
  assert (c.recipe.name, c.recipe.splits, c.recipe.ensemble, c.recipe.halving) == ("default", 1, 1, 0)
  assert c.recipe.refit  # then retrained on the whole training file for the selected steps
  assert (c.table.decay, c.optimizer.name, c.optimizer.learning_rate) == ("cosine", "momentum", 0.05)
  stats = recipes.DataStats(**BIBTEX_STATS)
  derived = recipes.derive(c, stats)
  assert derived == {"model.bag_matmul": "dense", "loss.kind": "full_softmax", "mining.sampler": "full",
                     "mining.num_samples": 160, "train.batch_size": 512, "train.num_steps": 686,
                     "train.eval_every": 34, "table.learning_rate": 0.004 * 512}
  points = recipes.candidate_list(c, stats, derived)
  assert len(points) == 1  # one model: no learning-rate grid, no one-vs-rest candidate
  name, over, fields = points[0]
  assert (name, over) == ("learning_rate_x1", {"table.learning_rate": 0.004 * 512})
  assert recipes.num_splits(c, 488) == 1 and recipes.ensemble_size(c, 1) == 1
  # Any dataset: the same rules (sampled softmax over 8192 uniform negatives past 2^14 labels).
  big = recipes.derive(c, recipes.DataStats(num_train=100_000, num_features=200_000, num_labels=30_000,
                                            labels_per_point=5.0, nnz_per_point=100.0))
  assert (big["loss.kind"], big["mining.num_samples"], big["train.batch_size"], big["train.num_steps"],
          big["model.bag_matmul"]) == ("sampled_softmax", 8192, 512, 4000, "gather")


def test_default_paper_variant_keeps_the_papers_settings():
  """default.py:paper is what default.py was: snm.py:bibtex,k=1, a plain run, no validation split."""
  c = load("default", "paper")
  assert c.to_dict() == load("snm", "bibtex,k=1").to_dict()
  assert (c.recipe.name, c.dataset.name, c.dataset.validation_fraction) == ("", "bibtex", 0.0)
  assert (c.model.kind, c.model.hidden, c.model.out, c.model.dropout) == ("snm_tower", 256, 256, 0.0)
  assert (c.loss.kind, c.loss.phi, c.loss.logit_scale) == ("bowl", "hinge", 8.0)
  assert (c.mining.sampler, c.mining.num_samples, c.mining.vartheta, c.mining.k) == ("uniform", 64, "top_k", 1)
  assert (c.table.learning_rate, c.table.decay, c.optimizer.learning_rate) == (0.5, "constant", 0.05)
  assert (c.train.batch_size, c.train.num_steps) == (128, 1000)
  small = load("default", "paper,runlocal")
  assert (small.recipe.name, small.model.hidden, small.train.num_steps) == ("", 32, 20)


def test_table2_and_before_sweeps_use_the_papers_settings():
  """The committed Table 2 rows and the "before" row of results/quality.md stay reproducible."""
  from experiments.sweeps import quality_before, table2_bibtex, table2_delicious  # pylint: disable=g-import-not-at-top
  assert quality_before.get_sweep("bibtex").config == "experiments/configs/default.py:paper"
  assert table2_bibtex.get_sweep().config.startswith("experiments/configs/snm.py:")
  assert table2_delicious.get_sweep().config.startswith("experiments/configs/snm.py:")
  assert load("snm", "bibtex").recipe.name == "" and load("snm", "bibtex").loss.logit_scale == 8.0


def _field(c, dotted):
  for part in dotted.split("."):
    c = c[part]
  return c


def test_demo_rows_are_the_methods_on_the_default_tower():
  """make demo's SNM top-1 / top-16 / negative-sampling rows: default.py with only the loss, the
  sampler and the refit changed (the tower, data split, selection and derived fields are default.py's)."""
  from experiments import demo  # pylint: disable=g-import-not-at-top
  from snm_jax.train.config import overrides  # pylint: disable=g-import-not-at-top
  base = load("default", "")
  allowed = {"loss.kind", "loss.phi", "mining.sampler", "mining.num_samples", "mining.vartheta", "mining.k",
             "recipe.refit"}
  for name, over in demo.METHODS.items():
    c = overrides.apply_overrides(load("default", ""), over)
    validation.validate(c)
    changed = {f for f in overrides.config_fields(c) if _field(c, f) != _field(base, f)}
    assert changed <= allowed, (name, changed)
    assert (c.loss.kind, c.mining.sampler, c.mining.num_samples, c.model.hidden, c.loss.logit_scale) == (
        "bowl", "uniform", 64, 1024, 20.0)
    assert (c.dataset.validation_fraction, c.eval.select_metric, c.recipe.name) == (0.1, "nDCG@5", "default")
  assert demo.METHODS["SNM top-1"]["mining.k"] == 1 and demo.METHODS["SNM top-16"]["mining.k"] == 16
  assert demo.METHODS["negative sampling"]["mining.vartheta"] == "negative_sampling"


@pytest.mark.slow
def test_default_runlocal_trains_one_model_chosen_on_validation(tmp_path):
  from snm_jax.train.recipes import runs  # pylint: disable=g-import-not-at-top
  out = runs.train(load("default", "runlocal"), tmp_path)
  rec = out["recipe"]
  assert rec["chosen"] == "learning_rate_x1" and len(rec["candidates"]) == 1 and rec["splits"] == 1
  assert rec["derived"]["loss.kind"] == "full_softmax" and rec["candidates"][0]["steps"] == 20
  assert out["selected"]["metric"] == "nDCG@5" and out["selected"]["step"] in (10, 20)
  # The refit: the whole training file for the selected number of steps, scored on test.
  assert out["steps"] == rec["refit"]["steps"] == out["selected"]["step"]
  assert 0 < out["final"]["P@1"] <= 1


def test_unknown_variant_and_arguments_fail():
  with pytest.raises(ValueError, match="unknown dataset variant"):
    load("snm", "amazon9m")
  with pytest.raises(ValueError, match="unknown config arguments"):
    load("snm", "bibtex,kk=3")
  with pytest.raises(ValueError, match="not feasible"):
    load("full_softmax", "amazon3m")


def test_parse_arg_is_typed():
  from experiments.configs import common  # pylint: disable=g-import-not-at-top
  a = common.parse_arg("delicious,k=64,lr=0.25,runlocal", variant="bibtex", k=16, lr=0.5, runlocal=False)
  assert (a.variant, a.k, a.lr, a.runlocal) == ("delicious", 64, 0.25, True)
  assert type(a.k) is int and type(a.lr) is float  # pylint: disable=unidiomatic-typecheck
  assert common.parse_arg("", variant="bibtex", runlocal=False).to_dict() == {"variant": "bibtex",
                                                                               "runlocal": False}
  # A bare bool key is that key = True (not the first argument's value); a bare word first is.
  assert common.parse_arg("runlocal", variant="bibtex", runlocal=False).to_dict() == {
      "variant": "bibtex", "runlocal": True}
  for text, value in [("1", True), ("true", True), ("True", True), ("0", False), ("false", False),
                      ("False", False)]:
    assert common.parse_arg(f"runlocal={text}", runlocal=False).runlocal is value
  with pytest.raises(ValueError, match=r"unknown config arguments \['kk'\].*allowed: variant, k, runlocal"):
    common.parse_arg("bibtex,kk=3", variant="bibtex", k=16, runlocal=False)
  with pytest.raises(ValueError, match="k='x': expected int"):
    common.parse_arg("k=x", k=16)
  with pytest.raises(ValueError, match="runlocal='maybe': expected a bool"):
    common.parse_arg("runlocal=maybe", runlocal=False)
  with pytest.raises(ValueError, match="'synthetic': expected key=value"):
    common.parse_arg("bibtex,synthetic", variant="bibtex", runlocal=False)  # one positional only


@pytest.mark.parametrize("module,arg", [("default", ""), ("default", "paper"), ("snm", "bibtex"), ("s2m", "delicious"),
                                        ("negative_sampling", "bibtex"), ("full_softmax", "synthetic"),
                                        ("digits_s2m", ""), ("xmc", "synthetic"),
                                        ("adversarial", "bibtex,method=uniform")])
def test_every_config_has_the_one_runlocal_spelling(module, arg):
  small = load(module, f"{arg},runlocal" if arg else "runlocal")
  assert small.to_dict() != load(module, arg).to_dict()
  assert small.to_dict() == load(module, f"{arg},runlocal=1" if arg else "runlocal=1").to_dict()
  assert small.to_dict() == load(module, f"{arg},runlocal=true" if arg else "runlocal=true").to_dict()
  validation.validate(small)
  with pytest.raises(ValueError, match="unknown config arguments"):
    load(module, f"{arg},runlocall=1" if arg else "runlocall=1")


# Run at K up to 325k; amazon670k and amazon3m (1.4 and 6 GB tables, ~65 s of the suite) differ from
# wikilshtc325k only in the numbers their configs set, which test_config_constructs_and_validates and
# test_paper_hyperparameters check.
SMOKE = [v for v in PAPER if v not in ("amazon670k", "amazon3m")]


@pytest.mark.slow
@pytest.mark.parametrize("module,variant", [("snm", v) for v in SMOKE] + [("s2m", "amazoncat13k")])
def test_paper_scale_config_two_step_smoke(tmp_path, module, variant):
  """Same K, embedding width and B as the paper; synthetic inputs, a small batch."""
  c = load(module, variant)
  k = c.dataset.synthetic.num_labels
  c.dataset.name = "synthetic"
  c.dataset.synthetic.num_train = 512
  c.dataset.synthetic.num_test = 16
  c.dataset.synthetic.dim = 32
  c.train.num_steps = 2
  c.train.batch_size = 64
  c.loss.k_prime = min(c.loss.k_prime, 64)
  c.train.eval_every = 0
  c.train.checkpoint_every = -1
  c.train.fingerprint = False
  c.mesh.shape = (1, 8)  # the table sharded 8 ways (replicated it would need 8 copies)
  c.eval.recall_r = 10
  out, state = train_and_evaluate(c, tmp_path, return_state=True)
  assert out["num_labels"] == k and out["steps"] == 2
  assert state.table.shape == (-(-k // 8) * 8, 512)
  assert out["nonfinite_steps"] == 0
