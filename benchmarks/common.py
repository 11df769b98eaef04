"""Shared benchmark plumbing: timing, the matmul roofline, memory accounting,
a machine description, synthetic tables, JSON output and a command line.

Timing rule (every benchmark): compile and run `warmup` times, then report the
median (and min) wall time of `reps` >= 10 further calls, each ended with
`jax.block_until_ready`. Achieved GFLOP/s are compared with the float32 matmul
peak of the same run: `jnp` (4096 x 4096) @ (4096 x 4096), 2 * 4096^3 FLOPs.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import pathlib
import platform
import re
import resource
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

SIZE = flags.DEFINE_enum("size", "small", ["small", "full"], "Benchmark size.")
OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/snm_jax_bench", "Directory of the JSON results.")
PEAK = flags.DEFINE_float("matmul_peak_gflops", 0.0,
                          "Reuse this measured matmul peak (run_all's small mode) instead of measuring.")

GIB = 1 << 30
# The most any one benchmark configuration may allocate (the brief allows ~12 GB
# on this shared 24 GiB machine); configurations above it are skipped with a note.
MEMORY_BUDGET_BYTES = 10 * GIB
MIN_REPS = 10


# ---- timing -------------------------------------------------------------------

def _stats(times: Sequence[float]) -> dict:
  return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
          "reps": len(times)}


def time_fn(fn: Callable[[], Any], *, reps: int = MIN_REPS, warmup: int = 2) -> dict:
  """Median / min / max seconds of `fn()` (its result blocked on) over `reps` calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return _stats(times)


def train_stepper(task) -> Callable[[], Any]:
  """One call = one train step of `task` (a `snm_jax.train.trainer.tasks.Task`) on its next batch,
  with the next key folded from key(1); the state is carried across calls. Returns (state, metrics)."""
  carry = {"state": task.state, "i": 0}
  key = jax.random.key(1)

  def step():
    carry["state"], metrics = task.train_step(carry["state"], next(task.batches),
                                              jax.random.fold_in(key, carry["i"]))
    carry["i"] += 1
    return carry["state"], metrics

  return step


def time_interleaved(fns: dict[str, Callable[[], Any]], *, reps: int = MIN_REPS,
                     warmup: int = 2) -> dict[str, dict]:
  """Like `time_fn` for several functions, timed round-robin (one call of each
  per round, in an order rotating between rounds) so that a change of machine
  load hits all of them alike: the ratios between them are then much less noisy
  than from back-to-back sweeps."""
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  names = list(fns)
  for r in range(reps):
    # Rotating the order spreads any "first in the round" penalty evenly.
    for name in names[r % len(names):] + names[:r % len(names)]:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[name]())
      times[name].append(time.perf_counter() - t0)
  return {name: _stats(t) for name, t in times.items()}


def matmul_fn(n: int = 4096) -> tuple[Callable[[], jax.Array], float]:
  """(call, FLOPs) of the roofline kernel: a float32 (n, n) @ (n, n) `jnp` matmul."""
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.float32)
  b = jax.random.normal(kb, (n, n), jnp.float32)
  mm = jax.jit(jnp.matmul)
  return (lambda: mm(a, b)), 2.0 * n ** 3


def peak_from_times(t: dict, flops: float, n: int = 4096) -> dict:
  return {"n": n, "flops": flops, **t, "gflops": flops / t["median_s"] / 1e9,
          "gflops_best": flops / t["min_s"] / 1e9}


def matmul_peak(n: int = 4096, reps: int = MIN_REPS) -> dict:
  """The float32 matmul roofline of this machine, measured now."""
  fn, flops = matmul_fn(n)
  return peak_from_times(time_fn(fn, reps=reps, warmup=1), flops, n)


def peak_from_flags() -> dict:
  """The matmul peak passed on the command line, or measured here."""
  if PEAK.value > 0:
    return {"gflops": PEAK.value, "source": "--matmul_peak_gflops (measured by run_all)"}
  return {**matmul_peak(), "source": "measured in this process"}


def gflops_row(flops: float, t: dict, peak: dict) -> dict:
  g = flops / t["median_s"] / 1e9
  return {"flops": flops, "gflops": g, "frac_of_peak": g / peak["gflops"]}


