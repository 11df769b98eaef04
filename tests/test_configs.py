"""Every shipped config constructs and validates; the paper-scale configs pass a
2-step smoke test on synthetic data with the paper's K, width and B."""

import importlib

import pytest

from snm_jax.train.config import validation
from snm_jax.train.trainer.loop import train_and_evaluate

SMALL = [("default", ""), ("default", "runlocal"), ("snm", ""), ("snm", "delicious,k=64"),
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


@pytest.mark.parametrize("module,arg", [("default", ""), ("snm", "bibtex"), ("s2m", "delicious"),
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
