r"""A candidate group's steps one dispatch each, against several per dispatch (`recipe.steps_per_call`).

  python -m benchmarks.steps_per_call --size=full --out_dir=results/benchmarks   # ~3 min
  python -m benchmarks.steps_per_call --size=small                               # < 1 min

In serial mode (the default on CPU) a candidate group calls its compiled step once per member and
step; with steps_per_call = k it calls a `lax.scan` of the step over k batches, so the host's
per-step work (the dispatch, the batch's transfer and its gather on the devices) is paid once per
k steps. Each variant is a `CandidateGroup` of the recipe's own candidates (`recipe.
candidate_list`: fields derived from the data) with no evaluation or checkpoint in the timed steps;
both groups are built in one process and advanced alternately, `STEPS` steps at a time, so a change
of machine speed hits both alike. Reported: milliseconds per member-step (the median over rounds)
and their ratio. The groups: Delicious's two wide-and-deep survivors (table learning rates x0.5 and
x1, fed the same batches) and Bibtex's one-vs-rest candidate on its three validation splits ("small":
Bibtex's linear candidates x0.5 and x1 only).
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
from benchmarks import common
from snm_jax import sharding
from snm_jax.train.config.overrides import with_overrides
from snm_jax.train.recipes import recipe
from snm_jax.train.trainer import group as group_lib
from snm_jax.train.trainer.run_data import load_run_data
from experiments.configs import xmc

K = 8          # steps per call of the "scan" variant (xmc's recipe.steps_per_call)
STEPS = {"full": 96, "small": 48}   # member steps per round, a multiple of K
ROUNDS = {"full": 5, "small": 3}


def _candidate(dataset: str, name: str):
  """The recipe's candidate `name` on `dataset`, as a plain run without evaluations or checkpoints."""
  config = xmc.get_config(dataset)
  stats = recipe.DataStats.of(load_run_data(config))
  fields = {n: f for n, _, f in recipe.candidate_list(config, stats, recipe.derive(config, stats))}[name]
  return with_overrides(config, {**fields, "recipe.name": "", "train.eval_every": 0,
                                 "train.checkpoint_every": -1, "diagnostics.every": 0,
                                 "train.num_steps": 1 << 20})


CASES = {
    "full": {
        "delicious wide_deep x0.5, x1": [
            ("delicious", "kind_wide_deep-learning_rate_x0.5", {}),
            ("delicious", "kind_wide_deep-learning_rate_x1", {})],
        "bibtex ovr_pairs, 3 splits": [
            ("bibtex", "ovr_pairs", {"dataset.validation_seed": i}) for i in range(3)],
    },
    "small": {
        "bibtex linear x0.5, x1": [
            ("bibtex", "kind_linear-learning_rate_x0.5", {}),
            ("bibtex", "kind_linear-learning_rate_x1", {})],
    },
}


def time_case(members, steps: int, rounds: int) -> dict:
  configs = {f"{n}@{i}": with_overrides(_candidate(ds, n), over) for i, (ds, n, over) in enumerate(members)}
  mesh = sharding.make_mesh(next(iter(configs.values())).mesh.shape)
  with tempfile.TemporaryDirectory(prefix="snm_jax_spc_") as tmp:
    groups = {k: group_lib.CandidateGroup([(n, c, f"{tmp}/{k}/{n}") for n, c in configs.items()], mesh,
                                          mode="serial", steps_per_call=k) for k in (1, K)}
    for g in groups.values():  # compilation, then a warm round
      g.advance(g.step + 2 * steps)
    times = {k: [] for k in groups}
    for r in range(rounds):
      for k in ((1, K) if r % 2 == 0 else (K, 1)):
        g = groups[k]
        t0 = time.perf_counter()
        g.advance(g.step + steps)
        times[k].append((time.perf_counter() - t0) / (steps * len(configs)))
    for g in groups.values():
      g.close()
  one, scan = (1000 * float(np.median(times[k])) for k in (1, K))
  return {"members": len(configs), "one_per_call_ms": one, f"{K}_per_call_ms": scan,
          "ratio": scan / one}


def run(size: str, out_dir: str | None, peak: dict) -> dict:
  rows = [{"group": name, **time_case(members, STEPS[size], ROUNDS[size])}
          for name, members in CASES[size].items()]
  return common.report("steps_per_call", size, {"k": K, "steps": STEPS, "rounds": ROUNDS}, rows,
                       ["group", "members", "one_per_call_ms", f"{K}_per_call_ms", "ratio"], peak,
                       out_dir=out_dir)


def main(_):
  run(common.SIZE.value, common.OUT_DIR.value, common.peak_from_flags())


if __name__ == "__main__":
  common.run_main(main)
