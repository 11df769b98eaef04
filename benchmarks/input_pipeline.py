r"""The input side at scale: throughput of both input paths, host memory against data size, and
conversion speed.

  python -m benchmarks.input_pipeline --out=results/benchmarks/input_pipeline.json   # also .md

(a) Throughput: examples/s one process builds (fixed-shape batches of G = 512, the next batch
    pulled as soon as the last one is handed over), for rows in memory and read from ArrayRecord
    shards, with Grain worker processes 0 / 1 / 2 (one read thread each), on Bibtex's rows (nnz ~ 70,
    d = 1,836) and on the W2 benchmark's rows (nnz 64 of d = 200,000, synthetic); next to the
    train step's own consumption on the same rows (`experiments.train`'s steady steps/s x G for
    the papers' SNM tower, `default.py:paper`), so one sees whether input can be the bottleneck.
    Each configuration is timed in --rounds interleaved rounds; the median is reported.
(b) Host memory: the peak RSS of `experiments.train` (a fresh process, `os.wait4`'s ru_maxrss)
    training --steps steps on synthetic data of 10^6 and of 10^7 examples through the sharded
    path, and of the 10^6 set through the in-memory path (the same rows as `dataset.name=files`).
(c) Conversion: rows/s of `experiments.convert` for the synthetic sets (generation included).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from absl import app, flags
import numpy as np
import scipy.sparse as sp

_OUT = flags.DEFINE_string("out", "results/benchmarks/input_pipeline.json", "JSON output (.md beside it).")
_DATA = flags.DEFINE_string("data_root", "/tmp/snm_jax_input_bench", "Where the converted sets are written.")
_SIZES = flags.DEFINE_list("memory_sizes", ["1000000", "10000000"], "Examples of the RSS runs.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps of each RSS run.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved timing rounds of (a).")
_BATCHES = flags.DEFINE_integer("batches", 40, "Batches per throughput measurement.")

REPO = pathlib.Path(__file__).resolve().parents[1]
G = 512
W2 = dict(num_features=200_000, num_labels=10_000, nnz=64)


def _convert(out: pathlib.Path, args: list[str]) -> dict:
  if (out / "metadata.json").exists():
    return json.loads((out / "convert.json").read_text())
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "experiments.convert", f"--out={out}", *args], cwd=REPO,
                        capture_output=True, text=True, check=True)
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  summary["wall_seconds"] = time.perf_counter() - t0
  (out / "convert.json").write_text(json.dumps(summary))
  return summary


def _throughput(make, batches: int) -> float:
  """examples/s of `batches` batches from a fresh batcher (its start-up included once)."""
  b = make()
  next(b)  # start the threads / workers
  t0 = time.perf_counter()
  n = 0
  for _ in range(batches):
    n += int(next(b)["valid"].sum())
  seconds = time.perf_counter() - t0
  b.close()
  return n / seconds


def _run_train(workdir: pathlib.Path, overrides: dict) -> dict:
  """`experiments.train` in a fresh process: (results.json, peak RSS in MB)."""
  flag = lambda v: f"({v[0]},{v[1]})" if isinstance(v, tuple) else str(v)  # noqa: E731
  cmd = [sys.executable, "-m", "experiments.train", "--config=experiments/configs/default.py:paper",
         f"--workdir={workdir}", *[f"--config.{k}={flag(v)}" for k, v in overrides.items()]]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  err = proc.stderr.read()
  _, status, usage = os.wait4(proc.pid, 0)
  if status != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
  results = json.loads((workdir / "results.json").read_text())
  return {"peak_rss_mb": usage.ru_maxrss / 1024, "wall_seconds": time.perf_counter() - t0,
          "steady_steps_per_second": results["steady_steps_per_second"], "steps": results["steps"]}


def _train_overrides(shards_dir, name, steps) -> dict:
  return {"dataset.name": name, "dataset.format": "sharded", "dataset.shards": str(shards_dir),
          "train.batch_size": G, "train.num_steps": steps, "train.eval_every": 0,
          "train.checkpoint_every": -1, "train.log_every": max(steps // 4, 1), "eval.max_examples": 2048,
          "mesh.shape": (1, 1)}


def main(argv):
  del argv
  from snm_jax.data import pipeline, shards  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(_DATA.value)
  root.mkdir(parents=True, exist_ok=True)
  out: dict = {"batch_size": G, "rounds": _ROUNDS.value, "machine": {"cpus": os.cpu_count()}}

  # ---- conversions ------------------------------------------------------------------------------
  sets = {"bibtex": root / "bibtex"}
  out["conversion"] = {"bibtex": _convert(sets["bibtex"], ["--dataset=bibtex", "--num_shards=4"])}
  w2_rows = 200_000
  sets["w2"] = root / "w2_200k"
  out["conversion"]["w2_200k"] = _convert(sets["w2"], [f"--synthetic_rows={w2_rows}", "--num_shards=8",
      f"--synthetic_features={W2['num_features']}", f"--synthetic_labels={W2['num_labels']}",
      f"--synthetic_nnz={W2['nnz']}", "--synthetic_test_rows=5000"])

  # ---- (a) throughput, interleaved --------------------------------------------------------------
  in_memory = {k: shards.read_split(v, "train") for k, v in sets.items()}
  configs = []
  for rows in sets:
    for path in ("memory", "sharded"):
      for workers in (0, 1, 2):
        configs.append((rows, path, workers))
  samples = {c: [] for c in configs}
  for _ in range(_ROUNDS.value):
    for rows, path, workers in configs:
      def make(rows=rows, path=path, workers=workers):
        source = ((pipeline.ShardedRows(sets[rows], "train"), None) if path == "sharded" else in_memory[rows])
        return pipeline.SparseBatcher(*source, "sample_one_positive", global_batch_size=G, seed=0,
                                      process_index=0, process_count=1, read_threads=1, prefetch=4,
                                      workers=workers)
      samples[(rows, path, workers)].append(_throughput(make, _BATCHES.value))
  out["throughput"] = [{"rows": r, "path": p, "workers": w, "examples_per_second": statistics.median(v),
                        "samples": v} for (r, p, w), v in samples.items()]
  # The train step's consumption on the same rows.
  out["step_consumption"] = {}
  for rows, d in sets.items():
    meta = shards.read_metadata(d)
    res = _run_train(root / f"step_{rows}", _train_overrides(d, meta.name, 150))
    out["step_consumption"][rows] = {**res, "examples_per_second": res["steady_steps_per_second"] * G}

  # ---- (b) host memory against data size ------------------------------------------------------------
  out["memory"] = []
  for n in map(int, _SIZES.value):
    d = root / f"synthetic_{n}"
    out["conversion"][f"synthetic_{n}"] = _convert(d, [f"--synthetic_rows={n}", "--num_shards=16",
        f"--synthetic_features={W2['num_features']}", f"--synthetic_labels={W2['num_labels']}",
        f"--synthetic_nnz={W2['nnz']}", "--synthetic_test_rows=5000"])
    disk = sum(f.stat().st_size for f in d.iterdir())
    res = _run_train(root / f"rss_sharded_{n}", _train_overrides(d, "synthetic_sparse", _STEPS.value))
    out["memory"].append({"examples": n, "path": "sharded", "disk_bytes": disk, **res})
  n0 = int(_SIZES.value[0])
  files = root / f"files_{n0}"
  if not (files / "test_labels.npz").exists():
    files.mkdir(exist_ok=True)
    for split in ("train", "test"):
      x, y = shards.read_split(root / f"synthetic_{n0}", split)
      sp.save_npz(files / f"{split}_features.npz", x)
      sp.save_npz(files / f"{split}_labels.npz", y)
  res = _run_train(root / f"rss_memory_{n0}", {
      **_train_overrides(root, "files", _STEPS.value), "dataset.format": "memory", "dataset.shards": "",
      **{f"dataset.files.{s}_{k}": str(files / f"{s}_{k}.npz") for s in ("train", "test")
         for k in ("features", "labels")}})
  out["memory"].append({"examples": n0, "path": "memory", **res})
  sharded = [m for m in out["memory"] if m["path"] == "sharded"]
  if len(sharded) >= 2:
    a, b = sharded[0], sharded[-1]
    out["rss_slope_mb_per_million_examples"] = ((b["peak_rss_mb"] - a["peak_rss_mb"])
                                                / ((b["examples"] - a["examples"]) / 1e6))
    out["rss_ratio_largest_to_smallest"] = b["peak_rss_mb"] / a["peak_rss_mb"]

  path = pathlib.Path(_OUT.value)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1))
  path.with_suffix(".md").write_text(_markdown(out))
  print(_markdown(out))


def _markdown(out: dict) -> str:
  lines = ["| rows | path | workers | examples/s (median) |", "|---|---|---|---|"]
  for t in out["throughput"]:
    lines.append(f"| {t['rows']} | {t['path']} | {t['workers']} | {t['examples_per_second']:,.0f} |")
  lines += ["", "| rows | train step consumption, examples/s | steps/s |", "|---|---|---|"]
  for rows, s in out["step_consumption"].items():
    lines.append(f"| {rows} | {s['examples_per_second']:,.0f} | {s['steady_steps_per_second']:.2f} |")
  lines += ["", "| examples | path | disk | peak RSS | wall |", "|---|---|---|---|---|"]
  for m in out["memory"]:
    disk = f"{m['disk_bytes'] / 2**30:.2f} GiB" if "disk_bytes" in m else "(.npz files)"
    lines.append(f"| {m['examples']:,} | {m['path']} | {disk} | {m['peak_rss_mb']:,.0f} MB | {m['wall_seconds']:.0f} s |")
  if "rss_slope_mb_per_million_examples" in out:
    lines.append(f"\nPeak RSS slope through the shards: {out['rss_slope_mb_per_million_examples']:.1f} MB per "
                 f"million examples (largest / smallest: {out['rss_ratio_largest_to_smallest']:.3f}).")
  lines += ["", "| converted set | rows/s | wall |", "|---|---|---|"]
  for k, c in out["conversion"].items():
    lines.append(f"| {k} | {c['rows_per_second']:,.0f} | {c['wall_seconds']:.0f} s |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  app.run(main)
