r"""The sparse-input step's cost in d with and without transparent huge pages (issue 17's d target).

  python -m benchmarks.hugepages --size=full --out_dir=results/benchmarks   # ~4 min on 2 cores
  python -m benchmarks.hugepages --size=small                              # seconds

The input sweep of benchmarks/step_scaling.py (`run_input_sweep`: the project step at K = 10^4,
an input table d x 128 at d in {10^4, 10^5, 10^6}, nnz = 64 per row, its sparse variants: lazy
row momentum, the default, and plain SGD), run in child processes that alternate between glibc's
default allocator and `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which has glibc's malloc (hence
XLA:CPU's buffers) madvise its large mappings to transparent huge pages (kernel setting
`transparent_hugepage/enabled` = madvise or always; checked: the 2 GiB table of d = 10^6 at width
512 then sits in 2 MiB pages, /proc/<pid>/smaps_rollup AnonHugePages).

Why: a step touches N x nnz = 16,384 random rows of the d x h table. At d = 10^6 they span 512 MiB
of 4 KiB pages, so nearly every row costs a TLB miss and a page walk; with 2 MiB pages the table
needs 256 TLB entries. What remains of t(10^6) / t(10^4) is the cache: the d = 10^4 table (5 MiB)
stays in the caches, larger ones do not. Each child times all its variants round-robin
(`common.time_interleaved`); the ratios compare steps of one process, and the report gives each
setting's median ratio over the alternating rounds. Host memory only: on GPU / TPU the tables live
in device memory and this setting changes nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys

from absl import flags

from benchmarks import common

_ROUNDS = flags.DEFINE_integer("rounds", 0, "Child processes per setting (0: by --size).")
_CHILD = flags.DEFINE_bool("child", False, "Internal: time one sweep in this process, print JSON.")

HUGETLB = "glibc.malloc.hugetlb=1"
SIZES = {"small": dict(ds=(10**3, 10**4), reps=10, rounds=1),
         "full": dict(ds=(10**4, 10**5, 10**6), reps=50, rounds=4)}


def child(ds, reps: int) -> dict:
  """One process: the sparse variants of the input sweep at every d; {variant@d: ms}."""
  import jax  # pylint: disable=g-import-not-at-top
  from benchmarks import step_scaling  # pylint: disable=g-import-not-at-top
  from snm_jax import sharding  # pylint: disable=g-import-not-at-top
  sparse = tuple(v for v in step_scaling.INPUT_VARIANTS if v[0])
  mesh = sharding.make_mesh((1, 1), devices=jax.devices()[:1])
  rows, _ = step_scaling.run_input_sweep(step_scaling.INPUT_SHAPE, ds, reps, common.matmul_peak(), mesh,
                                         variants=sparse)
  return {f"{r['variant']}@{r['d']}": r["time_ms"] for r in rows if "time_ms" in r}


def run(size: str, out_dir, rounds: int = 0) -> dict:
  cfg = SIZES[size]
  rounds = rounds or cfg["rounds"]
  runs = []
  for _ in range(rounds):
    for tunables in ("", HUGETLB):  # alternating, so both settings see the same machine load
      env = {**os.environ, "GLIBC_TUNABLES": tunables} if tunables else {
          k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
      out = subprocess.run([sys.executable, "-m", "benchmarks.hugepages", "--child", f"--size={size}"],
                           env=env, capture_output=True, text=True, check=True)
      runs.append({"glibc_tunables": tunables, "ms": json.loads(out.stdout.strip().splitlines()[-1])})
  lo, hi = min(cfg["ds"]), max(cfg["ds"])
  variants = sorted({k.split("@")[0] for r in runs for k in r["ms"]})
  for r in runs:
    r["ratio"] = {v: r["ms"][f"{v}@{hi}"] / r["ms"][f"{v}@{lo}"] for v in variants}
  summary = {f"{v}_t{hi}_over_t{lo}_{name}": statistics.median(
                 r["ratio"][v] for r in runs if (r["glibc_tunables"] == HUGETLB) == huge)
             for v in variants for name, huge in (("default_pages", False), ("huge_pages", True))}
  thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
  payload = {"name": "hugepages", "size": size, "machine": common.machine_description(),
             "transparent_hugepage": thp.read_text().strip() if thp.exists() else None,
             "config": {"ds": cfg["ds"], "reps": cfg["reps"], "rounds": rounds}, "runs": runs,
             "summary": summary, "load_average": os.getloadavg()}
  common.write_json(out_dir, "hugepages", payload)
  return payload


def main(argv):
  del argv
  if _CHILD.value:
    print(json.dumps(child(SIZES[common.SIZE.value]["ds"], SIZES[common.SIZE.value]["reps"])))
    return
  payload = run(common.SIZE.value, common.OUT_DIR.value, _ROUNDS.value)
  print("summary:", json.dumps(payload["summary"], indent=1), "load average:", payload["load_average"])


if __name__ == "__main__":
  common.run_main(main)
