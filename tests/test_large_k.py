"""The large-K sweep's equal-time budget and the report's verdict rules."""

import json
import math

import pytest

from experiments import large_k_report
from experiments.sweeps import large_k
from experiments.sweeps.spec import load_sweep


@pytest.mark.parametrize("size", ["1e5", "1e6"])
def test_steps_are_the_budget_over_each_points_step_time(size):
  sweep = load_sweep(f"experiments/sweeps/large_k.py:{size}")
  times = large_k.step_times(size)
  budget = large_k.SIZES[size]["budget_seconds"]
  for p in sweep.points:
    steps = p.overrides["train.num_steps"]
    if p.name == large_k.ADAPTIVE:  # a third of the budget at each B, at the fixed-B points' step times
      phases = large_k.ms_phases(p.name, p.overrides, times)
      ends = [s for s, _ in phases[1:]] + [steps]
      spent = [(end - start) * ms / 1000 for (start, ms), end in zip(phases, ends)]
      assert [b for _, b in p.overrides["mining.num_samples_schedule"]] == [1024, 2048, 4096]
      assert spent == pytest.approx([budget / 3] * 3, abs=0.01)
      continue
    assert steps % large_k.EVALS_PER_RUN == 0
    assert abs(steps * times[p.name] / 1000 - budget) <= times[p.name] * large_k.EVALS_PER_RUN / 1000
    assert p.overrides["train.eval_every"] == steps // large_k.EVALS_PER_RUN
  names = [p.name for p in sweep.points]
  by_name = {p.name: p.overrides["train.num_steps"] for p in sweep.points}
  if size == "1e5":
    assert {"snm_k16", "ns", "ssm", "tree_s64", "uniform_s64", "full_softmax", "b1024_ns"} <= set(names)
    assert by_name["snm_k16"] > 10 * by_name["full_softmax"]  # equal time, not equal steps
  else:  # the issue's minimum at 10^6, the tree's own baseline, and 10^5's best k
    assert set(names) == {"snm_k1", "snm_k16", "ns", "tree_s64", "uniform_s64"}
  double = {p.name: p.overrides["train.num_steps"] for p in
            load_sweep(f"experiments/sweeps/large_k.py:{size},budget={2 * budget}").points}
  assert all(abs(double[n] - 2 * by_name[n]) <= large_k.EVALS_PER_RUN for n in names)


def test_uncalibrated_points_and_bad_arguments():
  points = load_sweep("experiments/sweeps/large_k.py:1e5,uncalibrated").points
  assert all("train.num_steps" not in p.overrides for p in points)
  with pytest.raises(ValueError, match="one of"):
    load_sweep("experiments/sweeps/large_k.py:1e7")
  with pytest.raises(ValueError, match="budget"):
    load_sweep("experiments/sweeps/large_k.py:1e5,budget=-3")


def test_missing_step_time_is_an_error(tmp_path, monkeypatch):
  path = tmp_path / "step_times_1e5.json"
  path.write_text(json.dumps({"ms_per_step": {"snm_k1": 5.0}}))
  monkeypatch.setattr(large_k, "step_times_path", lambda size: path)
  with pytest.raises(ValueError, match="no step time for"):
    large_k.get_sweep("1e5")
  monkeypatch.setattr(large_k, "step_times_path", lambda size: tmp_path / "missing.json")
  with pytest.raises(ValueError, match="measure the step times first"):
    large_k.get_sweep("1e5")


def test_print_commands_lists_every_run(tmp_path, capsys):
  from absl import flags  # pylint: disable=g-import-not-at-top
  from experiments import ablate  # pylint: disable=g-import-not-at-top
  flags.FLAGS(["ablate", "--sweep=experiments/sweeps/large_k.py:1e5", f"--workdir={tmp_path}",
               "--print_commands"])
  try:
    ablate.main(["ablate"])
  finally:
    flags.FLAGS.unparse_flags()
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("python -m experiments.train")]
  assert len(lines) == len(load_sweep("experiments/sweeps/large_k.py:1e5").points) * 3
  assert any("--config.dataset.synthetic.num_labels=100000" in l and "--config.mining.sampler=tree" in l
             for l in lines)


