r"""Runs every benchmark, each in its own process (so each can set its own XLA_FLAGS).

  python -m benchmarks.run_all --size=small --out-dir=/tmp/snm_jax_bench   # < 5 min (make bench)
  python -m benchmarks.run_all --size=full --out-dir=/tmp/snm_jax_bench    # the RESULTS.md run

Modules: step_scaling, mining, retrieval, tree_eval, wide_path, table_grad_layout, steps_per_call, and tree_sampler and sharded
when present. In small mode the float32 matmul peak is measured once here and passed
down (`--matmul_peak_gflops`) to the modules that report against it; in full mode every
module measures its own, next to its own timings, since the load of a shared
machine drifts over a long run. Writes `<out_dir>/run_all.json` (machine,
peak, each module's wall time and exit status) and `<out_dir>/summary.md` (every
module's table), and exits non-zero if any module failed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

from benchmarks import common


def _common_args(size, out_dir, peak):
  args = [f"--size={size}", f"--out_dir={out_dir}"]
  return args + ([f"--matmul_peak_gflops={peak['gflops']:.3f}"] if peak else [])


def _tree_sampler_args(size, out_dir, peak):
  del peak  # it reports no FLOP rates
  return _common_args(size, out_dir, None)


# module -> its command-line arguments, from (size, out_dir, matmul peak or None).
MODULES = (
    ("benchmarks.step_scaling", _common_args),
    ("benchmarks.mining", _common_args),
    ("benchmarks.retrieval", _common_args),
    ("benchmarks.tree_sampler", _tree_sampler_args),
    ("benchmarks.tree_eval", _tree_sampler_args),
    ("benchmarks.sharded", lambda size, out_dir, peak: _common_args(size, out_dir, None)),
    ("benchmarks.wide_path", _common_args),
    ("benchmarks.table_grad_layout", _common_args),
    ("benchmarks.steps_per_call", _common_args),
)


def _child_env() -> dict:
  """This environment minus any forced device count: each module chooses its own."""
  env = dict(os.environ)
  flags_ = [f for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
  if flags_:
    env["XLA_FLAGS"] = " ".join(flags_)
  else:
    env.pop("XLA_FLAGS", None)
  return env


# Columns of each module's table in summary.md (others: every scalar column).
SUMMARY_COLUMNS = {
    "step_scaling": ["variant", "K", "d", "time_ms", "min_ms", "gflops", "frac_of_peak",
                     "frac_of_interleaved_peak", "table_MiB", "temp_bytes", "note"],
    "mining": ["variant", "B", "k", "queries", "time_ms", "min_ms", "queries_per_s", "gflops",
               "frac_of_peak"],
    "tree_sampler": ["C", "N", "fit_s", "fit_cpu_s", "mean_rounds", "unconverged_levels", "test_log_lik",
                     "uniform_log_lik", "samples_per_s", "log_prob_all_queries_per_s", "fit_peak_rss_GiB",
                     "load_avg_1min"],
    "retrieval": ["variant", "K", "k", "row_block", "time_ms", "min_ms", "queries_per_s", "gflops", "frac_of_peak",
                  "frac_of_interleaved_peak", "temp_bytes", "rss_increase_bytes", "dense_scores_bytes"],
}


def render_summary(out_dir: str) -> str:
  """Markdown tables of every `<out_dir>/<module>.json` (the body of RESULTS.md)."""
  parts = []
  for module, _ in MODULES:
    name = module.rsplit(".", 1)[1]
    path = os.path.join(out_dir, f"{name}.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      payload = json.load(f)
    rows = payload.get("results") or payload.get("rows") if isinstance(payload, dict) else payload
    if not isinstance(rows, list) or not rows:
      continue
    columns = SUMMARY_COLUMNS.get(name) or [
        c for c in dict.fromkeys(k for r in rows for k in r)
        if all(not isinstance(r.get(c), (list, dict)) for r in rows)]
    columns = [c for c in columns if any(c in r for r in rows)]
    peak = payload.get("matmul_peak") if isinstance(payload, dict) else None
    head = f"### {name}"
    if peak and peak.get("gflops"):
      head += f" (matmul peak {peak['gflops']:.1f} GFLOP/s)"
    parts += [head, "", common.format_table(rows, columns), ""]
    if isinstance(payload, dict) and payload.get("summary"):
      parts += ["summary: `" + json.dumps(payload["summary"], default=str) + "`", ""]
  return "\n".join(parts)


def main(argv):
  del argv
  size, out_dir = common.SIZE.value, common.OUT_DIR.value
  os.makedirs(out_dir, exist_ok=True)
  peak = common.matmul_peak() if size == "small" else None
  if peak:
    print(f"matmul peak: {peak['gflops']:.1f} GFLOP/s (float32 4096^3, median of {peak['reps']})")
  runs, t_all = [], time.perf_counter()
  for module, args in MODULES:
    if importlib.util.find_spec(module) is None:
      print(f"\n=== {module}: not present, skipped")
      runs.append({"module": module, "status": "absent"})
      continue
    cmd = [sys.executable, "-m", module] + args(size, out_dir, peak)
    print(f"\n=== {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=_child_env(), check=False).returncode
    runs.append({"module": module, "returncode": rc, "seconds": time.perf_counter() - t0,
                 "status": "ok" if rc == 0 else "failed"})
  total = time.perf_counter() - t_all
  common.write_json(out_dir, "run_all", {"size": size, "machine": common.machine_description(),
                                         "matmul_peak": peak, "modules": runs, "total_seconds": total})
  summary = render_summary(out_dir)
  with open(os.path.join(out_dir, "summary.md"), "w") as f:
    f.write(summary + "\n")
  print(f"\n{common.format_table(runs, ['module', 'status', 'seconds'])}\ntotal {total:.0f} s; "
        f"results in {out_dir} (tables: summary.md)")
  if any(r["status"] == "failed" for r in runs):
    sys.exit(1)


if __name__ == "__main__":
  common.run_main(main)
