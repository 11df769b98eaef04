"""train_and_evaluate end to end: learning, config errors, non-finite handling,
corrupt-checkpoint fallback (kill-and-resume: test_fault_injection.py)."""

import json
import time

import pytest

from snm_jax.errors import ConfigError, NonFiniteLossError
from snm_jax.train.trainer.loop import train_and_evaluate
import run_configs


def synthetic_config(**overrides):
  return run_configs.synthetic(256, 3000, 500, 16, {"train.log_every": 50, **overrides})


def test_training_beats_untrained_model_by_a_wide_margin(tmp_path):
  # One step at a negligible learning rate: the initial model (num_steps and learning rates must be > 0).
  untrained = train_and_evaluate(synthetic_config(**{"train.num_steps": 1, "table.learning_rate": 1e-12,
                                                     "optimizer.learning_rate": 1e-12}),
                                 tmp_path / "u")
  trained = train_and_evaluate(synthetic_config(**{"train.num_steps": 300, "train.batch_size": 64,
                                                   "mining.num_samples": 64, "mining.k": 4}),
                               tmp_path / "t")
  r5_u, r5_t = untrained["final"]["R@5"], trained["final"]["R@5"]
  bayes = trained["final"]["bayes/R@5"]
  assert r5_t > 3 * r5_u and r5_t > 0.2, (r5_u, r5_t, bayes)
  assert r5_t <= bayes + 0.05  # nothing beats the Bayes-optimal predictor (up to test noise)
  written = json.loads((tmp_path / "t" / "results.json").read_text())
  assert written["final"]["R@5"] == pytest.approx(r5_t)
  assert (tmp_path / "t" / "metrics.jsonl").read_text().count("\n") >= 6
  assert json.loads((tmp_path / "t" / "config.json").read_text())["mining"]["k"] == 4


@pytest.mark.parametrize("field,value,message", [
    ("mining.k", 100, "mining.k"),
    ("loss.phi", "hinjе", "loss.phi"),
    ("loss.kind", "softmaxx", "loss.kind"),
    ("mining.vartheta_norm", "median", "mining"),
    ("loss.reduction", "s2m", "loss.k_prime"),
    ("dataset.name", "no-such-dataset", "dataset.name"),
    ("mining.num_strata", 3, "mining.num_samples"),
])
def test_bad_config_fails_before_compiling_with_the_field_named(tmp_path, field, value, message):
  c = synthetic_config(**{field: value})
  t0 = time.perf_counter()
  with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
    train_and_evaluate(c, tmp_path)
  assert time.perf_counter() - t0 < 10


def test_nonfinite_loss_stops_naming_the_step(tmp_path):
  c = synthetic_config(**{"loss.phi": "exponential", "loss.logit_scale": 1e5, "train.num_steps": 5,
                          "train.log_every": 5})
  # Steps are numbered as the progress line counts them (the first step is step 1), and the
  # message does not claim a checkpoint that does not exist.
  with pytest.raises(NonFiniteLossError, match="at step 1 of 5 .*no checkpoint was saved yet"):
    train_and_evaluate(c, tmp_path)


def test_nonfinite_skip_mode_counts_and_finishes(tmp_path):
  c = synthetic_config(**{"loss.phi": "exponential", "loss.logit_scale": 1e5, "train.num_steps": 3,
                          "train.on_nonfinite": "skip"})
  out = train_and_evaluate(c, tmp_path)
  assert out["nonfinite_steps"] == 3


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path):
  c = synthetic_config(**{"train.num_steps": 20, "train.checkpoint_every": 10,
                          "train.keep_checkpoints": 3})
  first = train_and_evaluate(c, tmp_path)
  latest = tmp_path / "checkpoints" / "20"
  for f in latest.rglob("*"):
    if f.is_file() and "state" in str(f):
      f.write_bytes(b"garbage")
  c2 = synthetic_config(**{"train.num_steps": 20, "train.checkpoint_every": 10,
                           "train.keep_checkpoints": 3})
  (tmp_path / "results.json").unlink()
  again = train_and_evaluate(c2, tmp_path)  # resumes from step 10, redoes 10 steps
  assert again["state_fingerprint"] == first["state_fingerprint"]