def _res(curve, steps_per_eval=10, tree_fit=0.0):
  history = [{"step": (i + 1) * steps_per_eval, "train_seconds": 0.0, "R@5": v} for i, v in enumerate(curve)]
  return {"history": history, "steps": history[-1]["step"], "train_seconds": 0.0,
          "final": {"R@5": curve[-1]}, "tree_fit_seconds": tree_fit}


def test_time_to_reach_interpolates_calibrated_seconds():
  res = large_k_report.calibrated(_res([0.1, 0.3, 0.5]), ms_per_step=100.0)  # 1 s per evaluation
  assert res["history"][-1]["train_seconds"] == pytest.approx(3.0)
  assert large_k_report.time_to_reach(res, "R@5", 0.4) == pytest.approx(2.5)
  assert large_k_report.time_to_reach(res, "R@5", 0.6) == math.inf
  with_fit = large_k_report.calibrated(_res([0.1, 0.3, 0.5], tree_fit=7.0), ms_per_step=100.0)
  assert large_k_report.time_to_reach(with_fit, "R@5", 0.5) == pytest.approx(10.0)
  assert large_k_report.time_to_reach(with_fit, "R@5", 0.05) == pytest.approx(7.5)  # from (fit, 0)


@pytest.mark.parametrize("ratios,verdict", [
    ({"R@1": [1.5, 1.4], "R@5": [1.3, 1.25], "P@1": [1.5, 1.4]}, "reproduced"),
    ({"R@1": [1.1, 1.05], "R@5": [1.02, 0.99], "P@1": [1.3, 1.25]}, "not reproduced"),
    ({"R@1": [0.8, 0.9], "R@5": [0.7, 0.95], "P@1": [1.3, 1.25]}, "refuted"),
])
def test_snm_verdict_rule(ratios, verdict):
  assert large_k_report.snm_verdict(ratios)[0] == verdict


def test_tree_verdict_rule():
  assert large_k_report.tree_verdict(12.0, 0.5, 0.4) == "reproduced"
  assert large_k_report.tree_verdict(3.0, 0.5, 0.4) == "not reproduced"
  assert large_k_report.tree_verdict(math.inf, 0.3, 0.4) == "refuted"


def test_open_problems_verdict_rule():
  from experiments import open_problems_report as opr  # pylint: disable=g-import-not-at-top
  runs = {"base": {s: {"final": {"R@5": 0.40}} for s in range(3)},
          "up": {s: {"final": {"R@5": 0.41 + 0.001 * s}} for s in range(3)},
          "mixed": {0: {"final": {"R@5": 0.39}}, 1: {"final": {"R@5": 0.41}}, 2: {"final": {"R@5": 0.40}}}}
  assert opr.paired(runs, "up", "base", "R@5") == pytest.approx([0.01, 0.011, 0.012])
  assert opr.verdict(opr.paired(runs, "up", "base", "R@5")) == "helps"
  assert opr.verdict([-0.01, -0.02, -0.001]) == "hurts"
  assert opr.verdict(opr.paired(runs, "mixed", "base", "R@5")) == "no measurable difference"
  assert opr.verdict([0.1, 0.2]).startswith("not enough seeds")


def _probe_result(root, name, curve):
  d = root / name / "seed0"
  d.mkdir(parents=True)
  (d / "results.json").write_text(json.dumps({"history": [{"step": s, "val/R@5": v, "R@5": 9.0}
                                                          for s, v in curve]}))


def test_probes_section_picks_each_familys_best_validation_value(tmp_path):
  from experiments.sweeps import large_k_probes  # pylint: disable=g-import-not-at-top
  root = tmp_path / "probes"
  _probe_result(root, "snm_s4", [(10, 0.30), (20, 0.35)])
  _probe_result(root, "snm_s8", [(10, 0.34), (20, 0.33)])
  _probe_result(root, "ssm_s10", [(10, 0.20), (20, 0.25)])
  saved = tmp_path / "probes.json"
  md = large_k_report.probes_section(root, saved)
  rows = {line.split(" | ")[0][2:]: line for line in md if line.startswith("| snm") or line.startswith("| ssm")}
  assert rows["snm_s4"].endswith("**yes** |") and not rows["snm_s8"].endswith("**yes** |")
  assert rows["ssm_s10"].endswith("**yes** |")
  assert set(large_k_probes.CHOOSING) == {"snm", "softmax", "ns"}
  assert "9.0" not in "\n".join(md)  # validation values only, never the test split's
  assert large_k_report.probes_section(None, saved) == md  # regenerated from the saved copy
  assert set(large_k_probes.PROBES) >= {"snm_s4", "snm_s8", "ssm_s10"}


