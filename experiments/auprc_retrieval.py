r"""SOPRC on retrieval: mAUPRC and Recall@k of an embedding tower (issue 7).

  python -m experiments.auprc_retrieval --workdir=/tmp/auprc_retrieval \
      --config.results_dir=results/auprc
  python -m experiments.auprc_retrieval --workdir=/tmp/auprc_tiny \
      --config=experiments/configs/auprc_retrieval.py:runlocal

Every (task, method, seed) of the config's grid is one run of the one training loop
(config.task="retrieval", snm_jax/train/trainer/retrieval.py) in workdir/runs/<task>/<method>/seed<s>:
finished runs are reused, interrupted ones resume from their checkpoints. "untrained" (the
initial tower) is always evaluated. Writes results.json and results.md (the table).
"""
import json
import os
import pathlib
import platform
import sys
import time

from absl import app, flags
import jax
from ml_collections import config_flags

from experiments import retrieval_report as report
from experiments.configs.auprc_retrieval import run_config
from snm_jax.train.config import validation
from snm_jax.train.recipes import runs
from snm_jax.train.runtime.workpath import workdir_path

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "auprc_retrieval.py")


def run_experiment(config, workdir) -> dict:
  """Runs (or reuses) every (task, method, seed); writes results.json and results.md."""
  workdir, start = workdir_path(workdir), time.time()  # local, or a URI (gs://...)
  results = {"command": " ".join(["python -m experiments.auprc_retrieval"] + sys.argv[1:]),
             "config": config.to_dict(), "tasks": {},
             "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                         "jax": jax.__version__, "backend": jax.default_backend()}}
  methods = ("untrained",) + tuple(m for m in config.methods if m != "untrained")
  grid = {(t, m, s): run_config(config, t, m, s) for t in config.tasks for m in methods
          for s in config.seeds}
  for run in grid.values():  # every run's config is checked before anything trains
    validation.validate(run)
  for task in config.tasks:
    per_method = {}
    for method in methods:
      rows = []
      for seed in config.seeds:
        run_dir = workdir / "runs" / task / method / f"seed{seed}"
        out = runs.run_or_load(grid[task, method, seed], run_dir, f"{task}/{method}/seed{seed}")
        rows.append(report.run_row(out, run_dir, seed))
      per_method[method] = report.summarise(rows)
    results["tasks"][task] = {
        **{k: out[k] for k in ("description", "num_train", "num_test", "num_train_classes")},
        "num_queries": per_method["untrained"]["per_seed"][0]["num_queries"],
        "methods": per_method}
  results["runtime_s"] = time.time() - start
  for d in [workdir] + ([pathlib.Path(config.results_dir)] if config.results_dir else []):
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (d / "results.md").write_text(report.markdown_table(results))
  return results


def main(argv):
  del argv
  if not flags.FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  results = run_experiment(flags.FLAGS.config, flags.FLAGS.workdir)
  print(report.markdown_table(results))


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Path to a get_config() file[:variant].",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Run directory (per-run workdirs, tables).")
  app.run(main)
