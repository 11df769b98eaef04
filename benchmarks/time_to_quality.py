r"""Time to quality: the xmc recipe against the linear extreme-classification tools, in one run.

  python -m benchmarks.time_to_quality --datasets=bibtex,delicious \
      --out=results/benchmarks/time_to_quality.json    # also .md and .png next to it

Per dataset, interleaved on the same machine:
  recipe, cold   `python -m experiments.train --config=experiments/configs/xmc.py:<dataset>` in a
                 fresh process with an EMPTY persistent compilation cache: the wall seconds a user
                 waits, start-up, data loading, compilation and every evaluation included;
  peers          PECOS XR-Linear, napkinXC PLT, one-vs-rest LinearSVC with C tuned on a validation
                 split (benchmarks/quality_peers.py; each where installed, else recorded as
                 unavailable), fit + predict seconds;
  recipe, warm   the same command again in a new workdir, the cache now filled;
  sequential     (--sequential=<datasets>) the recipe as before candidate groups: every candidate of every
                 split one after the other, no successive halving (recipe.group=False,
                 recipe.halving=0), with the warm cache.
Reported: wall seconds, test P@1 / P@5 / PSP@5, the ratio of the recipe's wall seconds to
PECOS's fit, and the wall second at which the recipe's best candidate (split 0) first reaches
PECOS's P@1 on the recipe's own validation split (PECOS refitted on the recipe's training part
for that). The figure plots each run's best validation P@1 so far against wall seconds.
The test split is read by the recipe only for the final model (candidates and ensembles are
chosen on validation), by the peers for their test metrics.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from absl import app, flags

from benchmarks import quality_peers

_DATASETS = flags.DEFINE_list("datasets", ["bibtex", "delicious"], "Datasets (XC format, found by name).")
_OUT = flags.DEFINE_string("out", "results/benchmarks/time_to_quality.json", "Output JSON (.md, .png beside).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/snm_jax_time_to_quality", "Run folders (deleted first).")
_PEERS = flags.DEFINE_list("peers", ["pecos_xrlinear", "napkinxc_plt", "ovr_linearsvc_valC"],
                           "Peer methods (benchmarks/quality_peers.py FITTERS).")
_PECOS_PYTHON = flags.DEFINE_string("pecos_python", "", "Interpreter with libpecos (quality_peers).")
_SEQUENTIAL = flags.DEFINE_list("sequential", [], "Datasets on which to also time the one-by-one "
                                 "recipe (slow).")

METRICS = ("P@1", "P@5", "PSP@5")


def run_recipe(dataset: str, workdir: pathlib.Path, cache: pathlib.Path, extra=()) -> dict:
  """One recipe run in a fresh process; its wall seconds, test metrics and validation curve."""
  shutil.rmtree(workdir, ignore_errors=True)
  cmd = [sys.executable, "-m", "experiments.train", f"--config=experiments/configs/xmc.py:{dataset}",
         f"--workdir={workdir}", f"--compilation_cache={cache}", *extra]
  t0 = time.time()
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  wall = time.time() - t0
  if proc.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
  results = json.loads((workdir / "results.json").read_text())
  # (seconds since start, validation P@1) of every split-0 candidate evaluation; candidate groups'
  # histories carry their wall time, one-by-one runs' (recipe.group=False) do not: no curve for those
  curve = []
  for path in glob.glob(str(workdir / "candidates" / "*" / "results.json")):
    for h in json.loads(pathlib.Path(path).read_text()).get("history", []):
      if "time" in h and "val/P@1" in h:
        curve.append((h["time"] - t0, h["val/P@1"]))
  return {"command": " ".join(cmd[1:]), "wall_seconds": wall,
          "test": {m: results["final"][m] for m in METRICS},
          "chosen": results["recipe"]["chosen"], "ensemble_m": results["recipe"].get("ensemble", {}).get("m"),
          "eliminated": [e["name"] for e in results["recipe"].get("eliminated", [])],
          "curve": sorted(curve)}


def pecos_validation_p1(dataset: str) -> tuple[float, float]:
  """PECOS XR-Linear fitted on the recipe's training part, P@1 on its validation split (split 0),
  and its fit seconds."""
  from experiments.configs import xmc  # pylint: disable=g-import-not-at-top
  from snm_jax import data as snm_data  # pylint: disable=g-import-not-at-top
  from snm_jax.train.trainer.run_data import load_run_data  # pylint: disable=g-import-not-at-top
  rd = load_run_data(xmc.get_config(dataset))
  train = snm_data.XCDataset(features=rd.train.features, labels=rd.train.labels, name=dataset, split="train")
  val = snm_data.XCDataset(features=rd.validation.features, labels=rd.validation.labels, name=dataset,
                           split="validation")
  pred, info = quality_peers.fit_pecos(train, val, python=_PECOS_PYTHON.value)
  metrics = quality_peers.evaluate_topk(pred, val.labels, quality_peers.propensities_for(train))
  return metrics["P@1"], info["fit_seconds"]


def first_passing(curve, target: float) -> float | None:
  return next((t for t, v in curve if v >= target), None)


def run_dataset(dataset: str, root: pathlib.Path) -> dict:
  cache = root / f"xla_cache_{dataset}"
  shutil.rmtree(cache, ignore_errors=True)
  out = {"dataset": dataset}
  print(f"[{dataset}] recipe, cold cache", flush=True)
  out["recipe_cold"] = run_recipe(dataset, root / dataset / "cold", cache)
  train, test = quality_peers.load_normalized(dataset)
  peers = quality_peers.run_dataset(train, test, _PEERS.value, pecos_python_path=_PECOS_PYTHON.value)
  out["peers"] = {name: ({"wall_seconds": r["fit_seconds"] + r.get("predict_seconds", 0.0),
                          "fit_seconds": r["fit_seconds"], "test": {m: r["metrics"][m] for m in METRICS},
                          "version": r.get("version")} if r["status"] == "ok" else r)
                  for name, r in peers["methods"].items()}
  print(f"[{dataset}] recipe, warm cache", flush=True)
  out["recipe_warm"] = run_recipe(dataset, root / dataset / "warm", cache)
  if dataset in _SEQUENTIAL.value:
    print(f"[{dataset}] recipe, one candidate after another", flush=True)
    out["recipe_sequential"] = run_recipe(dataset, root / dataset / "sequential", cache,
                                          ("--config.recipe.group=False", "--config.recipe.halving=0"))
  pecos = out["peers"].get("pecos_xrlinear", {})
  if "fit_seconds" in pecos:
    try:
      val_p1, fit_s = pecos_validation_p1(dataset)
      out["pecos_validation"] = {"P@1": val_p1, "fit_seconds": fit_s}
      for run in ("recipe_cold", "recipe_warm"):
        out[run]["seconds_to_pecos_validation_p1"] = first_passing(out[run]["curve"], val_p1)
    except Exception as e:  # pylint: disable=broad-except
      out["pecos_validation"] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
    for run in ("recipe_cold", "recipe_warm"):
      out[run]["ratio_to_pecos_fit"] = out[run]["wall_seconds"] / pecos["fit_seconds"]
  return out


def render(payload: dict) -> str:
  lines = [f"Time to quality, {payload['date']} ({payload['machine']}); generated by "
           "`python -m benchmarks.time_to_quality`.", "",
           "| dataset | method | wall s | x PECOS fit | test P@1 | P@5 | PSP@5 | s to PECOS's val P@1 |",
           "|---|---|---|---|---|---|---|---|"]
  for d in payload["datasets"]:
    pecos_fit = d["peers"].get("pecos_xrlinear", {}).get("fit_seconds")
    rows = [(k.replace("_", " "), d[k]) for k in ("recipe_cold", "recipe_warm", "recipe_sequential") if k in d]
    rows += [(name, r) for name, r in d["peers"].items()]
    for name, r in rows:
      if "wall_seconds" not in r:
        lines.append(f"| {d['dataset']} | {name} | {r.get('status')}: {r.get('reason', '')[:80]} | | | | | |")
        continue
      ratio = f"{r['wall_seconds'] / pecos_fit:.0f}x" if pecos_fit else ""
      reach = r.get("seconds_to_pecos_validation_p1")
      if reach is None and r.get("curve") and "P@1" in d.get("pecos_validation", {}):
        best = max((v for _, v in r["curve"]), default=float("nan"))
        reach = f"not reached (best {100 * best:.2f} < {100 * d['pecos_validation']['P@1']:.2f})"
      elif reach is not None:
        reach = f"{reach:.0f}"
      lines.append(f"| {d['dataset']} | {name} | {r['wall_seconds']:.1f} | {ratio} | "
                   + " | ".join(f"{100 * r['test'][m]:.2f}" for m in METRICS) + f" | {reach or ''} |")
  return "\n".join(lines) + "\n"


def plot(payload: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  datasets = payload["datasets"]
  fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
  for ax, d in zip(axes[0], datasets):
    for run in ("recipe_cold", "recipe_warm", "recipe_sequential"):
      if run in d and d[run]["curve"]:
        best, xs, ys = 0.0, [], []
        for t, v in d[run]["curve"]:
          best = max(best, v)
          xs.append(t)
          ys.append(best)
        ax.step(xs, ys, where="post", label=run.replace("_", " "))
    if "P@1" in d.get("pecos_validation", {}):
      ax.axhline(d["pecos_validation"]["P@1"], color="k", ls="--", lw=0.8, label="PECOS, validation P@1")
    for name, r in d["peers"].items():
      if "wall_seconds" in r:
        ax.axvline(r["wall_seconds"], ls=":", lw=0.8, color="gray")
        ax.text(r["wall_seconds"], ax.get_ylim()[0], f" {name}", rotation=90, fontsize=7, va="bottom")
    ax.set_xscale("log")
    ax.set_xlabel("wall seconds since the recipe started")
    ax.set_ylabel("best validation P@1 so far (split 0)")
    ax.set_title(d["dataset"])
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  root = pathlib.Path(_WORKDIR.value)
  root.mkdir(parents=True, exist_ok=True)
  payload = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores",
             "datasets": [run_dataset(d, root) for d in _DATASETS.value]}
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(payload, indent=2))
  out.with_suffix(".md").write_text(render(payload))
  plot(payload, str(out.with_suffix(".png")))
  print(render(payload))


if __name__ == "__main__":
  app.run(main)
