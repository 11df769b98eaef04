"""Bad input gets a clear error before anything runs (issue "Reliability"): every
field is validated in one place (`validation.validate`), each message starts with
`config.<field>:` and says what is allowed, an unknown `--config.<field>` names
the closest valid ones, and the CLI exits with status 2 and one line."""

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.configs import default, xmc
from snm_jax.errors import ConfigError
from snm_jax.train.config import overrides, validation
from snm_jax.train.trainer.loop import train_and_evaluate
from experiments.sweeps.spec import apply_overrides

REPO = Path(__file__).resolve().parents[1]
RECIPE = {"recipe.name": "xmc", "dataset.validation_fraction": 0.1}
RETRIEVAL = {"task": "retrieval"}

# (overrides, the field the error must name, words the message must hold)
BAD = [
    ({"optimizer.learning_rate": -0.1}, "optimizer.learning_rate", "> 0"),
    ({"optimizer.learning_rate": 0.0}, "optimizer.learning_rate", "> 0"),
    ({"optimizer.learning_rate": math.nan}, "optimizer.learning_rate", "finite"),
    ({"table.learning_rate": -1.0}, "table.learning_rate", "> 0"),
    ({"table.learning_rate": 0.0}, "table.learning_rate", "> 0"),
    ({"loss.logit_scale": 0.0}, "loss.logit_scale", "> 0"),
    ({"loss.logit_scale": -8.0}, "loss.logit_scale", "> 0"),
    ({"optimizer.warmup_steps": -1}, "optimizer.warmup_steps", ">= 0"),
    ({"table.warmup_steps": -5}, "table.warmup_steps", ">= 0"),
    ({"train.log_every": 0}, "train.log_every", ">= 1"),
    ({"train.num_steps": -5}, "train.num_steps", ">= 1"),
    ({"train.num_steps": 0}, "train.num_steps", ">= 1"),
    ({"train.num_steps": -1}, "train.num_steps", "only a recipe resolves"),
    ({"train.keep_checkpoints": 0}, "train.keep_checkpoints", ">= 1"),
    ({"mining.num_strata": 0}, "mining.num_strata", ">= 1"),
    ({"model.hidden": 0}, "model.hidden", ">= 1"),
    ({"model.out": -3}, "model.out", ">= 1"),
    ({"eval.k_max": 0}, "eval.k_max", ">= 1"),
    ({"eval.row_block": 0}, "eval.row_block", ">= 1"),
    ({"eval.query_chunk": 0}, "eval.query_chunk", ">= 1"),
    ({"eval.recall_r": 0}, "eval.recall_r", ">= 1"),
    ({"eval.max_examples": -2}, "eval.max_examples", ">= 0"),
    ({"eval.psp_a": 0.0}, "eval.psp_a", "> 0"),
    ({"train.batch_size": 0}, "train.batch_size", ">= 1"),
    ({"train.batch_size": -1}, "train.batch_size", "only a recipe resolves"),
    ({"model.kind": "auto"}, "model.kind", "['snm_tower', 'linear', 'wide_deep', 'mlp']"),
    ({"dataset.conversion": "sample_one"}, "dataset.conversion", "'sample_one_positive'"),
    ({"dataset.validation_fraction": 1.0}, "dataset.validation_fraction", "[0, 1)"),
    ({"mining.num_samples": 0}, "mining.num_samples", ">= 1"),
    ({"mining.k": 0}, "mining.k", "[1, mining.num_samples=64]"),
    ({"mining.vartheta_norm": "median"}, "mining.vartheta_norm", "['mean', 'expectation']"),
    ({"mining.sampler": "exakt"}, "mining.sampler", "'exact'"),
    ({"loss.phi": "hinj"}, "loss.phi", "hinge"),
    ({"loss.reduction": "s2m", "loss.k_prime": 0}, "loss.k_prime", "[1, train.batch_size=32]"),
    ({"train.checkpoint_every": -2}, "train.checkpoint_every", "-1 = never"),
    ({"train.eval_every": -1}, "train.eval_every", "only a recipe resolves"),
    ({"train.eval_every": -4}, "train.eval_every", ">= 0"),
    ({"train.on_nonfinite": "ignore"}, "train.on_nonfinite", "['stop', 'skip']"),
    ({"train.max_skipped_steps": -1}, "train.max_skipped_steps", ">= 0"),
    ({"train.on_unreadable_checkpoints": "ignore"}, "train.on_unreadable_checkpoints",
     "['restart', 'fail']"),
    ({"train.patience": 3}, "train.patience", "validation_fraction > 0"),
    ({"mesh.shape": (0, 1)}, "mesh.shape", "integers >= 1"),
    ({"mesh.shape": (-1, -1)}, "mesh.shape", "at most one -1"),
    ({"table.optimizer": "adam"}, "table.optimizer", "['sgd', 'momentum', 'adagrad']"),
    ({"optimizer.name": "rmsprop"}, "optimizer.name", "'adam'"),
    ({"optimizer.momentum": 1.0}, "optimizer.momentum", "[0, 1)"),
    ({"table.init_scale": 0.0}, "table.init_scale", "> 0"),
    ({"seed": -1}, "seed", "[0, "),
    ({"dataset.synthetic.num_labels": 1}, "dataset.synthetic.num_labels", ">= 2"),
    ({"distributed.initialize": "maybe"}, "distributed.initialize", "['auto', 'yes', 'no']"),
    ({"model.bag_matmul": "sparse"}, "model.bag_matmul", "['gather', 'dense']"),
    ({**RECIPE, "recipe.search": "table.lr*=1,2"}, "recipe.search", "no config field 'table.lr'"),
    ({**RECIPE, "recipe.search": "table.learning_rate"}, "recipe.search", "expected field=v1,v2"),
    ({**RECIPE, "recipe.min_steps": 0}, "recipe.min_steps", ">= 1"),
    ({**RECIPE, "recipe.max_steps": 100, "recipe.min_steps": 200}, "recipe.max_steps", ">= 200"),
    ({**RECIPE, "recipe.evaluations": 0}, "recipe.evaluations", ">= 1"),
    ({**RECIPE, "recipe.epochs": 0.0}, "recipe.epochs", "> 0"),
    ({**RECIPE, "recipe.ensemble": -1}, "recipe.ensemble", ">= 0"),
    ({**RECIPE, "recipe.ensemble": 2, "recipe.refit": True}, "recipe.ensemble", "cannot be refit"),
    ({**RECIPE, "recipe.logit_adjust": "abc"}, "recipe.logit_adjust", "not a number"),
    ({**RECIPE, "recipe.logit_adjust": "0.1;0.2"}, "recipe.logit_adjust", "not a number"),
    ({**RECIPE, "recipe.logit_adjust": "-0.5"}, "recipe.logit_adjust", "finite number >= 0"),
    ({**RECIPE, "recipe.logit_adjust": "0.5,inf"}, "recipe.logit_adjust", "finite number >= 0"),
    ({**RECIPE, "recipe.logit_adjust": "nan"}, "recipe.logit_adjust", "finite number >= 0"),
    ({**RECIPE, "recipe.logit_adjust": "0.5", "recipe.ensemble": 1, "recipe.refit": True},
     "recipe.logit_adjust", "recipe.refit=True"),
    ({"recipe.name": "xmc"}, "dataset.validation_fraction", "validation split"),
    ({"task": "ranking"}, "task", "['classification', 'retrieval']"),
    ({**RETRIEVAL, "auprc.method": "lambdaloss"}, "auprc.method", "'soprc'"),
    ({**RETRIEVAL, "dataset.name": "delicious"}, "dataset.name", "['bibtex', 'synthetic']"),
    ({**RETRIEVAL, "dataset.validation_fraction": 0.1}, "dataset.validation_fraction", "must be 0"),
    ({**RETRIEVAL, "auprc.samples_per_class": 1}, "auprc.samples_per_class", ">= 2"),
    ({**RETRIEVAL, "auprc.samples_per_class": 5}, "train.batch_size", "multiple of"),
    ({**RETRIEVAL, "auprc.class_weighting": "inverse"}, "auprc.class_weighting", "'uniform'"),
    ({**RETRIEVAL, "auprc.recall_ks": (0, 1)}, "auprc.recall_ks", ">= 1"),
    ({**RETRIEVAL, "auprc.category_rule": "last"}, "auprc.category_rule", "'rarest'"),
    ({**RETRIEVAL, "auprc.synthetic.num_train_classes": 0}, "auprc.synthetic.num_train_classes", ">= 1"),
    ({**RETRIEVAL, "auprc.soprc.tau2": 0.0}, "auprc.soprc.tau2", "> 0"),
    ({**RETRIEVAL, "auprc.soprc.beta": 1.5}, "auprc.soprc.beta", "(0, 1]"),
    ({**RETRIEVAL, "auprc.soprc.num_aux": 0}, "auprc.soprc.num_aux", ">= 1"),
    ({**RETRIEVAL, "auprc.soprc.aux_update": "never"}, "auprc.soprc.aux_update", "'before_gradient'"),
    ({**RETRIEVAL, "auprc.soprc.prior_mul": 2.0}, "auprc.soprc.prior_mul", "[0, 1]"),
    ({**RETRIEVAL, "auprc.smooth_ap.temperature": 0.0}, "auprc.smooth_ap.temperature", "> 0"),
    ({**RETRIEVAL, "auprc.triplet.margin": -0.1}, "auprc.triplet.margin", ">= 0"),
]


