r"""The README's main job: SNM top-1 and top-16 vs negative sampling on Bibtex, and the xmc recipe.

  python -m experiments.demo --workdir=/tmp/snm_jax_demo

Trains the three methods of Table 2 of Reddi et al. (2019) -- SNM top-1 and top-16 (BOWL, hinge,
B = 64 uniform negatives) and negative sampling -- on the same tower with the same budget and
checkpoint selection (experiments/configs/default.py: the recipe's SNM tower, 1024/512, dropout 0.5,
scores x20, batch / steps / learning rate derived from the data, the checkpoint chosen on validation
nDCG@5, without default.py's refit on the whole training file to save time; only the loss differs),
and the library's extreme-classification recipe
(experiments/configs/xmc.py: settings derived from the data, candidates chosen on a validation split of
the training file), evaluates them on the test split,
prints each method's metrics and their ratio to negative sampling, with the
peers measured by benchmarks/quality_peers.py (results/quality/peers.json) as
reference rows, and writes `demo_table.md`, `demo_results.json` and
`learning_curves.png` into --workdir. Bibtex is read from ../shared/data when
present, else from the copy bundled in the package. Finished runs are reused
when the command is repeated; interrupted ones resume.
"""

import json
from pathlib import Path

from absl import app, flags, logging

from experiments import compile_cache_flag
from experiments.configs import default, xmc
from snm_jax.train.runtime import member_devices, quiet_logs
from snm_jax.train.recipes import runs
from snm_jax.train.runtime.plots import plot_learning_curves
from snm_jax.train.runtime.workpath import workdir_path



def _define_flags():
  """Defined only when run as a program (tests import this module beside other absl apps)."""
  flags.DEFINE_string("workdir", "/tmp/snm_jax_demo", "Output folder.")
  flags.DEFINE_integer("steps", None, "Override train.num_steps of every method.")
  flags.DEFINE_string("dataset", None, "Override dataset.name (default: bibtex).")


# The Table 2 methods on default.py's tower: the papers' SNM loss (BOWL with the hinge) over B = 64
# uniform negatives (the papers' Bibtex setting, snm.py:bibtex) in place of default.py's softmax.
# Without default.py's refit (the selected checkpoint is scored): the methods compared at ~0.6x the time.
SNM_LOSS = {"loss.kind": "bowl", "loss.phi": "hinge", "mining.sampler": "uniform",
            "mining.num_samples": 64, "recipe.refit": False}
METHODS = {
    "SNM top-1": {**SNM_LOSS, "mining.vartheta": "top_k", "mining.k": 1},
    "SNM top-16": {**SNM_LOSS, "mining.vartheta": "top_k", "mining.k": 16},
    "negative sampling": {**SNM_LOSS, "mining.vartheta": "negative_sampling"},
}
RECIPE = "xmc recipe"
METRICS = ("P@1", "P@3", "P@5", "R@1", "R@3", "R@5", "nDCG@5", "PSP@5")
PEERS_FILE = Path(__file__).resolve().parents[1] / "results" / "quality" / "peers.json"
PEER_ROWS = {"pecos_xrlinear": "PECOS XR-Linear", "napkinxc_plt": "napkinXC PLT",
             "ovr_linearsvc_valC": "one-vs-rest LinearSVC (C on validation)"}


def method_config(overrides, one_device: bool = False):
  c = default.get_config()
  for key, value in overrides.items():
    section, field = key.split(".")
    c[section][field] = value
  if flags.FLAGS.steps is not None:
    c.train.num_steps = flags.FLAGS.steps
  if flags.FLAGS.dataset is not None:
    c.dataset.name = flags.FLAGS.dataset
  if one_device:
    # The process has one CPU device per core for the recipe's members (main), which mesh.shape
    # (-1, 1) would turn into data parallelism over the cores.
    c.mesh.shape = (1, 1)
  return c


def recipe_config():
  return xmc.get_config(flags.FLAGS.dataset or "bibtex")


def peer_rows(dataset: str) -> tuple[dict, str]:
  """{row name: metrics} of the peers measured on `dataset` by benchmarks/quality_peers.py, and a note."""
  if not PEERS_FILE.exists():
    return {}, f"(no peer reference rows: {PEERS_FILE} not found)"
  peers = json.loads(PEERS_FILE.read_text())
  methods = peers["results"].get(dataset, {}).get("methods", {})
  rows = {f"{label} [reference, v{methods[key]['version']}]": methods[key]["metrics"]
          for key, label in PEER_ROWS.items() if methods.get(key, {}).get("status") == "ok"}
  note = (f"Rows marked [reference] were not trained here: measured by benchmarks/quality_peers.py on "
          f"{peers['date'][:10]} (same splits, features, metrics; fit on the whole training file).")
  return rows, note


def table(results: dict, references: dict) -> str:
  base = results["negative sampling"]["final"]
  head = "| method | " + " | ".join(METRICS) + " | s/step |"
  lines = [head, "|" + "---|" * (len(METRICS) + 2)]
  rows = [(name, res["final"], f"{res['seconds_per_step']:.3f}") for name, res in results.items()]
  rows += [(name, metrics, "") for name, metrics in references.items()]
  for name, f, cost in rows:
    cells = [f"{f[m]:.4f} ({f[m] / base[m]:.2f}x)" if base[m] > 0 else f"{f[m]:.4f}" for m in METRICS]
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {cost} |")
  return "\n".join(lines)


def main(argv):
  del argv
  quiet_logs.install()
  compile_cache_flag.enable()
  core_devices = member_devices.request_cpu_devices(recipe_config())  # the recipe's members: one core each
  root = workdir_path(flags.FLAGS.workdir)  # local, or any URI etils.epath reads (gs://...)
  root.mkdir(parents=True, exist_ok=True)
  results = {}
  for name, overrides in METHODS.items():
    results[name] = runs.run_or_load(method_config(overrides, one_device=core_devices > 0),
                                     root / name.replace(" ", "_").replace("-", ""), name)
  results[RECIPE] = runs.run_or_load(recipe_config(), root / "xmc_recipe", RECIPE)
  dataset = next(iter(results.values()))["dataset"]
  references, note = peer_rows(dataset)
  chosen = results[RECIPE]["recipe"]["chosen"]
  md = (f"Dataset: {dataset} (test split). Each cell: value (ratio to negative sampling).\n\n"
        + table(results, references) + "\n\n"
        + f"The xmc recipe chose candidate `{chosen}` on its validation split; its s/step is that "
          f"candidate's. {note}\n")
  (root / "demo_table.md").write_text(md)
  (root / "demo_results.json").write_text(json.dumps(results, indent=2))
  # The rows evaluate on their validation split while training (test only at the chosen checkpoint).
  plot_learning_curves({n: r for n, r in results.items() if n != RECIPE}, "val/P@1",
                       root / "learning_curves.png",
                       title=(f"Bibtex-style Table 2 demo ({dataset}): validation P@1 "
                              "(10% of the training file)"))
  print("\n" + md)
  print(f"Wrote {root / 'demo_table.md'} and {root / 'learning_curves.png'}")
  logging.info("demo done")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
