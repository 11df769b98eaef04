r"""The large-K report: the papers' claims at K = 10^5 / 10^6, with verdicts.

  python -m experiments.large_k_report --workdirs=/tmp/large_k_1e5,/tmp/large_k_1e6 --out=results/large_k \
      --probes=/tmp/large_k_probes   # the hyper-parameter probes (experiments/sweeps/large_k_probes.py)

For each sweep folder (`experiments/sweeps/large_k.py:<size>`, run by `experiments.ablate`) it writes
the generic sweep report into OUT/<size>/ (`experiments.report`: tables, ratios to negative sampling,
Bayes fractions, recall curves) plus what the claims need: quality against calibrated seconds (steps x
the step time of results/large_k/step_times_<size>.json, plus the tree fit for the tree methods),
ratio to negative sampling by k, and the sampler diagnostics over training (mining recall, rank of
the hardest sampled negative, gradient SNR; read from each run's metrics.jsonl and kept in
OUT/<size>/diagnostics.json, so the committed report regenerates without the runs). OUT/report.md
gathers the key numbers and a verdict per claim, computed from them by the rules stated there.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
from absl import app, flags
from etils import epath

from experiments import report as sweep_report
from experiments.sweeps import large_k, large_k_probes
from snm_jax.train.runtime import plots
from snm_jax.train.runtime.workpath import workdir_path, write_text

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Sweep folders of large_k.py:<size> runs (or their "
                              "committed OUT/<size> copies).")
_PROBES = flags.DEFINE_string("probes", None, "Folder of the large_k_probes.py runs (or its committed "
                              "OUT/probes.json): the validation table that chose the shared settings.")
# --out is experiments.report's flag (imported above): the output folder, here results/large_k by default.
DEFAULT_OUT = "results/large_k"

CLAIM_METRICS = ("R@1", "R@5", "P@1", "P@5")
DIAG_KEYS = ("mining_recall", "hardest_mined_rank_median", "grad_snr")
# Verdict thresholds, stated in the report.
SNM_CLAIM_LOW = 1.2        # Reddi et al.: 1.2-3.0x over negative sampling
TREE_CLAIM_SPEEDUP = 10.0  # Bamler & Mandt: an order of magnitude faster to the same accuracy
BAYES_TARGET = 0.9         # the acceptance: >= 90 % of the Bayes-optimal R@5


# ---- reading -------------------------------------------------------------------

def size_of(sweep) -> str:
  return sweep.name.partition(":")[2].split(",")[0] or "1e5"


def read_diagnostics(root: epath.Path, runs: dict, saved: epath.Path) -> dict:
  """{point: {seed: [{step, diag/...}]}} from each run's metrics.jsonl, else (a run without its
  directory: an archived one, or a committed report regenerated) from the saved copy."""
  old = ({p: {int(s): v for s, v in seeds.items()} for p, seeds in json.loads(saved.read_text()).items()}
         if saved.exists() else {})
  out = {}
  for point, seeds in runs.items():
    for seed in seeds:
      f = root / point / f"seed{seed}" / "metrics.jsonl"
      if f.exists():
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        out.setdefault(point, {})[seed] = [
            {"step": r["step"], **{k[5:]: v for k, v in r.items() if k.startswith("diag/")}}
            for r in rows if any(k.startswith("diag/") for k in r)]
      elif seed in old.get(point, {}):
        out.setdefault(point, {})[seed] = old[point][seed]
  return out


def calibrated(res: dict, ms_per_step, with_fit: bool = True) -> dict:
  """A copy of a results.json whose seconds are calibrated: steps x the step time, plus the tree
  fit's measured seconds if `with_fit` (measured on the loaded machine, not calibrated).
  ms_per_step: a number, or [(start_step, ms), ...] for a run whose step time changes by phase."""
  phases = [(0, ms_per_step)] if isinstance(ms_per_step, (int, float)) else list(ms_per_step)
  offset = res.get("tree_fit_seconds", 0.0) if with_fit else 0.0

  def seconds(step):
    total = 0.0
    for i, (start, ms) in enumerate(phases):
      end = phases[i + 1][0] if i + 1 < len(phases) else math.inf
      total += max(0, min(step, end) - start) * ms / 1000
    return offset + total

  out = copy.deepcopy(res)
  for h in out.get("history", []):
    h["train_seconds"] = seconds(h["step"])
  out["train_seconds"] = seconds(res["steps"])
  out["train_seconds_excludes_eval"] = True
  out["seconds_offset"] = offset  # where its clock starts: step 0
  return out


def calibrated_runs(runs: dict, points, ms: dict) -> dict:
  """{point name: [calibrated results.json of each seed]} for the `points` (sweep Points) that ran."""
  return {p.name: [calibrated(runs[p.name][s], large_k.ms_phases(p.name, p.overrides, ms))
                   for s in sorted(runs[p.name])] for p in points if p.name in runs}


def output_folder(default: str) -> epath.Path:
  """The --out folder (experiments.report's flag; `default` when unset), created; checks --workdirs."""
  if not _WORKDIRS.value:
    raise app.UsageError("--workdirs=DIR[,DIR] is required")
  out = workdir_path(sweep_report._OUT.value or default)  # pylint: disable=protected-access
  out.mkdir(parents=True, exist_ok=True)
  return out


# ---- claims --------------------------------------------------------------------

def _stats(values) -> tuple[float, float, int]:
  return sweep_report.mean_std(values)


def time_to_reach(res: dict, metric: str, target: float) -> float:
  """First calibrated second at which the test `metric` curve reaches `target` (linear
  interpolation between evaluations); inf if it never does."""
  _, secs, vals = plots.curve(res, metric)
  prev_s, prev_v = res.get("seconds_offset", 0.0), 0.0  # step 0 scores ~0 (random rows over K labels)
  for s, v in zip(secs, vals):
    if v >= target:
      return prev_s + (s - prev_s) * ((target - prev_v) / (v - prev_v) if v > prev_v else 1.0)
    prev_s, prev_v = s, v
  return math.inf


def mean_curve(results: list[dict], metric: str) -> dict:
  """The seeds' `metric` curves averaged point by point (value, calibrated second and clock start;
  truncated to the shortest), as a results.json-like dict for `time_to_reach` / `plots.curve`."""
  curves = [plots.curve(r, metric) for r in results]
  n = min(len(c[0]) for c in curves)
  history = [{"step": curves[0][0][i], "train_seconds": float(np.mean([c[1][i] for c in curves])),
              metric: float(np.mean([c[2][i] for c in curves]))} for i in range(n)]
  return {"history": history, "steps": history[-1]["step"], "final": {metric: history[-1][metric]},
          "train_seconds": history[-1]["train_seconds"], "train_seconds_excludes_eval": True,
          "seconds_offset": float(np.mean([r.get("seconds_offset", 0.0) for r in results]))}


def snm_verdict(ratios_by_metric: dict) -> tuple[str, str]:
  """Reddi et al.'s Table 2 claim from {metric: [per-seed ratios of the best SNM to NS]}."""
  means = {m: _stats(r)[0] for m, r in ratios_by_metric.items() if r}
  if not means:
    return "not measured", "no runs"
  above = [m for m, v in means.items() if v >= SNM_CLAIM_LOW and min(ratios_by_metric[m]) > 1]
  below = [m for m, v in means.items() if v < 1 and max(ratios_by_metric[m]) < 1]
  detail = ", ".join(f"{m} {v:.2f}x" for m, v in means.items())
  if len(above) > len(means) / 2:
    return "reproduced", detail
  if len(below) > len(means) / 2:
    return "refuted", detail
  return "not reproduced", detail


def tree_verdict(speedup: float, tree_best: float, base_best: float) -> str:
  if math.isinf(speedup) or tree_best < base_best:
    return "refuted" if tree_best < base_best else "not reproduced"
  return "reproduced" if speedup >= TREE_CLAIM_SPEEDUP else "not reproduced"


# ---- figures -------------------------------------------------------------------

def plot_ratio_by_k(runs: dict, out: epath.Path, title: str) -> str | None:
  """Ratio of SNM top-k to negative sampling against k, per metric, for each B present."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  tiers = [(prefix, base) for prefix, base in (("", "ns"), ("b1024_", "b1024_ns")) if base in runs]
  if not tiers:
    return None
  fig, axes = plt.subplots(1, len(tiers), figsize=(5.5 * len(tiers), 4), squeeze=False)
  for ax, (prefix, base) in zip(axes[0], tiers):
    ks = [k for k in (1, 16, 64) if f"{prefix}snm_k{k}" in runs]
    for m in CLAIM_METRICS:
      stats = [_stats(sweep_report.ratios(runs, f"{prefix}snm_k{k}", base, m)) for k in ks]
      ax.errorbar(ks, [s[0] for s in stats], yerr=[0 if math.isnan(s[1]) else s[1] for s in stats],
                  marker="o", capsize=3, label=m)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.axhspan(SNM_CLAIM_LOW, 3.0, color="green", alpha=0.08, label="claimed 1.2-3.0x")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k (SNM top-k)")
    ax.set_ylabel("metric / negative sampling")
    ax.set_title("B = 1,024" if prefix else "B = 4,096")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(title)
  plots._save(fig, out / "ratio_by_k.png")  # pylint: disable=protected-access
  return "ratio_by_k.png"


def plot_diagnostics(diag: dict, labels: dict, out: epath.Path, title: str) -> str | None:
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  if not diag:
    return None
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
  names = {"mining_recall": "mining recall@k", "hardest_mined_rank_median":
           "median rank of the hardest sampled negative", "grad_snr": "gradient SNR (table)"}
  for point, seeds in diag.items():
    rows = [r for r in seeds.values() if r]
    if not rows:
      continue
    n = min(len(r) for r in rows)
    steps = [r["step"] for r in rows[0][:n]]
    for ax, key in zip(axes, DIAG_KEYS):
      vals = [[_diag_value(row, key) for row in r[:n]] for r in rows]
      if all(v is not None and math.isfinite(v) for vs in vals for v in vs):
        plots._band(ax, steps, vals, labels.get(point, point), marker="o", markersize=2)  # pylint: disable=protected-access
  for ax, key in zip(axes, DIAG_KEYS):
    ax.set_xlabel("training step")
    ax.set_ylabel(names[key])
    ax.grid(alpha=0.3)
  axes[1].set_yscale("log")
  axes[2].set_yscale("log")
  fig.suptitle(title)
  plots._save(fig, out / "diagnostics.png", legend_ax=axes[0])  # pylint: disable=protected-access
  return "diagnostics.png"


def last_diagnostics(diag: dict, point: str) -> list[dict]:
  """The last diagnostics row of each of the point's seeds that logged any."""
  return [rows[-1] for rows in diag.get(point, {}).values() if rows]


def _diag_value(row: dict, key: str):
  if key == "mining_recall":
    return next((v for k, v in row.items() if k.startswith("mining_recall@")), None)
  return row.get(key)


# ---- one size -------------------------------------------------------------------

def size_section(root: epath.Path, out_root: epath.Path) -> tuple[list[str], dict]:
  sweep, runs, failed = sweep_report.load(root)
  size = size_of(sweep)
  out = out_root / size
  out.mkdir(parents=True, exist_ok=True)
  sweep_report.write_report(root, out)
  ms = large_k.step_times(size)
  labels = {p.name: p.label for p in sweep.points}
  diag = read_diagnostics(root, runs, out / "diagnostics.json")
  write_text(out / "diagnostics.json", json.dumps(diag, indent=1))

  points = [p for p in sweep.points if p.name in runs]
  phases = {p.name: large_k.ms_phases(p.name, p.overrides, ms) for p in points}
  cal = {labels[name]: seeds for name, seeds in calibrated_runs(runs, points, ms).items()}
  plots.plot_learning_curves_over_seeds(
      cal, "R@5", out / "quality_vs_seconds.png", title=f"{sweep.title}: test R@5",
      seconds_label="calibrated training seconds (steps x measured step time; + tree fit)")
  figures = {"Test R@5 against steps and calibrated seconds": "quality_vs_seconds.png"}
  for caption, fn in (("Ratio of SNM top-k to negative sampling, by k", plot_ratio_by_k),):
    f = fn(runs, out, sweep.title)
    if f:
      figures[caption] = f
  f = plot_diagnostics(diag, labels, out, f"{sweep.title}: sampler diagnostics (probe of 64 points)")
  if f:
    figures["Sampler diagnostics over training"] = f

  num_labels = next(iter(next(iter(runs.values())).values()))["num_labels"]
  md = [f"## K = {num_labels:,}", "", f"Full sweep report: [{size}/report.md]({size}/report.md).", ""]
  head = ["method", "seeds", "steps", "calibrated s", *CLAIM_METRICS, "PSP@5", "R@5 / Bayes",
          "R@5 / NS", "P@1 / NS"]
  rows = []
  for p in points:
    rs = list(runs[p.name].values())
    base = "b1024_ns" if p.name.startswith("b1024_") else "ns"
    row = [p.label, len(rs), rs[0]["steps"], f"{calibrated(rs[0], phases[p.name])['train_seconds']:.0f}"]
    row += [sweep_report.fmt([r["final"][m] for r in rs]) for m in (*CLAIM_METRICS, "PSP@5")]
    row += [sweep_report.fmt([r["final"]["R@5"] / r["final"]["bayes/R@5"] for r in rs], 3)]
    row += [sweep_report.fmt(sweep_report.ratios(runs, p.name, base, m), 2) if base in runs else "-"
            for m in ("R@5", "P@1")]
    rows.append(row)
  md += sweep_report._table(head, rows) + [""]  # pylint: disable=protected-access
  if diag:
    md += ["Sampler diagnostics at the last evaluation (mean over seeds): mining recall@k (fraction of "
           "the k hardest negatives over all K that the mined set holds), median rank of the hardest "
           "sampled negative among all K, gradient SNR of the class table over 8 negative draws.", ""]
    drows = []
    for p in points:
      last = last_diagnostics(diag, p.name)
      if last:
        drows.append([p.label] + [sweep_report.fmt([_diag_value(x, k) for x in last], 3) for k in DIAG_KEYS])
    md += sweep_report._table(["method", "mining recall", "hardest rank (median)", "grad SNR"],  # pylint: disable=protected-access
                              drows) + [""]
  for caption, f in figures.items():
    md += [f"**{caption}**", "", f"![{caption}]({size}/{f})", ""]
  if failed:
    md += [f"Failed runs: {json.dumps(failed)}", ""]
  return md, {"size": size, "runs": runs, "ms": ms, "labels": labels, "cal": cal, "diag": diag,
              "sweep": sweep}


def mining_reach(sec: dict, point: str) -> str | None:
  """One line on how deep uniform mining reaches at this K and B: the hardest of B uniform draws
  from K labels ranks on the order of K / B among all K (median ~ ln 2 K / B), so at a fixed B the
  mined negatives are less hard as K grows. Measured: the last evaluation's median rank of the
  hardest sampled negative and the mining recall@k (mean over seeds)."""
  last = last_diagnostics(sec["diag"], point)
  if not last:
    return None
  p = next(q for q in sec["sweep"].points if q.name == point)
  b = sec["sweep"].run_overrides(p, 0)["mining.num_samples"]
  k = next(iter(sec["runs"][point].values()))["num_labels"]
  rank = np.mean([_diag_value(x, "hardest_mined_rank_median") for x in last])
  recall = np.mean([_diag_value(x, "mining_recall") for x in last])
  return (f"- **Mining reach, {sec['labels'][point]}:** the hardest of its B = {b:,} sampled negatives "
          f"ranks {rank:.0f} among all K at the last evaluation (median over the probe, mean over "
          f"{len(last)} seed{'s' if len(last) > 1 else ''}; K / B = {k / b:.0f}), mining recall@k "
          f"{recall:.3f}.")


def claims_section(sections: list[dict]) -> list[str]:
  md = ["## Verdicts", "",
        f"Rules. Reddi et al. (SNM beats negative sampling by 1.2-3.0x on R@k / P@k): *reproduced* if, for "
        f"most of {', '.join(CLAIM_METRICS)}, the best SNM top-k's per-seed ratio to negative sampling "
        f"(same B, same seed) averages >= {SNM_CLAIM_LOW} with every seed > 1; *refuted* if for most "
        "of them every seed is < 1; else *not reproduced*. Bamler & Mandt (the adversarial tree reaches "
        "uniform negative sampling's accuracy an order of magnitude faster): the speed-up is the "
        "calibrated time uniform negative sampling (their Eq. 2, same draws per example) needs to reach "
        "its best test R@5, over the time the tree needs to reach it (mean curves over seeds; tree fit "
        f"included); *reproduced* if >= {TREE_CLAIM_SPEEDUP:.0f}x, *refuted* if the tree never reaches it, "
        f"else *not reproduced*. Acceptance: the best method's R@5 >= {BAYES_TARGET:.0%} of the "
        "Bayes-optimal R@5.", ""]
  for sec in sections:
    runs, labels = sec["runs"], sec["labels"]
    md += [f"### K = {sec['size']}", ""]
    for prefix, base in (("", "ns"), ("b1024_", "b1024_ns")):
      snms = [f"{prefix}snm_k{k}" for k in (1, 16, 64) if f"{prefix}snm_k{k}" in runs]
      if base not in runs or not snms:
        continue
      best = max(snms, key=lambda p: _stats(sweep_report.ratios(runs, p, base, "R@5"))[0])
      verdict, detail = snm_verdict({m: sweep_report.ratios(runs, best, base, m) for m in CLAIM_METRICS})
      n_seeds = len(sweep_report.ratios(runs, best, base, "R@5"))
      if n_seeds < 3:
        verdict += f" (provisional: {n_seeds} seed{'s' if n_seeds > 1 else ''} of 3)"
      by_k = "; ".join(f"k={p.rsplit('k', 1)[1]}: R@1 {_stats(sweep_report.ratios(runs, p, base, 'R@1'))[0]:.2f}x"
                       for p in snms)
      md.append(f"- **SNM vs negative sampling, B = {'1,024' if prefix else '4,096'}: {verdict}.** Best "
                f"k by R@5 ratio: {labels[best]} ({detail}); by k: {by_k}.")
      reach = mining_reach(sec, f"{prefix}snm_k16")
      if reach:
        md.append(reach)
    for tree, base in (("tree_s64", "uniform_s64"),):
      if tree in runs and base in runs:
        cal = sec["cal"]
        base_mean = mean_curve(cal[labels[base]], "R@5")
        tree_mean = mean_curve(cal[labels[tree]], "R@5")
        target = max(plots.curve(base_mean, "R@5")[2])
        t_base = time_to_reach(base_mean, "R@5", target)
        t_tree = time_to_reach(tree_mean, "R@5", target)
        t_nofit = time_to_reach(mean_curve([calibrated(runs[tree][s], sec["ms"][tree], with_fit=False)
                                            for s in sorted(runs[tree])], "R@5"), "R@5", target)
        fit = np.mean([r.get("tree_fit_seconds", 0.0) for r in runs[tree].values()])
        tree_best = max(plots.curve(tree_mean, "R@5")[2])
        speedup = t_base / t_tree if t_tree > 0 else math.inf
        verdict = tree_verdict(speedup, tree_best, target)
        n_seeds = min(len(runs[tree]), len(runs[base]))
        if n_seeds < 3:
          verdict += f" (provisional: {n_seeds} seed{'s' if n_seeds > 1 else ''} of 3)"
        md.append(f"- **Adversarial tree vs uniform negative sampling (Eq. 6 vs Eq. 2, 64 draws per "
                  f"example): {verdict}.** Uniform's best test R@5 "
                  f"{target:.4f} reached after {t_base:.0f} s of training; the tree "
                  + (f"reaches it after {t_tree:.0f} s ({speedup:.1f}x), of which {fit:.0f} s are its fit "
                     f"(measured on the loaded machine; training alone: {t_nofit:.0f} s, "
                     f"{t_base / max(t_nofit, 1e-9):.0f}x)" if math.isfinite(t_tree)
                     else "never reaches it") + f"; the tree's best R@5 {tree_best:.4f}.")
    fracs = {p: _stats([r["final"]["R@5"] / r["final"]["bayes/R@5"] for r in seeds.values()])[0]
             for p, seeds in runs.items()}
    best = max(fracs, key=fracs.get)
    target = (f"{'meets' if fracs[best] >= BAYES_TARGET else 'misses'} the {BAYES_TARGET:.0%} target"
              if sec["size"] == "1e5" else f"the {BAYES_TARGET:.0%} target is set at K = 10^5")
    md.append(f"- **Best method vs Bayes-optimal R@5: {labels[best]} reaches {fracs[best]:.1%}** ({target}).")
    md.append("")
  return md


def _chosen_mark(family: str, best: bool) -> str:
  if not best:
    return ""
  return "**yes**" if family in large_k_probes.CHOOSING else "best of its family (a check, sets nothing)"


def best_probes(rows: dict) -> dict[str, str]:
  """{family: the probe with the best validation R@5} of rows {probe: [(step, val R@5), ...]}."""
  best = {}
  for name, curve in rows.items():
    family = large_k_probes.PROBES[name][0]
    if family not in best or max(v for _, v in curve) > max(v for _, v in rows[best[family]]):
      best[family] = name
  return best


def probes_section(root: epath.Path | None, saved: epath.Path) -> list[str]:
  """The hyper-parameter probes (large_k_probes.py): each probe's validation R@5 by step, and the
  family's choice. Reads root/<probe>/seed0/results.json (kept in `saved`), else `saved`."""
  rows = {}
  for name in large_k_probes.PROBES:
    f = root / name / "seed0" / "results.json" if root is not None else None
    if f is not None and f.exists():
      rows[name] = [(h["step"], h["val/R@5"]) for h in json.loads(f.read_text())["history"]]
  if rows:
    write_text(saved, json.dumps(rows, indent=1))
  elif saved.exists():
    rows = {k: [tuple(x) for x in v] for k, v in json.loads(saved.read_text()).items()}
  if not rows:
    return []
  best = best_probes(rows)
  steps = sorted({s for curve in rows.values() for s, _ in curve})
  md = ["## Shared settings, chosen on validation", "",
        f"`experiments/sweeps/large_k_probes.py`: {large_k_probes.PROBE_STEPS} steps of the K = 10^5 problem, "
        "seed 0, each probe judged by its best **validation** R@5 (the test split is not read to choose); "
        f"the best of each of the families {', '.join(large_k_probes.CHOOSING)} sets that family's points in "
        "`large_k.py` (snm: the SNM top-k points, chosen on top-16; ns: negative sampling, the baseline, "
        "tuned on its own).", "",
        "| probe | family | " + " | ".join(f"val R@5 @ {s}" for s in steps) + " | chosen |",
        "|---|---|" + "---|" * len(steps) + "---|"]
  for name, curve in rows.items():
    family = large_k_probes.PROBES[name][0]
    by_step = dict(curve)
    md.append(f"| {name} | {family} | " + " | ".join(f"{by_step[s]:.4f}" if s in by_step else "" for s in steps)
              + f" | {_chosen_mark(family, best[family] == name)} |")
  return md + [""]


def main(argv):
  del argv
  out = output_folder(DEFAULT_OUT)
  body, sections = [], []
  for root in _WORKDIRS.value:
    md, sec = size_section(workdir_path(root), out)
    body += md
    sections.append(sec)
  done = sum(min(len(sec["runs"].get(p, {})), 3) for sec in sections for p in sec["labels"])
  planned = sum(len(sec["labels"]) * 3 for sec in sections)
  intro = ["# Large K: the papers' claims where they are made", "",
           (f"Status: all {planned} runs finished." if done == planned else
            f"Status: {done} of {planned} runs finished (the sweep resumes where it stopped; methods "
            "missing below have not run yet, so their claims are not judged)."), "",
           "Synthetic data with a known p(y|x) (`snm_jax.data.synthetic`), every method trained for the "
           "same calibrated time (`experiments/sweeps/large_k.py`, whose docstring says how), 3 seeds "
           "per point where done. Regenerate: `python -m experiments.large_k_report --workdirs=... --out=results/large_k`.",
           ""]
  probes = probes_section(workdir_path(_PROBES.value) if _PROBES.value else None, out / "probes.json")
  path = out / "report.md"
  write_text(path, "\n".join(intro + claims_section(sections) + probes + body) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
