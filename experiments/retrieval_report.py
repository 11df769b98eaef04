"""The SOPRC retrieval experiment's summary and table (experiments/auprc_retrieval.py):
per-seed rows read from each run's workdir, mean ± std over seeds, results.md."""
from __future__ import annotations

import json

import numpy as np

from snm_jax.train.runtime.workpath import workdir_path


def run_row(results: dict, run_dir, seed: int) -> dict:
  """One run's row: its test metrics (results.json "final"), `train_time_s` (the loop's
  train_seconds: compilation included, evaluation excluded) and the first / last logged
  training loss of metrics.jsonl (nan when nothing was logged)."""
  losses = []
  path = workdir_path(run_dir) / "metrics.jsonl"
  if path.exists():
    losses = [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]
  row = {"first_loss": losses[0] if losses else float("nan"),
         "final_loss": losses[-1] if losses else float("nan"),
         "train_time_s": results["train_seconds"], **results["final"], "seed": seed}
  return row


def summarise(per_seed: list[dict]) -> dict:
  """{"per_seed", "mean", "std"} over seeds of every float field (std with ddof=0)."""
  keys = [k for k in per_seed[0] if isinstance(per_seed[0][k], float)]
  return {"per_seed": per_seed,
          "mean": {k: float(np.mean([r[k] for r in per_seed])) for k in keys},
          "std": {k: float(np.std([r[k] for r in per_seed])) for k in keys}}


def markdown_table(results: dict) -> str:
  """The Table-1-style report: mean ± std over seeds, in percent."""
  cfg = results["config"]
  tr, m = cfg["train"], cfg["auprc"]["samples_per_class"]
  lines = [
      "# SOPRC retrieval results (issue 7)", "",
      f"Command: `{results['command']}`  ",
      f"Seeds: {list(cfg['seeds'])}; {tr['num_steps']} {cfg['optimizer']['name']} steps "
      f"(lr {cfg['optimizer']['learning_rate']}) per run on class-balanced batches of "
      f"{tr['batch_size']} = {tr['batch_size'] // m} classes x {m}; tower: MLP "
      f"{cfg['model']['hidden']} -> {cfg['model']['out']}, L2-normalised (cosine scores); "
      f"SOPRC aux vector updated {cfg['auprc']['soprc']['aux_update'].replace('_', ' ')}.  ",
      f"Machine: {results['machine']['platform']}, {results['machine']['cpu_count']} CPUs, "
      f"jax {results['machine']['jax']}; total {results.get('runtime_s', 0.0):.0f} s.", "",
      "mAUPRC = mean over test queries of the average precision of the ranking of all "
      "other test points (relevance = same category); R@k = fraction of queries with a "
      "same-category item among the k nearest. Values are mean ± std over seeds, in %. "
      "`train s` is the training time per run including compilation, evaluation excluded.", ""]
  for task_name, task in results["tasks"].items():
    ks = [k for k in task["methods"]["untrained"]["mean"] if k.startswith("recall@")]
    lines += [f"## {task_name}", "", task["description"] + f"; {task['num_queries']} queries.", "",
              "| method | mAUPRC | " + " | ".join(k.replace("recall", "R") for k in ks)
              + " | train s |",
              "|---" * (len(ks) + 3) + "|"]
    for method, r in task["methods"].items():
      cells = [f"{100 * r['mean'][k]:.2f} ± {100 * r['std'][k]:.2f}" for k in ["map"] + ks]
      lines.append(f"| {method} | " + " | ".join(cells)
                   + f" | {r['mean'].get('train_time_s', 0.0):.1f} |")
    methods = task["methods"]
    if "soprc" in methods and "soprc_sg" in methods:
      diffs = [100 * (b["map"] - a["map"]) for a, b in
               zip(methods["soprc"]["per_seed"], methods["soprc_sg"]["per_seed"])]
      lines += ["", "Stop-gradient through h(x+) in the denominator (authors' code) minus "
                f"the paper's formula, mAUPRC per seed: {', '.join(f'{d:+.2f}' for d in diffs)}."]
    lines.append("")
  return "\n".join(lines)
