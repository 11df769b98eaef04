r"""The README's main job: SNM top-1 and top-16 vs negative sampling on Bibtex.

  python -m experiments.demo --workdir=/tmp/snm_jax_demo

Trains the three methods of Table 2 of Reddi et al. (2019) with the same
budget (experiments/configs/default.py), evaluates them, prints each method's
metrics and their ratio to negative sampling, and writes `demo_table.md`,
`demo_results.json` and `learning_curves.png` into --workdir. Bibtex is read
from ../shared/data when present, else from the copy bundled in the package.
Finished runs are reused when the command is repeated; interrupted ones resume.
"""

import json
from pathlib import Path

from absl import app, flags, logging

from experiments.configs import default
from snm_jax.train import quiet_logs, runs
from snm_jax.train.plots import plot_learning_curves

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/snm_jax_demo", "Output folder.")
_STEPS = flags.DEFINE_integer("steps", None, "Override train.num_steps of every method.")
_DATASET = flags.DEFINE_string("dataset", None, "Override dataset.name (default: bibtex).")

METHODS = {
    "SNM top-1": {"mining.k": 1},
    "SNM top-16": {"mining.k": 16},
    "negative sampling": {"mining.vartheta": "negative_sampling"},
}
METRICS = ("P@1", "P@3", "P@5", "R@1", "R@3", "R@5", "nDCG@5", "PSP@5")


def method_config(overrides):
  c = default.get_config()
  for key, value in overrides.items():
    section, field = key.split(".")
    c[section][field] = value
  if _STEPS.value is not None:
    c.train.num_steps = _STEPS.value
  if _DATASET.value is not None:
    c.dataset.name = _DATASET.value
  return c


def table(results: dict) -> str:
  base = results["negative sampling"]["final"]
  head = "| method | " + " | ".join(METRICS) + " | s/step |"
  lines = [head, "|" + "---|" * (len(METRICS) + 2)]
  for name, res in results.items():
    f = res["final"]
    cells = [f"{f[m]:.4f} ({f[m] / base[m]:.2f}x)" if base[m] > 0 else f"{f[m]:.4f}" for m in METRICS]
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {res['seconds_per_step']:.3f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  quiet_logs.install()
  root = Path(_WORKDIR.value)
  root.mkdir(parents=True, exist_ok=True)
  results = {}
  for name, overrides in METHODS.items():
    results[name] = runs.run_or_load(method_config(overrides),
                                     root / name.replace(" ", "_").replace("-", ""), name)
  dataset = next(iter(results.values()))["dataset"]
  md = (f"Dataset: {dataset}. Each cell: value (ratio to negative sampling).\n\n" + table(results) + "\n")
  (root / "demo_table.md").write_text(md)
  (root / "demo_results.json").write_text(json.dumps(results, indent=2))
  plot_learning_curves({n: r for n, r in results.items()}, "P@1", root / "learning_curves.png",
                       title=f"Bibtex-style Table 2 demo ({dataset})")
  print("\n" + md)
  print(f"Wrote {root / 'demo_table.md'} and {root / 'learning_curves.png'}")
  logging.info("demo done")


if __name__ == "__main__":
  app.run(main)
