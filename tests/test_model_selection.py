"""Validation-based model selection in train_and_evaluate: the state evaluated on
test is the best validation one, early stopping, and the run record (history,
training time, metrics.jsonl) across a resume."""

import json
import math

import pytest

from snm_jax.train.trainer import loop
from snm_jax.train.trainer.loop import train_and_evaluate
from snm_jax.train.runtime.progress import Progress
from test_train_loop import synthetic_config


def selection_config(**overrides):
  base = {"dataset.validation_fraction": 0.2, "train.num_steps": 60, "train.eval_every": 10,
          "train.checkpoint_every": 20, "train.batch_size": 64, "mining.num_samples": 64,
          "mining.k": 4, "train.log_every": 10}
  return synthetic_config(**{**base, **overrides})


def test_progress_keeps_the_first_best_and_counts_patience():
  p = Progress()
  assert p.record_selection(10, 0.2) and p.best_step == 10
  assert not p.record_selection(20, 0.2)  # a tie keeps the earlier step
  assert not p.record_selection(30, math.nan)
  assert p.best_step == 10 and p.evals_since_best == 2
  assert p.out_of_patience(2) and not p.out_of_patience(3) and not p.out_of_patience(0)
  assert p.record_selection(40, 0.3) and p.evals_since_best == 0
  assert Progress.from_json(p.to_json()) == p
  assert Progress.from_json(None) == Progress()


def test_final_is_the_test_evaluation_of_the_best_validation_state(tmp_path):
  res = train_and_evaluate(selection_config(), tmp_path)
  hist = res["history"]
  assert [h["step"] for h in hist] == [10, 20, 30, 40, 50, 60]
  vals = [h["val/P@1"] for h in hist]
  best = hist[vals.index(max(vals))]  # the first of equal maxima
  assert res["selected"]["step"] == best["step"]
  assert res["selected"]["value"] == pytest.approx(max(vals))
  # The restored best state gives exactly the test metrics logged at its step.
  for metric in ("P@1", "P@5", "R@5", "PSP@5", "nDCG@5"):
    assert res["final"][metric] == pytest.approx(best[metric], abs=1e-12), metric
  assert res["selected"]["last"]["P@1"] == pytest.approx(hist[-1]["P@1"], abs=1e-12)
  # The validation split is scored and differs from the test one.
  assert any(h["val/P@1"] != h["P@1"] for h in hist)


def test_validation_scores_rankings_and_test_also_the_recall_curves(tmp_path, monkeypatch):
  """Validation is scored for selection only (rankings @k <= eval.k_max); the retrieval recall@r
  curves, a top-recall_r retrieval, are computed on the test split alone."""
  keys = {}
  select = loop._selecting_evaluate

  def spy(config, evaluators, *args):
    def recording(split, evaluate):
      return lambda state: keys.setdefault(split, []).append(set(out := evaluate(state))) or out
    return select(config, {s: recording(s, e) for s, e in evaluators.items()}, *args)

  monkeypatch.setattr(loop, "_selecting_evaluate", spy)
  res = train_and_evaluate(selection_config(**{"train.num_steps": 20}), tmp_path)
  assert len(keys["validation"]) == len(keys["test"]) == 2
  for val, test in zip(keys["validation"], keys["test"]):
    assert {"P@1", "nDCG@5", "PSP@5"} <= val and not any(k.startswith("recall@r") for k in val)
    assert {"recall@r", "recall@r/head"} <= test and val < test
  assert len(res["final"]["recall@r"]) == selection_config().eval.recall_r


def test_patience_stops_training_and_a_rerun_does_not_continue(tmp_path):
  c = selection_config(**{"train.patience": 1, "train.num_steps": 400, "train.eval_every": 5,
                          "table.learning_rate": 1e-12, "optimizer.learning_rate": 1e-12})
  res = train_and_evaluate(c, tmp_path)  # nothing learns: no evaluation improves on the first
  assert res["selected"]["stopped_early"] and res["steps"] == 10
  assert res["selected"]["step"] == 5
  (tmp_path / "results.json").unlink()
  again = train_and_evaluate(c, tmp_path)
  assert again["steps"] == 10 and again["state_fingerprint"] == res["state_fingerprint"]


def test_resume_keeps_history_time_and_one_metrics_row_per_step(tmp_path):
  full = train_and_evaluate(selection_config(), tmp_path / "full")
  part = tmp_path / "part"
  train_and_evaluate(selection_config(**{"train.num_steps": 40}), part)
  # Simulate a crash after step 40's checkpoint: rows past it were logged, then lost.
  resumed = train_and_evaluate(selection_config(), part)
  assert resumed["state_fingerprint"] == full["state_fingerprint"]
  assert [h["step"] for h in resumed["history"]] == [h["step"] for h in full["history"]]
  assert resumed["selected"]["step"] == full["selected"]["step"]
  assert resumed["final"]["P@1"] == full["final"]["P@1"]
  # Training time adds up over both processes: the per-step cost is of the same order.
  assert 0.2 < resumed["seconds_per_step"] / full["seconds_per_step"] < 5
  rows = [json.loads(line) for line in (part / "metrics.jsonl").read_text().splitlines()]
  keys = [(r["step"], "loss" in r) for r in rows]
  assert len(keys) == len(set(keys))
  full_rows = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
  assert len(rows) == len(full_rows)