def op_profile(run: Callable[[], Any], compiled, *, steps: int = 5, top: int = 12) -> list[dict]:
  """Where a compiled program's time goes: per-HLO-op wall time from a
  `jax.profiler` trace of `steps` calls of `run()` (the XLA:CPU runtime emits
  one event per executed op). Each row: op name, ms per call, share of the summed
  op time, output shape and the JAX source op (HLO metadata). Ops can overlap
  (the CPU runtime runs independent ops concurrently), so shares are of the sum."""
  hlo = compiled.as_text()
  instr = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) [^\n]*", hlo, re.M):
    if re.search(r" (while|conditional|call)\(", m.group(0)):
      continue  # containers: their time is that of the ops they run
    op = re.search(r'op_name="([^"]*)"', m.group(0))
    instr[m.group(1)] = (m.group(2), op.group(1) if op else "")
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(steps):
        jax.block_until_ready(run())
    paths = sorted(pathlib.Path(tmp).rglob("*perfetto_trace.json.gz"))
    if not paths:
      return []
    with gzip.open(paths[-1]) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  total = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("name") in instr:
      total[e["name"]] += e.get("dur", 0.0)
  summed = sum(total.values()) or 1.0
  return [{"op": name, "ms": us / steps / 1e3, "share": us / summed, "shape": instr[name][0],
           "source": instr[name][1]} for name, us in total.most_common(top)]


# ---- memory -------------------------------------------------------------------

def compiled_memory(compiled) -> dict:
  """XLA's buffer assignment of a compiled program (bytes): the device-buffer
  accounting that also holds on CPU, where `device.memory_stats()` is None."""
  m = compiled.memory_analysis()
  if m is None:
    return {}
  args, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
  alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
  return {"argument_bytes": args, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
          "peak_bytes": args + out - alias + temp}


def reset_peak_rss() -> bool:
  """Resets the process's peak RSS (VmHWM) on Linux; False where unsupported."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _proc_status_kib(field: str) -> int | None:
  try:
    text = pathlib.Path("/proc/self/status").read_text()
  except OSError:
    return None
  m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
  return int(m.group(1)) if m else None


def rss_bytes() -> int:
  kib = _proc_status_kib("VmRSS")
  return 1024 * kib if kib is not None else 0


def peak_rss_bytes() -> int:
  """VmHWM (resettable) or, elsewhere, ru_maxrss (the process's lifetime peak)."""
  kib = _proc_status_kib("VmHWM")
  if kib is None:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return 1024 * kib


# ---- machine -------------------------------------------------------------------

def _cpu_model() -> str:
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def memory_budget_bytes() -> int:
  """MEMORY_BUDGET_BYTES, or less if other processes leave less available now."""
  try:
    m = re.search(r"MemAvailable:\s+(\d+) kB", pathlib.Path("/proc/meminfo").read_text())
  except OSError:
    m = None
  available = 1024 * int(m.group(1)) if m else MEMORY_BUDGET_BYTES
  return min(MEMORY_BUDGET_BYTES, int(0.8 * available))


def _mem_total_bytes() -> int:
  try:
    m = re.search(r"MemTotal:\s+(\d+) kB", pathlib.Path("/proc/meminfo").read_text())
    return 1024 * int(m.group(1)) if m else 0
  except OSError:
    return 0


def machine_description() -> dict:
  devices = jax.devices()
  return {
      "platform": platform.platform(),
      "machine": platform.machine(),
      "cpu": _cpu_model(),
      "cpu_count": os.cpu_count(),
      "mem_total_gib": round(_mem_total_bytes() / GIB, 1),
      "python": sys.version.split()[0],
      "jax": jax.__version__,
      "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
      "backend": jax.default_backend(),
      "devices": [str(d) for d in devices],
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "load_average": [round(x, 2) for x in os.getloadavg()],
  }


def _jaxlib_version():
  try:
    import jaxlib  # pylint: disable=g-import-not-at-top
    return jaxlib.__version__
  except Exception:  # pylint: disable=broad-except
    return None


# ---- synthetic data ---------------------------------------------------------------

def _mix32(x):
  x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
  x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def hash_normal(shape: tuple[int, int], seed: int = 0) -> jax.Array:
  """Deterministic pseudo-random float32 values of mean 0 and variance 1 (the
  sum of two hashed uniforms), as one fused elementwise kernel: no temporary
  buffer at all, whereas `jax.random.normal` of a (10^7, 128) table needs
  15 GB of temporaries on CPU. Traceable; for benchmarks only (not Gaussian)."""
  i = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
  j = jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
  a = _mix32(i * jnp.uint32(shape[1]) + j + jnp.uint32(seed) * jnp.uint32(0x9E3779B9))
  b = _mix32(a ^ jnp.uint32(0x5BD1E995))
  to_unit = lambda v: (v >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
  return (to_unit(a) + to_unit(b) - 1.0) * np.float32(np.sqrt(6.0))


def hash_table(num_rows: int, dim: int, seed: int = 0, sharding=None) -> jax.Array:
  """`hash_normal((num_rows, dim))` materialised with the given sharding."""
  return jax.jit(lambda: hash_normal((num_rows, dim), seed), out_shardings=sharding)()


def human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
    n /= 1024
  return f"{n:.1f} GiB"


# ---- output ---------------------------------------------------------------------

def write_json(out_dir: str | os.PathLike, name: str, payload: dict) -> pathlib.Path:
  path = pathlib.Path(out_dir) / f"{name}.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
  return path


def run_main(main: Callable) -> None:
  """`absl.app.run(main)` that also accepts `--out-dir` for `--out_dir` (and so on)."""
  def parse(argv):
    return flags.FLAGS([argv[0]] + [_underscore_flag(a) for a in argv[1:]])
  app.run(main, flags_parser=parse)


def _underscore_flag(arg: str) -> str:
  if not arg.startswith("--"):
    return arg
  name, eq, value = arg[2:].partition("=")
  return "--" + name.replace("-", "_") + eq + value


def _json_default(x):
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating,)):
    return float(x)
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)


