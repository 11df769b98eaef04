r"""Bamler & Mandt's experiment: adversarial negative sampling vs its baselines,
accuracy and predictive log-likelihood against wall-clock training time.

  python -m experiments.adversarial_curves --dataset=bibtex --workdir=/tmp/adv_bibtex
  python -m experiments.adversarial_curves --dataset=synthetic --workdir=/tmp/adv_syn \
      --methods=adversarial,uniform,unigram,nce_tree

Each method is `experiments/configs/adversarial.py:<dataset>,method=<m>`; writes
curves.json, accuracy_vs_seconds.png and log_likelihood_vs_seconds.png into --out_dir
(default: --workdir).
"""

import json

from absl import app, flags

from experiments.configs import adversarial
from snm_jax.train.runtime import quiet_logs
from snm_jax.train.recipes import runs
from snm_jax.train.runtime.plots import curve, plot_learning_curves
from snm_jax.train.runtime.workpath import workdir_path

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/snm_jax_adversarial", "Run folders.")
_OUT = flags.DEFINE_string("out_dir", None, "Where curves.json and the PNGs go (default: workdir).")
_DATASET = flags.DEFINE_string("dataset", "bibtex", "bibtex | delicious | synthetic")
_METHODS = flags.DEFINE_list("methods", ["adversarial", "uniform", "unigram", "nce_tree", "softmax"],
                             "Methods of experiments/configs/adversarial.py.")
_STEPS = flags.DEFINE_integer("steps", None, "Override train.num_steps.")


def main(argv):
  del argv
  quiet_logs.install()
  root = workdir_path(_WORKDIR.value)  # local, or any URI etils.epath reads (gs://...)
  out_dir = workdir_path(_OUT.value or root)
  out_dir.mkdir(parents=True, exist_ok=True)
  results = {}
  for method in _METHODS.value:
    c = adversarial.get_config(f"{_DATASET.value},method={method}")
    if _STEPS.value:
      c.train.num_steps = _STEPS.value
    results[method] = runs.run_or_load(c, root / method, method)
  summary = {}
  for method, res in results.items():
    summary[method] = {m: dict(zip(("steps", "seconds", "values"), curve(res, m)))
                       for m in ("accuracy", "log_likelihood", "P@1")}
    summary[method]["seconds_per_step"] = res["seconds_per_step"]
  (out_dir / "curves.json").write_text(json.dumps({"dataset": _DATASET.value, "curves": summary}, indent=2))
  for metric in ("accuracy", "log_likelihood"):
    plot_learning_curves(results, metric, out_dir / f"{metric}_vs_seconds.png",
                         title=f"Adversarial vs baseline negative sampling ({_DATASET.value})")
  lines = ["| method | accuracy | log-likelihood | s/step | tree fit (s) |", "|---|---|---|---|---|"]
  for method, res in results.items():
    f = res["final"]
    fit = res.get("tree_fit_seconds")
    lines.append(f"| {method} | {f['accuracy']:.4f} | {f['log_likelihood']:.3f} | "
                 f"{res['seconds_per_step']:.4f} | {'n/a' if fit is None else f'{fit:.1f}'} |")
  (out_dir / "final.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
