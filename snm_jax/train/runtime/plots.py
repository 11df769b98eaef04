"""Figures of runs and sweeps (matplotlib, headless).

Curves over seeds are drawn as the mean with a +-1 std band; bar charts show
the mean, a +-1 std error bar and each seed as a dot.
"""

from __future__ import annotations

import io
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker  # noqa: E402  pylint: disable=g-import-not-at-top
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=g-import-not-at-top
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top
from etils import epath  # noqa: E402  pylint: disable=g-import-not-at-top

from snm_jax.train.runtime import workpath  # noqa: E402  pylint: disable=g-import-not-at-top

SUBPOPULATIONS = ("all", "head", "torso", "tail")
_STYLES = ("-", "--", ":")  # Past the 10 colours of the default cycle.


def total_train_seconds(result: dict) -> float:
  """Training seconds of a results.json (`train_seconds_this_run` in files of older versions)."""
  return result.get("train_seconds", result.get("train_seconds_this_run"))


def _ends_with_last_step(result: dict, history: list) -> bool:
  """Whether the history holds the last step's evaluation. Older results.json
  files kept it only in `final`; newer ones log it in the history, and their
  `final` is the (validation-)selected state, which may be an earlier one."""
  return bool(history) and history[-1]["step"] == result["steps"]


def curve(result: dict, metric: str):
  """(steps, seconds, values) of `metric` from a results.json dict, over training."""
  history = [h for h in result.get("history", []) if metric in h]
  points = [(h["step"], h["train_seconds"], h[metric]) for h in history]
  if not _ends_with_last_step(result, history):
    points.append((result["steps"], total_train_seconds(result), result["final"][metric]))
  steps, secs, vals = zip(*points)
  return list(steps), list(secs), list(vals)


def excludes_eval(result: dict) -> bool:
  """Whether the run's `train_seconds` already leave out the periodic evaluations.

  True for results.json files of the current loop; runs of the earlier loop
  (whose training clock kept running through evaluations) carry
  "train_seconds_excludes_eval": false.
  """
  return result.get("train_seconds_excludes_eval", True)


def train_only_curve(result: dict, metric: str):
  """Like `curve`, with the evaluation time out of the seconds axis.

  Runs whose clock included the periodic evaluations (`excludes_eval` False)
  have each history point's `eval_seconds` subtracted, which leaves training
  (and compilation) time only.
  """
  history = [h for h in result.get("history", []) if metric in h]
  subtract = not excludes_eval(result)
  steps, secs, vals, spent = [], [], [], 0.0
  for h in history:
    spent += h.get("eval_seconds", 0.0) if subtract else 0.0
    steps.append(h["step"])
    secs.append(h["train_seconds"] - spent)
    vals.append(h[metric])
  if not _ends_with_last_step(result, history):
    steps.append(result["steps"])
    secs.append(total_train_seconds(result) - spent)
    vals.append(result["final"][metric])
  return steps, secs, vals


def _save(fig, path, legend_ax=None) -> epath.Path:
  """Saves to `path`, local or remote (gs://..., written whole: `workpath.write_bytes`); with
  `legend_ax`, its legend goes in one row band under the panels. Returns the path."""
  if legend_ax is None:
    fig.tight_layout()
  else:
    handles, labels = legend_ax.get_legend_handles_labels()
    ncol = min(len(labels), 4)
    rows = -(-len(labels) // ncol)
    band = (0.06 + 0.045 * rows) * 4.4 / fig.get_figheight()
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, band, 1, 1))
  path = workpath.workdir_path(path)
  buffer = io.BytesIO()
  fig.savefig(buffer, dpi=120, format=path.suffix.lstrip(".") or None)
  plt.close(fig)
  workpath.write_bytes(path, buffer.getvalue())
  return path


def _band(ax, x, ys, label, **kw):
  ys = np.asarray(ys, np.float64)
  mean = ys.mean(0)
  line, = ax.plot(x, mean, label=label, **kw)
  if ys.shape[0] > 1:
    std = ys.std(0, ddof=1)
    ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.18, linewidth=0)
  return line


def plot_learning_curves(results: dict, metric: str, path, title: str = "") -> epath.Path:
  """Two panels: `metric` vs training step and vs training wall-clock seconds."""
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for name, res in results.items():
    steps, secs, vals = curve(res, metric)
    axes[0].plot(steps, vals, marker="o", label=name)
    axes[1].plot(secs, vals, marker="o", label=name)
  axes[0].set_xlabel("training step")
  axes[1].set_xlabel("training time (s, wall clock)")
  for ax in axes:
    ax.set_ylabel(f"test {metric}")
    ax.grid(alpha=0.3)
    ax.legend()
  if title:
    fig.suptitle(title)
  return _save(fig, path)


