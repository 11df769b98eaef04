r"""Tables and figures of a sweep from its runs' results.json files.

  python -m experiments.report /tmp/t2_bibtex
  python -m experiments.report /tmp/t2_bibtex --out=results/table2_bibtex

Reads DIR/sweep.json (written by experiments.ablate) and every
DIR/<point>/seed<s>/results.json; without run directories it reads
DIR/summary.json instead, so a committed summary regenerates its report.
Writes into --out (default DIR): report.md, summary.json (the runs' results,
no checkpoints) and PNGs:
  metrics table (mean +- std over seeds) and ratios to the sweep's baseline
  (per-seed ratio, then mean +- std: Table 2 of Reddi et al. 2019);
  model vs Bayes-optimal R@k on synthetic data;
  recall@r per Head / Torso / Tail subpopulation (Tables 3/4 of Rawat et al.
  2021) and recall@r-vs-r curves; Head / Tail accuracy for single-label data;
  learning curves vs step and vs seconds; the cost per step.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
from absl import app, flags
from etils import epath

from experiments.sweeps.spec import Point, Sweep, load_sweep, merge_sweeps, read_archive, summary_runs
from snm_jax.train.runtime import plots
from snm_jax.train.runtime.workpath import workdir_path, write_text

_OUT = flags.DEFINE_string("out", None, "Output folder (default: the sweep directory).")

RECALL_R = (1, 5, 10, 20, 50, 100)
SUBPOPULATIONS = ("head", "torso", "tail")


# ---- loading -----------------------------------------------------------------

def load(root) -> tuple[Sweep, dict, dict]:
  """-> (sweep, runs {point: {seed: results}}, failed {point: {seed: message}}).

  Runs come from DIR/<point>/seed<s>/results.json and, for the (point, seed) pairs without a run
  directory, from DIR/archive.json (runs finished on another machine: a report's summary.json
  copied in, `read_archive`). Without either, DIR/summary.json (a committed report's copy) is read.
  """
  root = workdir_path(root)  # local, or any URI etils.epath reads (gs://...)
  summary = root / "summary.json"
  sweep_file = root / "sweep.json"
  run_files = sorted(root.glob("*/seed*/results.json"))
  fail_files = sorted(root.glob("*/seed*/failed.json"))
  archived_sweep, archived = read_archive(root)
  if not run_files and not fail_files and not archived and summary.exists():
    s = json.loads(summary.read_text())
    return Sweep.from_json(s["sweep"]), summary_runs(s, "runs"), summary_runs(s, "failed")
  if not run_files and not fail_files and not archived:
    raise FileNotFoundError(f"no <point>/seed<s>/results.json, archive.json or summary.json under {root}")
  if sweep_file.exists():
    sweep = Sweep.from_json(json.loads(sweep_file.read_text()))
    if archived_sweep is not None:  # the points run here (perhaps a few, --only) join the archived ones
      sweep = merge_sweeps(archived_sweep, sweep)
  elif archived_sweep is not None:
    sweep = archived_sweep
  else:  # Runs launched by hand: one point per sub-directory, no baseline.
    names = sorted({f.parent.parent.name for f in run_files + fail_files})
    sweep = Sweep(title=f"runs under {root}", config="?", points=tuple(Point(n, {}) for n in names))
  runs = {p: dict(seeds) for p, seeds in archived.items()}
  failed = {}
  for f in run_files:
    point, seed = f.parent.parent.name, _seed(f.parent.name)
    res = json.loads(f.read_text())
    res.pop("truncation", None)
    runs.setdefault(point, {})[seed] = res
  for f in fail_files:
    if not (f.parent / "results.json").exists():
      failed.setdefault(f.parent.parent.name, {})[_seed(f.parent.name)] = (
          json.loads(f.read_text()).get("message", "failed"))
  return sweep, runs, failed


def _seed(dirname: str) -> int:
  m = re.fullmatch(r"seed(\d+)", dirname)
  return int(m.group(1)) if m else -1


# ---- statistics ----------------------------------------------------------------

def mean_std(values) -> tuple[float, float, int]:
  """Mean, sample std (ddof=1; nan for one value) and count of finite values."""
  v = np.asarray([x for x in values if x is not None and math.isfinite(x)], np.float64)
  if v.size == 0:
    return float("nan"), float("nan"), 0
  return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else float("nan"), int(v.size)


def fmt(values, digits: int = 4) -> str:
  m, s, n = mean_std(values)
  if n == 0:
    return "-"
  return f"{m:.{digits}f}" if n == 1 else f"{m:.{digits}f} ± {s:.{digits}f}"


def ratios(runs: dict, point: str, baseline: str, metric: str) -> list[float]:
  """metric(point, seed) / metric(baseline, seed) over the seeds both have."""
  out = []
  for seed, res in runs.get(point, {}).items():
    base = runs.get(baseline, {}).get(seed)
    if base is not None and base["final"].get(metric, 0) > 0:
      out.append(res["final"][metric] / base["final"][metric])
  return out


def steady_seconds_per_step(res: dict) -> float:
  """Training seconds per step after the first evaluation point.

  results.json's seconds_per_step divides all training time, compilation
  included, by the steps; here the interval from the first history point
  (compilation behind it) to the end is used, minus the evaluations in it for
  runs whose clock included them (`plots.excludes_eval`). Falls back to
  seconds_per_step without history.
  """
  hist = res.get("history", [])
  if not hist or res["steps"] <= hist[0]["step"]:
    return res["seconds_per_step"]
  evals = 0.0 if plots.excludes_eval(res) else sum(h.get("eval_seconds", 0.0) for h in hist[1:])
  return (plots.total_train_seconds(res) - hist[0]["train_seconds"] - evals) / (
      res["steps"] - hist[0]["step"])


def class_accuracy(final: dict) -> dict:
  """Head / Tail / overall accuracy of single-label data from recall@1.

  Head pools the Head and Torso pairs (frequency thirds of the classes): on
  the downsampled digits the Tail third is exactly the downsampled classes.
  """
  def r1(sub):
    return final[f"recall@r/{sub}"][0], final.get(f"num_pairs/{sub}", 0)
  head = [r1(s) for s in ("head", "torso") if f"recall@r/{s}" in final]
  n_head = sum(n for _, n in head)
  out = {"all": final["recall@r"][0]}
  if n_head:
    out["head"] = sum(r * n for r, n in head) / n_head
  if "recall@r/tail" in final:
    out["tail"] = final["recall@r/tail"][0]
  return out


# ---- markdown ------------------------------------------------------------------

def _table(header, rows) -> list[str]:
  return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
          + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _points(sweep: Sweep, runs: dict) -> list[Point]:
  return [p for p in sweep.points if p.name in runs]


def _final(runs, point, key):
  return [r["final"][key] for r in runs[point].values() if key in r["final"]]


def _validation(runs, point, key):
  """`val/<key>` of each seed's evaluation at its selected step (runs with a validation split)."""
  out = []
  for r in runs[point].values():
    step = r.get("selected", {}).get("step")
    at = [h for h in r.get("history", []) if h.get("step") == step and f"val/{key}" in h]
    out += [at[-1][f"val/{key}"]] if at else []
  return out


def _recall(runs, point, sub):
  key = "recall@r" if sub == "all" else f"recall@r/{sub}"
  return [r["final"][key] for r in runs[point].values() if key in r["final"]]


def _default_config(sweep_arg: str) -> str | None:
  try:
    return load_sweep(sweep_arg).config
  except (FileNotFoundError, ValueError, SyntaxError, ImportError):  # Renamed or edited since.
    return None


def render(sweep: Sweep, runs: dict, failed: dict, figures: dict) -> str:
  points = _points(sweep, runs)
  any_run = next(iter(runs[points[0].name].values()))
  metrics = [m for m in sweep.table_metrics if m in any_run["final"]]
  seeds = sorted({s for p in runs.values() for s in p})
  stem, _, arg = sweep.name.partition(":")
  sweep_arg = f"experiments/sweeps/{stem}.py" + (f":{arg}" if arg else "")
  md = [f"# {sweep.title}", ""]
  if sweep.notes:
    md += [sweep.notes, ""]
  md += [f"- config: `{sweep.config}`; data: {any_run['dataset']} (K = {any_run['num_labels']})",
         f"- overrides for every run: `{json.dumps(sweep.base_overrides)}`",
         f"- seeds: {seeds} (seed sets {', '.join(f'`{f}`' for f in sweep.seed_fields)}); "
         f"cells are mean ± std (sample std over seeds) when there are several seeds",
         f"- reproduce: `python -m experiments.ablate --sweep={sweep_arg} "
         + (f"--config={sweep.config} " if sweep.config != _default_config(sweep_arg) else "")
         + "--workdir=DIR && python -m experiments.report DIR`", ""]
  md += ["| point | overrides | seeds done |", "|---|---|---|"]
  for p in sweep.points:
    done = sorted(runs.get(p.name, {}))
    bad = sorted(failed.get(p.name, {}))
    state = f"{done}" + (f"; failed {bad}" if bad else "")
    md.append(f"| {p.label} | `{json.dumps(p.overrides)}` | {state} |")
  md.append("")
  for p, seeds_failed in failed.items():
    for s, msg in seeds_failed.items():
      md.append(f"- **{p} seed {s} failed**: {msg}")
  if failed:
    md.append("")

  if any(_validation(runs, p.name, m) for p in points for m in metrics):
    md += ["## Validation metrics (at each run's selected step: what a choice may read)", ""]
    md += _table(["point"] + metrics, [[p.label] + [fmt(_validation(runs, p.name, m)) for m in metrics]
                                       for p in points])
    md.append("")
  md += ["## Final test metrics", ""]
  md += _table(["point"] + metrics, [[p.label] + [fmt(_final(runs, p.name, m)) for m in metrics]
                                     for p in points])
  md.append("")
  if sweep.baseline and sweep.baseline in runs:
    base = next(p for p in sweep.points if p.name == sweep.baseline)
    md += [f"## Ratio to {base.label}", "",
           "Each metric divided by the baseline's on the same seed; mean ± std over seeds.", ""]
    md += _table(["point"] + metrics,
                 [[p.label] + [fmt(ratios(runs, p.name, base.name, m), 2) for m in metrics]
                  for p in points])
    md.append("")
  if "bayes/R@5" in any_run["final"]:
    md += ["## Model vs the Bayes-optimal predictor (synthetic data)", ""]
    rows = []
    for p in points:
      frac = [r["final"]["R@5"] / r["final"]["bayes/R@5"] for r in runs[p.name].values()]
      rows.append([p.label] + [fmt(_final(runs, p.name, k)) for k in
                               ("P@1", "bayes/P@1", "R@5", "bayes/R@5")] + [fmt(frac, 3)])
    md += _table(["point", "P@1", "Bayes P@1", "R@5", "Bayes R@5", "R@5 / Bayes R@5"], rows)
    md.append("")
  if sweep.class_accuracy:
    md += ["## Head / Tail accuracy", "",
           "Accuracy = recall@1 of the test points of the Head (and Torso) classes and of the "
           "Tail classes; per-seed Tail accuracies listed by seed.", ""]
    rows = []
    for p in points:
      acc = {s: class_accuracy(r["final"]) for s, r in sorted(runs[p.name].items())}
      rows.append([p.label, fmt([a["head"] for a in acc.values()], 3),
                   fmt([a["tail"] for a in acc.values()], 3),
                   fmt([a["all"] for a in acc.values()], 3),
                   ", ".join(f"{a['tail']:.3f}" for a in acc.values())])
    md += _table(["point", "Head acc", "Tail acc", "overall acc", "Tail acc per seed"], rows)
    md.append("")

  r_max = len(any_run["final"]["recall@r"])
  rs = [r for r in RECALL_R if r <= r_max]
  md += ["## Retrieval recall@r per subpopulation", "",
         "Test (x, y) pairs split by the training frequency of y: Head = labels above the 2/3 "
         "quantile of the training counts, Tail = at or below the 1/3 quantile "
         "(Rawat et al. 2021). Pairs per subpopulation (first run): "
         + ", ".join(f"{s} {any_run['final'].get(f'num_pairs/{s}', 0)}" for s in SUBPOPULATIONS)
         + ".", ""]
  rows = []
  for sub in ("all",) + SUBPOPULATIONS:
    for p in points:
      curves = _recall(runs, p.name, sub)
      if curves:
        rows.append([sub, p.label] + [fmt([c[r - 1] for c in curves]) for r in rs])
  md += _table(["subpopulation", "point"] + [f"recall@{r}" for r in rs], rows)
  md.append("")

  md += ["## Cost per step", "",
         "Steady-state training seconds per step (after the first evaluation point: compilation "
         "and evaluations excluded), the loop's own seconds_per_step (compilation included), "
         "mean evaluation time and wall time of a run. All runs shared 2 CPU cores with other "
         "jobs, so absolute times are noisy.", ""]
  rows = []
  for p in points:
    rs_ = list(runs[p.name].values())
    rows.append([p.label, fmt([steady_seconds_per_step(r) for r in rs_]),
                 fmt([r["seconds_per_step"] for r in rs_]),
                 fmt([r["final"].get("eval_seconds", float("nan")) for r in rs_], 2),
                 fmt([r["wall_seconds"] for r in rs_], 0), rs_[0]["steps"]])
  md += _table(["point", "s/step (steady)", "s/step (all)", "eval s", "wall s", "steps"], rows)
  md.append("")

  md += ["## Figures", ""]
  for caption, file in figures.items():
    md += [f"**{caption}**", "", f"![{caption}]({file})", ""]
  return "\n".join(md)


# ---- figures -------------------------------------------------------------------

def make_figures(sweep: Sweep, runs: dict, out: epath.Path) -> dict:
  points = _points(sweep, runs)
  figs = {}
  title = sweep.title
  seeds_of = {p.label: [runs[p.name][s] for s in sorted(runs[p.name])] for p in points}
  metric = sweep.curve_metric
  plots.plot_learning_curves_over_seeds(seeds_of, metric, out / "learning_curves.png",
                                        title=f"{title}\ntest {metric} during training")
  figs[f"Learning curves (test {metric} vs step and vs training seconds)"] = "learning_curves.png"

  curves = {p.label: {sub: _recall(runs, p.name, sub) for sub in ("all",) + SUBPOPULATIONS
                      if _recall(runs, p.name, sub)} for p in points}
  plots.plot_recall_curves(curves, out / "recall_curves.png",
                           title=f"{title}\nrecall@r per subpopulation (mean ± std over seeds)")
  figs["recall@r vs r per subpopulation"] = "recall_curves.png"

  if sweep.baseline and sweep.baseline in runs:
    base = next(p for p in sweep.points if p.name == sweep.baseline)
    metrics = [m for m in ("P@1", "P@5", "R@1", "R@5", "nDCG@5", "PSP@5")
               if m in sweep.table_metrics]
    values = {m: {p.label: ratios(runs, p.name, base.name, m) for p in points
                  if p.name != base.name} for m in metrics}
    plots.plot_grouped_bars(values, out / "ratios.png", ylabel=f"metric / {base.label}",
                            title=f"{title}\nratio to {base.label} (bars: mean ± std; dots: seeds)",
                            reference=1.0)
    figs[f"Ratio of each metric to {base.label}"] = "ratios.png"

  if sweep.class_accuracy:
    values = {}
    for sub, name in (("head", "Head accuracy"), ("tail", "Tail accuracy"), ("all", "overall")):
      values[name] = {p.label: [class_accuracy(r["final"])[sub] for r in runs[p.name].values()]
                      for p in points}
    plots.plot_grouped_bars(values, out / "class_accuracy.png", ylabel="test accuracy",
                            title=f"{title}\n(bars: mean ± std over seeds; dots: seeds)")
    figs["Head / Tail accuracy"] = "class_accuracy.png"

  values = {"training s/step": {p.label: [steady_seconds_per_step(r) for r in runs[p.name].values()]
                                for p in points}}
  plots.plot_grouped_bars(values, out / "cost_per_step.png", ylabel="seconds per training step",
                          title=f"{title}\nsteady-state cost per step (2 shared CPU cores)")
  figs["Cost per training step"] = "cost_per_step.png"
  return figs


def write_report(root, out=None) -> epath.Path:
  """Writes report.md, summary.json and the figures; returns the report's path."""
  sweep, runs, failed = load(root)
  if not runs:
    raise FileNotFoundError(f"no finished run under {root} (failed: {failed})")
  out = workdir_path(out or root)
  out.mkdir(parents=True, exist_ok=True)
  figures = make_figures(sweep, runs, out)
  write_text(out / "summary.json", json.dumps(
      {"sweep": sweep.to_json(), "runs": runs, "failed": failed}, indent=1))
  path = out / "report.md"
  write_text(path, render(sweep, runs, failed, figures) + "\n")
  return path


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python -m experiments.report DIR [--out=OUT]")
  path = write_report(argv[1], _OUT.value)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
