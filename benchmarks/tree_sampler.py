r"""Fit time and sampling throughput of the adversarial tree sampler (issue 9).

  python -m benchmarks.tree_sampler --size=small --out_dir=/tmp/snm_jax_bench   # C = 10^3, 10^4
  python -m benchmarks.tree_sampler --size=full                                 # C = 10^4, 10^5, 10^6

For each number of labels C: N = 10 C training points (plus 4096 test points)
from `planted_hierarchy` with k = 16 features (already "projected", the paper's
PCA size), then
  * `fit_tree` run once: wall and process CPU seconds (all threads; compilation
    included), re-assignment rounds per level (`rounds_per_level`; a level runs until
    no label moves, `levels_converged`), and the process's peak resident
    set during the fit (VmHWM, reset just before via /proc/self/clear_refs;
    `fit_rss_before_bytes` is the resident set just before, so the fit's own
    memory is the difference);
  * test log-likelihood: mean log p(y|x) of the test points, against the uniform
    distribution's -log C;
  * jitted ancestral sampling (`sample_with_log_prob`): 1024 queries x 64
    draws per call, a fresh key per call, in samples/s;
  * `log_prob_all` (all C labels of each query, O(C k) per query): queries/s, on
    at most 2^24 / L queries per call so that the (queries, L) table stays
    <= 64 MB (16 queries at C = 10^6).
Sampling and `log_prob_all` follow the common timing rule (median of `reps` >=
10 calls after warm-up). The 1-minute load average is recorded before the fit,
before each throughput measurement and in the machine description, since wall
times on this shared machine depend on the load. `<out_dir>/tree_sampler.json`
is rewritten after every C (with a "partial" note until the last), so a run
killed at a large C keeps the smaller ones.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from snm_jax import adversarial as adv

SIZES = {
    "small": dict(cs=(10**3, 10**4), reps=10),
    "full": dict(cs=(10**4, 10**5, 10**6), reps=20),
}
K, POINTS_PER_LABEL, TEST_POINTS = 16, 10, 4096
QUERIES, SAMPLES = 1024, 64
LOG_PROB_ALL_ENTRIES = 2**24  # queries x L of one log_prob_all call (64 MB of float32)
COLUMNS = ["C", "N", "fit_s", "fit_cpu_s", "mean_rounds", "unconverged_levels", "test_log_lik",
           "uniform_log_lik", "samples_per_s", "log_prob_all_queries_per_s", "fit_peak_rss_GiB",
           "load_avg_1min"]


def _load() -> float:
  return round(os.getloadavg()[0], 2)


def bench_one(c: int, reps: int) -> dict:
  """All measurements at C = c labels: one row (see the module docstring)."""
  n = POINTS_PER_LABEL * c
  common.reset_peak_rss()
  rss0 = common.rss_bytes()
  x, y = adv.planted_hierarchy(0, c, K, n + TEST_POINTS)
  data_peak = common.peak_rss_bytes()
  x_te, y_te = jnp.asarray(x[n:]), jnp.asarray(y[n:])

  load = _load()
  common.reset_peak_rss()
  rss_before = common.rss_bytes()
  start, cpu_start = time.perf_counter(), time.process_time()
  tree, reports = adv.fit_tree(x[:n], y[:n], c)
  jax.block_until_ready(tree)
  fit_s, fit_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
  fit_peak = common.peak_rss_bytes()
  del x, y
  test_ll = float(jnp.mean(adv.log_prob(tree, x_te, y_te[:, None])))
  rounds = [r.iterations for r in reports]
  row = dict(
      C=c, k=K, N=n, depth=tree.depth, fit_s=fit_s, fit_cpu_s=fit_cpu_s, load_avg_1min=load,
      rounds_per_level=rounds, levels_converged=[r.converged for r in reports],
      mean_rounds=float(np.mean(rounds)),
      unconverged_levels=sum(not r.converged for r in reports),
      level_seconds=[round(r.seconds, 3) for r in reports],
      test_points=TEST_POINTS, test_log_lik=test_ll, uniform_log_lik=-float(np.log(c)),
      data_peak_rss_increase_bytes=max(data_peak - rss0, 0),
      fit_rss_before_bytes=rss_before, fit_peak_rss_bytes=fit_peak,
      fit_peak_rss_GiB=round(fit_peak / common.GIB, 3))

  xq = x_te[:QUERIES]
  keys = iter(jax.random.split(jax.random.key(0), reps + 2))  # 2 warm-up calls + reps
  row["sample_load_avg_1min"] = _load()
  t = common.time_fn(lambda: adv.sample_with_log_prob(tree, xq, next(keys), SAMPLES), reps=reps)
  row.update(sample_queries=xq.shape[0], sample_draws=SAMPLES, sample_s=t["median_s"],
             sample_min_s=t["min_s"], samples_per_s=xq.shape[0] * SAMPLES / t["median_s"])

  qa = max(1, min(QUERIES, LOG_PROB_ALL_ENTRIES // tree.num_leaves))
  row["log_prob_all_load_avg_1min"] = _load()
  t = common.time_fn(lambda: adv.log_prob_all(tree, xq[:qa]), reps=reps)
  row.update(log_prob_all_queries=qa, log_prob_all_s=t["median_s"],
             log_prob_all_min_s=t["min_s"], log_prob_all_queries_per_s=qa / t["median_s"])
  return row


def run(size: str = "small", out_dir: str | None = None, cs=None) -> dict:
  """Every C of `SIZES[size]` (or `cs`); prints the table and writes the JSON."""
  cfg = dict(SIZES[size])
  if cs is not None:
    cfg["cs"] = tuple(cs)
  config = {**cfg, "k": K, "points_per_label": POINTS_PER_LABEL, "test_points": TEST_POINTS,
            "queries": QUERIES, "samples": SAMPLES, "log_prob_all_entries": LOG_PROB_ALL_ENTRIES,
            "fit_defaults": "reg=0.1, max_reassign_iters=1000 (a cap: levels run until no label "
                            "moves), newton_steps=1, polish_steps=3"}
  notes = ["fit_s includes compilation (the fit runs once per C)",
           "fit_peak_rss_GiB: the whole process's peak resident set during the fit "
           "(training data and earlier allocations included)"]
  rows = []
  for c in cfg["cs"]:
    rows.append(bench_one(c, cfg["reps"]))
    r = rows[-1]
    print(f"C={c}: fit {r['fit_s']:.1f} s (cpu {r['fit_cpu_s']:.1f} s, peak RSS "
          f"{r['fit_peak_rss_GiB']:.2f} GiB), test LL {r['test_log_lik']:.3f} "
          f"(uniform {r['uniform_log_lik']:.3f}), {r['samples_per_s']:.3g} samples/s, "
          f"log_prob_all {r['log_prob_all_queries_per_s']:.3g} q/s, load {r['load_avg_1min']}",
          flush=True)
    if out_dir and c != cfg["cs"][-1]:  # kept if a larger C is killed
      common.write_json(out_dir, "tree_sampler", {
          "benchmark": "tree_sampler", "size": size, "machine": common.machine_description(),
          "matmul_peak": None, "config": config, "results": rows,
          "notes": notes + [f"partial: C = {cfg['cs'][len(rows)]} and larger still running "
                            "or killed"]})
  return common.report("tree_sampler", size, config, rows, COLUMNS, None, notes=notes,
                       out_dir=out_dir)


def main(argv):
  del argv
  run(common.SIZE.value, common.OUT_DIR.value)


if __name__ == "__main__":
  common.run_main(main)