def config(overrides):
  c = default.get_config("paper,runlocal")
  c.dataset.name = "synthetic"
  return apply_overrides(c, overrides)


def test_the_table_is_large():
  assert len(BAD) >= 25 and len({field for _, field, _ in BAD}) >= 40


@pytest.mark.parametrize("overrides,field,words", BAD, ids=[f"{f}={list(o.values())[-1]}" for o, f, _ in BAD])
def test_bad_field_is_named_before_anything_runs(tmp_path, overrides, field, words):
  workdir = tmp_path / "run"
  t0 = time.perf_counter()
  with pytest.raises(ConfigError) as info:  # experiments.train: exit status 2
    train_and_evaluate(config(overrides), workdir)
  assert time.perf_counter() - t0 < 3
  assert info.value.field == field
  assert str(info.value).startswith(f"config.{field}: "), str(info.value)
  assert words in str(info.value), str(info.value)
  assert not workdir.exists()  # before the lock, the data and any compilation


def test_shipped_and_recipe_configs_validate():
  validation.validate(default.get_config(), 159)
  validation.validate(xmc.get_config("bibtex"))  # "auto" / -1 are the recipe's to resolve
  plain = xmc.get_config("bibtex")
  plain.unlock()
  plain.recipe.name = ""
  with pytest.raises(ConfigError, match=r"^config\.model\.kind: 'auto' is a placeholder that only a recipe"):
    validation.validate(plain)