def _fmt(v) -> str:
  if isinstance(v, float):
    if v == 0 or 1e-3 <= abs(v) < 1e6:
      return f"{v:.4g}"
    return f"{v:.3e}"
  return "-" if v is None else str(v)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """A Markdown table of `columns` of `rows` (missing entries print as '-')."""
  cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
  widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
  line = lambda vals: "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths)) + " |"
  out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  out += [line(row) for row in cells]
  return "\n".join(out)


def report(name: str, size: str, config: dict, rows: list[dict], columns: Sequence[str],
           peak: dict | None, notes: Sequence[str] = (), out_dir: str | None = None,
           extra: dict | None = None) -> dict:
  """Prints the table and writes `<out_dir>/<name>.json`; returns the payload."""
  payload = {"benchmark": name, "size": size, "machine": machine_description(),
             "matmul_peak": peak, "config": config, "results": rows, "notes": list(notes)}
  if extra:
    payload.update(extra)
  print(f"\n## {name} ({size})  matmul peak: "
        f"{peak['gflops']:.1f} GFLOP/s" if peak else f"\n## {name} ({size})")
  print(format_table(rows, columns))
  for n in notes:
    print(f"note: {n}")
  if out_dir:
    print(f"wrote {write_json(out_dir, name, payload)}")
  return payload


def random_batch(s, num_labels: int, seed: int = 0) -> dict:
  """A random padded batch for a benchmark shape `s` (fields n, nnz, num_features, label_width)."""
  rng = np.random.default_rng(seed)
  label = rng.integers(0, num_labels, s.n).astype(np.int32)
  others = rng.integers(0, num_labels, (s.n, s.label_width - 1)).astype(np.int32)
  return {
      "feat_ids": rng.integers(0, s.num_features, (s.n, s.nnz)).astype(np.int32),
      "feat_vals": rng.random((s.n, s.nnz)).astype(np.float32),
      "label": label,
      "label_set": np.concatenate([label[:, None], others], axis=1),
      "valid": np.ones(s.n, bool),
      "example_id": np.arange(s.n, dtype=np.int32),
  }
