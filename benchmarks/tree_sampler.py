"""Fit time and sampling throughput of the adversarial tree sampler on synthetic data.

  .venv/bin/python benchmarks/tree_sampler.py --out /tmp/tree_sampler.json
  .venv/bin/python benchmarks/tree_sampler.py --out /tmp/tree_sampler.json --full  # adds C = 10^6

For each C: N = points_per_label * C training points from `planted_hierarchy`
(k-dimensional, i.e. already "projected"), `fit_tree` wall time (compilation
included: the fit is run once), test log-likelihood, then the throughput of
jitted ancestral sampling (queries x samples per call) and of `log_prob_all`.
Writes a JSON list (one dict per measurement, each with C, k, N, seconds) and
prints a table. The load average and the process CPU time (all threads) are
recorded because wall times on a shared machine depend on the load.
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from snm_jax import adversarial as adv

_OUT = flags.DEFINE_string("out", None, "Path of the JSON results file.", required=True)
_FULL = flags.DEFINE_bool("full", False, "Also run C = 10^6 (slow, ~7 GB of memory).")
_K = flags.DEFINE_integer("k", 16, "Feature dimension (the paper's PCA size).")
_POINTS_PER_LABEL = flags.DEFINE_integer("points_per_label", 10, "N / C for fitting.")
_QUERIES = flags.DEFINE_integer("queries", 1024, "Batch of queries per sampling call.")
_SAMPLES = flags.DEFINE_integer("samples", 64, "Negatives drawn per query.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed sampling calls per C.")


def _timed(fn, repeats):
  jax.block_until_ready(fn())  # compile
  start = time.perf_counter()
  for _ in range(repeats):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / repeats


def bench_one(c: int, k: int) -> list[dict]:
  n = _POINTS_PER_LABEL.value * c
  x, y = adv.planted_hierarchy(0, c, k, n + 4096)
  x_tr, y_tr = x[:n], y[:n]
  x_te, y_te = jnp.asarray(x[n:]), jnp.asarray(y[n:])
  load = os.getloadavg()[0]
  start, cpu_start = time.perf_counter(), time.process_time()
  tree, reports = adv.fit_tree(x_tr, y_tr, c)
  jax.block_until_ready(tree)
  fit_s, fit_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
  test_ll = float(jnp.mean(adv.log_prob(tree, x_te, y_te[:, None])))
  entries = [dict(
      kind="fit", C=c, k=k, N=n, seconds=fit_s, cpu_seconds=fit_cpu_s, load_avg_1min=load,
      depth=tree.depth,
      reassign_rounds=[r.iterations for r in reports],
      unconverged_levels=sum(not r.converged for r in reports),
      level_seconds=[round(r.seconds, 3) for r in reports],
      test_log_lik=test_ll, uniform_log_lik=-float(np.log(c)))]

  q, s = _QUERIES.value, _SAMPLES.value
  xq = x_te[:q]
  keys = iter(jax.random.split(jax.random.key(0), _REPEATS.value + 1))
  sec = _timed(lambda: adv.sample_with_log_prob(tree, xq, next(keys), s), _REPEATS.value)
  entries.append(dict(kind="sample", C=c, k=k, N=q, S=s, seconds=sec,
                      samples_per_s=q * s / sec, load_avg_1min=os.getloadavg()[0]))
  qa = max(1, min(q, 2**24 // tree.num_leaves))  # keep the (queries, L) table <= 64 MB
  sec = _timed(lambda: adv.log_prob_all(tree, xq[:qa]), 5)
  entries.append(dict(kind="log_prob_all", C=c, k=k, N=qa, seconds=sec,
                      queries_per_s=qa / sec, load_avg_1min=os.getloadavg()[0]))
  return entries


def main(argv):
  del argv
  sizes = [10**3, 10**4, 10**5] + ([10**6] if _FULL.value else [])
  results = []
  print(f"{'C':>8} {'N':>9} {'fit s':>8} {'cpu s':>8} {'rounds/level':>13} {'unconv':>6} {'test LL':>8} "
        f"{'uniform':>8} {'samples/s':>11} {'logp_all q/s':>12} {'load':>5}")
  for c in sizes:
    fit_e, samp_e, all_e = bench_one(c, _K.value)
    results += [fit_e, samp_e, all_e]
    print(f"{c:>8} {fit_e['N']:>9} {fit_e['seconds']:>8.1f} {fit_e['cpu_seconds']:>8.1f} "
          f"{np.mean(fit_e['reassign_rounds']):>13.1f} {fit_e['unconverged_levels']:>6} "
          f"{fit_e['test_log_lik']:>8.2f} {fit_e['uniform_log_lik']:>8.2f} "
          f"{samp_e['samples_per_s']:>11.3g} {all_e['queries_per_s']:>12.3g} "
          f"{fit_e['load_avg_1min']:>5.1f}", flush=True)
    with open(_OUT.value, "w") as f:  # rewritten after every size, so partial runs are kept
      json.dump(dict(jax_version=jax.__version__, cpu_count=os.cpu_count(),
                     points_per_label=_POINTS_PER_LABEL.value, results=results), f, indent=1)


if __name__ == "__main__":
  app.run(main)