def plot_learning_curves_over_seeds(runs: dict, metric: str, path, title: str = "",
                                    seconds_label: str = "training time (s, wall clock, evaluation "
                                    "excluded; mean over seeds)") -> epath.Path:
  """`metric` vs step and vs training seconds (evaluation excluded), mean +- std over seeds.

  Args:
    runs: {label: [results.json dict of each seed]}; the seeds of one label
      share their evaluation steps.
    seconds_label: the x label of the seconds panel (what the results' train_seconds are).
  """
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
  for j, (label, seeds) in enumerate(runs.items()):
    curves = [train_only_curve(r, metric) for r in seeds]
    n = min(len(c[0]) for c in curves)
    steps = curves[0][0][:n]
    vals = [c[2][:n] for c in curves]
    secs = np.mean([c[1][:n] for c in curves], axis=0)
    style = _STYLES[j // 10 % 3]
    line = _band(axes[0], steps, vals, label, marker="o", markersize=3, linestyle=style)
    _band(axes[1], secs, vals, label, marker="o", markersize=3, color=line.get_color(),
          linestyle=style)
  axes[0].set_xlabel("training step")
  axes[1].set_xlabel(seconds_label)
  for ax in axes:
    ax.set_ylabel(f"test {metric}")
    ax.grid(alpha=0.3)
  fig.suptitle(_wrap(title or f"learning curves ({metric})", 110))
  return _save(fig, path, legend_ax=axes[0])


def plot_recall_curves(curves: dict, path, title: str = "") -> epath.Path:
  """recall@r vs r, one panel per subpopulation (all, head, torso, tail).

  Args:
    curves: {label: {subpopulation: (num_seeds, r_max) array-like}}.
  """
  present = [s for s in SUBPOPULATIONS if any(s in c for c in curves.values())]
  fig, axes = plt.subplots(1, len(present), figsize=(4.2 * len(present), 4.2), squeeze=False)
  for ax, sub in zip(axes[0], present):
    top = 0.0
    for j, (label, by_sub) in enumerate(curves.items()):
      if sub in by_sub:
        ys = np.asarray(by_sub[sub], np.float64)
        _band(ax, np.arange(1, ys.shape[1] + 1), ys, label, linestyle=_STYLES[j // 10 % 3])
        top = max(top, float(np.nanmax(ys)))
    r_max = max(np.asarray(c[sub]).shape[-1] for c in curves.values() if sub in c)
    if r_max >= 20:
      ax.set_xscale("log")
      ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("r (number of retrieved labels)")
    ax.set_ylabel("recall@r")
    ax.set_title("all test pairs" if sub == "all" else f"{sub.capitalize()} labels")
    ax.set_ylim(0, min(1.02, 1.1 * top + 0.01))  # Own scale per panel: Tail recall is often small.
    ax.grid(alpha=0.3, which="both")
  if title:
    fig.suptitle(_wrap(title, 120))
  return _save(fig, path, legend_ax=axes[0][0])


def plot_grouped_bars(values: dict, path, ylabel: str, title: str = "",
                      reference: float | None = None, log: bool = False) -> epath.Path:
  """Grouped bars: mean +- std over seeds with each seed as a dot.

  Args:
    values: {group (x tick): {label (bar colour): [per-seed values]}}; with a
      single group the labels become the x ticks.
    reference: draws a dashed horizontal line there (e.g. 1 for ratios).
  """
  groups = list(values)
  labels = list(dict.fromkeys(lab for g in groups for lab in values[g]))
  single = len(groups) == 1
  n_bars = len(labels) * (1 if single else len(groups))
  width = 0.8 if single else 0.8 / max(len(labels), 1)
  fig, ax = plt.subplots(figsize=(min(16, max(6.5, 0.55 * n_bars + 3)), 4.8))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for j, label in enumerate(labels):
    if single:
      xs = [j]
    else:
      xs = np.arange(len(groups)) + (j - (len(labels) - 1) / 2) * width
    legend_label = label
    for x, g in zip(xs, groups):
      v = np.asarray(values[g].get(label, []), np.float64)
      if v.size == 0:
        continue
      err = v.std(ddof=1) if v.size > 1 else 0.0
      ax.bar(x, v.mean(), width * 0.9, yerr=err, capsize=3, color=colors[j % len(colors)],
             label=legend_label, alpha=0.85)
      legend_label = None
      ax.plot(np.full(v.size, x), v, "k.", markersize=5)
  if reference is not None:
    ax.axhline(reference, color="k", linestyle="--", linewidth=1)
  if single:
    ax.set_xticks(np.arange(len(labels)))
    long = max(len(l) for l in labels) * len(labels) > 60
    ax.set_xticklabels(labels, rotation=25 if long else 0, ha="right" if long else "center")
    ax.set_xlabel(groups[0])
  else:
    ax.set_xticks(np.arange(len(groups)))
    ax.set_xticklabels(groups)
  ax.set_ylabel(ylabel)
  if log:
    ax.set_yscale("log")
  ax.grid(alpha=0.3, axis="y")
  if title:
    fig.suptitle(_wrap(title), fontsize=11)
  return _save(fig, path, legend_ax=None if single else ax)


def _wrap(title: str, width: int = 80) -> str:
  return "\n".join(textwrap.fill(line, width) for line in title.split("\n"))