def test_recipe_fields_match_what_recipes_derive():
  from snm_jax.train.recipes import recipe as recipes  # pylint: disable=g-import-not-at-top
  c = xmc.get_config("bibtex")
  c.unlock()
  c.model.kind = "auto"
  stats = recipes.DataStats(num_train=1000, num_features=50, num_labels=100, labels_per_point=2.0,
                            nnz_per_point=5.0)
  assert set(recipes.derive(c, stats)) == set(validation.RECIPE_FIELDS)


def test_unknown_field_names_the_closest_ones():
  err = overrides.unknown_field_error(default.get_config(), "mining.kk")
  assert str(err).startswith("config.mining.kk: no such config field; closest: mining.k")
  assert "closest: train.keep_checkpoints" in str(overrides.unknown_field_error(
      default.get_config(), "train.keep_checkpoint"))


# Renamed fields: the old name is refused wherever a field is named, and the message gives the new one.
RENAMED = [("mining.scale", "expectation", "mining.vartheta_norm"), ("loss.scale", 8.0, "loss.logit_scale")]


@pytest.mark.parametrize("old,value,new", RENAMED)
def test_renamed_field_is_refused_with_its_new_name(old, value, new):
  from snm_jax.train.config import overrides  # pylint: disable=g-import-not-at-top
  assert overrides.RENAMED_FIELDS[old] == new
  expected = f"config.{old}: renamed to {new}"
  with pytest.raises(ConfigError) as info:  # a sweep's / a test's override dict
    config({old: value})
  assert str(info.value).startswith(expected) and info.value.field == old
  assert str(overrides.unknown_field_error(default.get_config(), old)).startswith(expected)
  own = default.get_config()  # a config file of one's own that still sets the old name
  own.unlock()
  section, leaf = old.split(".")
  own[section][leaf] = value
  with pytest.raises(ConfigError, match=f"^{expected}"):
    validation.validate(own)
  with pytest.raises(ConfigError, match=f"^config.recipe.search: {old} was renamed to {new}"):
    validation.validate(config({**RECIPE, "recipe.search": f"{old}=1,2"}))