def test_sweep_scales_are_the_committed_validation_choice():
  from experiments.sweeps import large_k_probes  # pylint: disable=g-import-not-at-top
  saved = json.loads((large_k.REPO / "results" / "large_k" / "probes.json").read_text())
  best = large_k_report.best_probes(saved)
  scale = {f: large_k_probes.PROBES[best[f]][1]["loss.logit_scale"] for f in large_k_probes.CHOOSING}
  assert scale == {"snm": large_k.SNM_SCALE, "softmax": large_k.SOFTMAX_SCALE, "ns": large_k.NS_SCALE}
  points = {p.name: p.overrides for p in load_sweep("experiments/sweeps/large_k.py:1e5").points}
  base = large_k.base_overrides("1e5")
  assert points["snm_k16"].get("loss.logit_scale", base["loss.logit_scale"]) == large_k.SNM_SCALE
  assert points["ssm"]["loss.logit_scale"] == large_k.SOFTMAX_SCALE
  assert points["ns"]["loss.logit_scale"] == points["b1024_ns"]["loss.logit_scale"] == large_k.NS_SCALE
  assert not base["model.normalize_classes"] and base["table.init_scale"] == 0.01


def test_mean_curve_averages_the_seeds_point_by_point():
  """The tree claim's curves: a target every seed's mean curve reaches (its max), never a seed's
  own max that another seed never reaches (that gave an infinite time to reach)."""
  a = large_k_report.calibrated(_res([0.1, 0.3, 0.5], tree_fit=2.0), ms_per_step=100.0)
  b = large_k_report.calibrated(_res([0.3, 0.5, 0.4], tree_fit=4.0), ms_per_step=100.0)
  mean = large_k_report.mean_curve([a, b], "R@5")
  assert [h["R@5"] for h in mean["history"]] == pytest.approx([0.2, 0.4, 0.45])
  assert [h["train_seconds"] for h in mean["history"]] == pytest.approx([4.0, 5.0, 6.0])
  assert mean["seconds_offset"] == pytest.approx(3.0)
  assert large_k_report.time_to_reach(mean, "R@5", 0.45) == pytest.approx(6.0)
  assert large_k_report.time_to_reach(mean, "R@5", 0.1) == pytest.approx(3.5)  # from (3 s, 0)


def test_mining_reach_reads_the_last_diagnostics_and_the_points_B():
  sweep = large_k.get_sweep("1e5")
  last = lambda rank, recall: [{"step": 1, "hardest_mined_rank_median": 1.0, "mining_recall@16": 1.0},
                               {"step": 2, "hardest_mined_rank_median": rank, "mining_recall@16": recall}]
  sec = {"sweep": sweep, "labels": {"snm_k16": "SNM top-16", "b1024_snm_k16": "SNM top-16, B=1,024"},
         "runs": {"snm_k16": {0: {"num_labels": 100_000}, 1: {"num_labels": 100_000}},
                  "b1024_snm_k16": {0: {"num_labels": 100_000}}},
         "diag": {"snm_k16": {0: last(10.0, 0.04), 1: last(20.0, 0.06)},
                  "b1024_snm_k16": {0: last(84.0, 0.01)}}}
  line = large_k_report.mining_reach(sec, "snm_k16")
  assert "B = 4,096" in line and "ranks 15 among" in line and "K / B = 24" in line
  assert "recall@k 0.050" in line and "2 seeds" in line
  small = large_k_report.mining_reach(sec, "b1024_snm_k16")
  assert "B = 1,024" in small and "ranks 84 among" in small and "K / B = 98" in small
  assert "1 seed;" in small and "recall@k 0.010" in small
  assert large_k_report.mining_reach({**sec, "diag": {}}, "snm_k16") is None
