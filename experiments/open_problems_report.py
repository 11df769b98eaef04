r"""The SNM paper's two open problems, measured: adaptive sample size and mined sampled softmax.

  python -m experiments.open_problems_report --workdirs=/tmp/large_k_1e5 --out=results/open_problems

Reads the K = 10^5 large-K sweep (`experiments/sweeps/large_k.py`: its fixed-B SNM points, the
adaptive-B point, sampled softmax and mined sampled softmax; 3 seeds, equal calibrated time) or its
committed copy (results/large_k/1e5), and writes OUT/report.md with, per question, the metrics, paired
per-seed differences, quality against steps and calibrated seconds, the step cost, and a verdict by
the rule stated in the report.
"""

from __future__ import annotations

import json

from absl import app

from experiments import large_k_report
from experiments import report as sweep_report
from experiments.sweeps import large_k
from snm_jax.train.runtime import plots
from snm_jax.train.runtime.workpath import workdir_path, write_text

# --workdirs (the large_k.py:1e5 sweep folder, or its committed copy) and --out are the flags of
# experiments.large_k_report and experiments.report, imported above.
_WORKDIRS = large_k_report._WORKDIRS  # pylint: disable=protected-access
DEFAULT_OUT = "results/open_problems"
METRICS = ("R@5", "R@1", "P@1", "P@5", "PSP@5")

# (question, baseline point, compared points)
QUESTIONS = (
    ("Adaptive sample size (Reddi et al. Sec. 7): grow B during training",
     "snm_k16", ("b1024_snm_k16", "snm_k16_adaptive")),
    ("Mined sampled softmax (SNM for a coupled loss): softmax over the positive and the top-k of B draws",
     "ssm", ("msm_k16", "msm_k64")),
)


def paired(runs: dict, point: str, base: str, metric: str) -> list[float]:
  """metric(point, seed) - metric(base, seed) over the seeds both have."""
  return [r["final"][metric] - runs[base][s]["final"][metric]
          for s, r in sorted(runs.get(point, {}).items()) if s in runs.get(base, {})]


def verdict(diffs: list[float]) -> str:
  """'helps' / 'hurts' if every seed's paired R@5 difference has that sign (and there are at
  least 3 seeds), else 'no measurable difference' (or 'not enough seeds')."""
  if len(diffs) < 3:
    return f"not enough seeds ({len(diffs)})"
  if all(d > 0 for d in diffs):
    return "helps"
  if all(d < 0 for d in diffs):
    return "hurts"
  return "no measurable difference"


def render(runs: dict, points_of: dict, ms: dict, out) -> list[str]:
  labels = {n: p.label for n, p in points_of.items()}
  md = ["# Open problems of Reddi et al. (2019), measured at K = 10^5", "",
        "Setting: the large-K sweep at K = 100,000 (`results/large_k/report.md`): synthetic data with a "
        "known p(y|x), every method trained for the same calibrated time, the state with the best "
        "validation R@5 reported on test. Verdict rule: *helps* / *hurts* when the paired (same seed) "
        "test R@5 difference to the baseline has the same sign on every one of >= 3 seeds; otherwise *no "
        "measurable difference*. Cost: the calibrated step time (`results/large_k/step_times_1e5.json`).", ""]
  for i, (question, base, points) in enumerate(QUESTIONS):
    present = [p for p in (base, *points) if p in runs]
    md += [f"## {question}", ""]
    if base not in runs or len(present) < 2:
      md += [f"Not measured yet: runs present {present} (the sweep resumes where it stopped).", ""]
      continue
    head = ["method", "seeds", "ms / step", "steps", *METRICS, "R@5 - baseline (per seed)", "verdict"]
    rows = []
    for p in present:
      rs = [runs[p][s] for s in sorted(runs[p])]
      diffs = paired(runs, p, base, "R@5")
      cost = " -> ".join(f"{m:.2f}" for _, m in large_k.ms_phases(p, points_of[p].overrides, ms))
      rows.append([labels[p], len(rs), cost, rs[0]["steps"],
                   *[sweep_report.fmt([r["final"][m] for r in rs]) for m in METRICS],
                   "baseline" if p == base else ", ".join(f"{d:+.4f}" for d in diffs),
                   "" if p == base else verdict(diffs)])
    md += sweep_report._table(head, rows) + [""]  # pylint: disable=protected-access
    cal = {labels[name]: seeds for name, seeds in
           large_k_report.calibrated_runs(runs, [points_of[p] for p in present], ms).items()}
    fig = f"question{i + 1}.png"
    plots.plot_learning_curves_over_seeds(cal, "R@5", out / fig, title=question,
                                          seconds_label="calibrated training seconds")
    md += [f"![{question}]({fig})", ""]
  return md


def main(argv):
  del argv
  out = large_k_report.output_folder(DEFAULT_OUT)
  sweep, runs, _ = sweep_report.load(workdir_path(_WORKDIRS.value[0]))
  size = large_k_report.size_of(sweep)
  ms = large_k.step_times(size)
  path = out / "report.md"
  write_text(path, "\n".join(render(runs, {p.name: p for p in sweep.points}, ms, out)) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
