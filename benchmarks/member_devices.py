r"""A recipe's candidate groups on one CPU device against one device per core (`recipe.member_devices`).

  python -m benchmarks.member_devices --size=full --out_dir=results/benchmarks   # ~6 min
  python -m benchmarks.member_devices --size=small                               # ~1 min

XLA:CPU runs one program's matmuls on all the cores; on the recipe's small matmuls that scales
poorly, so the recipe deals its members over one CPU device per core (each member's step on one
core, the members' steps at once: `snm_jax.train.runtime.member_devices`). Each case is the
recipe's own candidates (`recipe.candidate_list`: fields derived from the data) as the recipe
trains them -- candidate groups advanced side by side (`group.advance_together`), evaluating
validation every train.eval_every steps as derived -- built twice in one process of one CPU
device per core: every member on device 0, and the members dealt over the devices as
`recipes.candidates.train` deals them. The two are advanced alternately, `STEPS` steps at a
time, so a change of machine speed hits both alike. Reported: wall milliseconds per member-step
(the median over rounds, evaluations included) and their ratio.
"""

from __future__ import annotations

import jax

from snm_jax.train.runtime import member_devices

# One CPU device per core, before anything starts the backends.
jax.config.update("jax_num_cpu_devices", max(member_devices.usable_cores(), 2))

import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from experiments.configs import xmc  # noqa: E402
from snm_jax import sharding  # noqa: E402
from snm_jax.train.config.overrides import with_overrides  # noqa: E402
from snm_jax.train.recipes import candidates, recipe  # noqa: E402
from snm_jax.train.trainer import group as group_lib  # noqa: E402
from snm_jax.train.trainer.run_data import load_run_data  # noqa: E402

ROUNDS = {"full": 5, "small": 3}
EVALUATIONS_PER_ROUND = 2  # each round advances every member this many train.eval_every periods
CASES = {
    "full": {
        "delicious wide_deep x0.5, x1 (the survivors)": ("delicious", ["kind_wide_deep-learning_rate_x0.5",
                                                                       "kind_wide_deep-learning_rate_x1"]),
        "delicious, all 7 candidates (to the first rung)": ("delicious", None),
        "bibtex, all 7 candidates (to the first rung)": ("bibtex", None),
    },
    "small": {
        "bibtex linear x0.5, x1": ("bibtex", ["kind_linear-learning_rate_x0.5",
                                              "kind_linear-learning_rate_x1"]),
    },
}


def member_configs(dataset: str, names: list[str] | None) -> dict:
  """{candidate: its config as the recipe trains it}, never reaching its last step here."""
  config = xmc.get_config(dataset)
  stats = recipe.DataStats.of(load_run_data(config))
  out = {}
  for name, _, fields in recipe.candidate_list(config, stats, recipe.derive(config, stats)):
    if names is None or name in names:
      out[name] = with_overrides(config, {**fields, "recipe.name": "", "mesh.shape": (1, 1),
                                          "train.checkpoint_every": -1, "train.num_steps": 1 << 20})
  return out


def build_groups(dataset: str, configs: dict, root: str, slots) -> list:
  """The candidate groups of `configs` (one per shape) as `recipes.candidates.train` builds them,
  members dealt over `slots` (None: all on one device)."""
  by_key = {}
  for name, config in configs.items():
    by_key.setdefault(group_lib.group_key(config), []).append((name, 0, config, f"{root}/{name}"))
  return [g for _, g in candidates.build_groups(xmc.get_config(dataset), by_key.values(),
                                                sharding.make_mesh((1, 1)), slots)]


def time_case(dataset: str, names, rounds: int) -> dict:
  configs = member_configs(dataset, names)
  eval_every = next(iter(configs.values())).train.eval_every
  steps = EVALUATIONS_PER_ROUND * eval_every
  slots = [sharding.make_mesh((1, 1), devices=[d]) for d in jax.local_devices()]
  with tempfile.TemporaryDirectory(prefix="snm_jax_member_devices_") as tmp:
    variants = {"one_device": build_groups(dataset, configs, f"{tmp}/one", None),
                "device_each": build_groups(dataset, configs, f"{tmp}/each", slots)}
    for groups in variants.values():  # compilation, then a warm round
      group_lib.advance_together(groups, groups[0].step + steps)
    times = {v: [] for v in variants}
    for r in range(rounds):
      for v in (tuple(variants) if r % 2 == 0 else tuple(reversed(variants))):
        groups = variants[v]
        t0 = time.perf_counter()
        group_lib.advance_together(groups, groups[0].step + steps)
        times[v].append((time.perf_counter() - t0) / (steps * len(configs)))
    for groups in variants.values():
      for g in groups:
        g.close()
  one, each = (1000 * float(np.median(times[v])) for v in ("one_device", "device_each"))
  return {"members": len(configs), "devices": len(slots), "eval_every": eval_every,
          "one_device_ms": one, "device_each_ms": each, "ratio": each / one,
          "rounds_one_device_ms": [1000 * t for t in times["one_device"]],
          "rounds_device_each_ms": [1000 * t for t in times["device_each"]]}


def run(size: str, out_dir: str | None, peak: dict) -> dict:
  rows = [{"case": name, **time_case(dataset, names, ROUNDS[size])}
          for name, (dataset, names) in CASES[size].items()]
  return common.report("member_devices", size, {"rounds": ROUNDS, "evaluations_per_round": EVALUATIONS_PER_ROUND},
                       rows, ["case", "members", "devices", "one_device_ms", "device_each_ms", "ratio"],
                       peak, out_dir=out_dir)


def main(_):
  run(common.SIZE.value, common.OUT_DIR.value, common.peak_from_flags())


if __name__ == "__main__":
  common.run_main(main)