def test_saved_config_with_old_names_is_compared_under_the_new_ones():
  import json  # pylint: disable=g-import-not-at-top
  from snm_jax.train.trainer import checkpointing  # pylint: disable=g-import-not-at-top
  new = json.loads(default.get_config("paper").to_json_best_effort())
  saved = json.loads(json.dumps(new))
  saved["loss"]["scale"] = saved["loss"].pop("logit_scale")
  saved["mining"]["scale"] = saved["mining"].pop("vartheta_norm")
  checkpointing.check_resume_config(saved, new, "wd")  # same values: resumes
  saved["loss"]["scale"] = 1.0
  assert checkpointing.config_differences(saved, new) == [("loss.logit_scale", 1.0, 8.0)]
  with pytest.raises(ConfigError, match=r"^config\.loss\.logit_scale: saved 1.0, now 8.0"):
    checkpointing.check_resume_config(saved, new, "wd")


def _cli(*args, module="experiments.train"):
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  return proc, time.perf_counter() - t0


@pytest.mark.parametrize("override,field,words", [
    ("--config.mining.kk=3", "mining.kk", "no such config field; closest: mining.k"),
    ("--config.train.log_every=0", "train.log_every", "must be an integer >= 1, got 0"),
    ("--config.eval.k_max=0", "eval.k_max", ">= 1"),
    ("--config.dataset.conversion=first", "dataset.conversion", "'first_label'"),
    ("--config.train.batch_size=-1", "train.batch_size", "only a recipe resolves"),
    ("--config.mining.scale=expectation", "mining.scale", "renamed to mining.vartheta_norm"),
    ("--config.loss.scale=2", "loss.scale", "renamed to loss.logit_scale"),
])
def test_cli_prints_one_line_and_exits_2(tmp_path, override, field, words):
  proc, seconds = _cli("--config=experiments/configs/default.py:paper,runlocal", override,
                       f"--workdir={tmp_path / 'run'}")
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.startswith(f"error: config.{field}: ") and words in proc.stderr, proc.stderr
  assert seconds < 20 and not (tmp_path / "run").exists()


def test_ablate_unknown_set_field_is_one_line(tmp_path):
  proc, _ = _cli("--sweep=experiments/sweeps/table2_bibtex.py", f"--workdir={tmp_path}",
                 "--set=mining.kk=3", "--print_commands", module="experiments.ablate")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "error: config.mining.kk: no such config field; closest: mining.k"), proc.stderr
