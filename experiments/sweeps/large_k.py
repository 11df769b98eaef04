r"""The papers' claims where they are made: K = 10^5 and 10^6 labels, B/K <= 4 %, equal wall-clock.

  python -m benchmarks.sweep_step_times --sweep=experiments/sweeps/large_k.py:1e5,uncalibrated \
      --out=results/large_k/step_times_1e5.json          # once per machine: the budget's exchange rate
  python -m experiments.ablate --sweep=experiments/sweeps/large_k.py:1e5 --workdir=/tmp/large_k_1e5
  python -m experiments.ablate --sweep=experiments/sweeps/large_k.py:1e6 --workdir=/tmp/large_k_1e6
  python -m experiments.large_k_report --workdirs=/tmp/large_k_1e5,/tmp/large_k_1e6 --out=results/large_k

Argument: "1e5" (default) or "1e6", the number of labels K, optionally ",budget=<seconds>" (the
calibrated train seconds per method; default SIZES[...]["budget_seconds"]) or ",uncalibrated" (the
points without their run lengths: what the step-time benchmark times).

The problem is the synthetic generator (`snm_jax.data.synthetic`: long-tailed labels inside
sub-clusters, dense 64-d features, known p(y|x)), so every method is scored against the
Bayes-optimal top-k. Methods: SNM top-k (k = 1, 16, 64; both vartheta normalisations at
B = 4,096), negative sampling (vartheta = 1/B: the SNM paper's baseline), uniform negative sampling
with Bamler & Mandt's Eq. 2 (their baseline: the tree's loss and draws per example, uniform), sampled softmax with the logQ correction, mined
sampled softmax (k = 16, 64), the adversarial tree sampler (Bamler & Mandt's Eq. 6, Eq. 5 bias
removal at prediction), SNM top-16 over tree-sampled negatives, and the full softmax (K = 10^5).

Equal wall-clock budget: every method trains for BUDGET_SECONDS of *calibrated* time. Its number of
steps is the budget divided by its step time, measured once for all methods, interleaved round-robin
in one process on the machine that runs the sweep (`benchmarks/sweep_step_times.py`, its JSON
committed next to the report). Counting steps instead of stopping on a clock keeps every run
deterministic (same seed, same bits) and resumable, and a busy machine slows a run down without
shortening it. The report's seconds axis is steps x the calibrated step time, plus the tree fit for
the tree methods; the measured train_seconds are reported too.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.sweeps.spec import REPO, Point, Sweep

SIZES = {
    # K, training points, the fraction of them held out for model selection, the largest r of the
    # reported R@r, calibrated train seconds per method: what fits the 2-core machine the committed
    # report ran on. On a cluster pass a larger budget ("1e5,budget=1800": the 20-40 min per
    # method) after calibrating there. At 10^6 every evaluation scans 10^6 rows per point: 5,000
    # validation points (as many as the test points) and R@5 at most keep the 8 evaluations of a run
    # near its training time on 2 cores (20,000 points at r = 100 took 8 min per evaluation).
    "1e5": dict(num_labels=100_000, num_train=300_000, validation_fraction=0.02, recall_r=100,
                budget_seconds=120),
    "1e6": dict(num_labels=1_000_000, num_train=1_000_000, validation_fraction=0.005, recall_r=5,
                budget_seconds=300),
}
EVALS_PER_RUN = 8  # evaluations (and diagnostics, checkpoints) per run: the learning curves' points
# Score scales, one per family, each the best validation R@5 of its probes (large_k_probes.py, the table
# in results/large_k/report.md): the ordered-weighted (bowl) losses' and the softmax / logistic losses'.
SNM_SCALE = 4.0
NS_SCALE = 2.0  # negative sampling, the baseline, tuned on its own (large_k_probes.py)
SOFTMAX_SCALE = 10.0

# Reddi et al.'s Sec. 7 open problem (issue 19): B grown during training, a third of the time budget at
# each B; each phase's steps are its time share over the step time of the fixed-B point of that B.
ADAPTIVE = "snm_k16_adaptive"
ADAPTIVE_PHASES = {1024: "b1024_snm_k16", 2048: "b2048_snm_k16", 4096: "snm_k16"}
_SNM = {"loss.kind": "bowl", "mining.vartheta": "top_k", "mining.sampler": "uniform"}
_TREE = {"mining.sampler": "tree", "loss.logit_scale": SOFTMAX_SCALE}


def _points(size: str) -> tuple[Point, ...]:
  snm = tuple(Point(f"snm_k{k}", {**_SNM, "mining.k": k}, f"SNM top-{k}") for k in (1, 16, 64))
  snm_expect = tuple(Point(f"snm_k{k}_expect", {**_SNM, "mining.k": k, "mining.vartheta_norm": "expectation"},
                           f"SNM top-{k} (expectation norm)") for k in (1, 16, 64))
  ns = Point("ns", {**_SNM, "mining.vartheta": "negative_sampling", "loss.logit_scale": NS_SCALE},
             "negative sampling")
  ssm = Point("ssm", {"loss.kind": "sampled_softmax", "loss.logit_scale": SOFTMAX_SCALE},
              "sampled softmax (logQ)")
  msm = tuple(Point(f"msm_k{k}", {"loss.kind": "mined_softmax", "mining.k": k,
                                  "loss.logit_scale": SOFTMAX_SCALE}, f"mined sampled softmax k={k}")
              for k in (16, 64))
  tree = Point("tree_s64", {**_TREE, "loss.kind": "adversarial_ns", "mining.num_samples": 64},
               "adversarial tree (Eq. 6 + Eq. 5), 64/example")
  tree_snm = Point("tree_snm_k16", {**_TREE, **{k: v for k, v in _SNM.items() if k != "mining.sampler"},
                                    "mining.k": 16, "mining.num_samples": 64, "loss.logit_scale": SNM_SCALE},
                   "SNM top-16 of 64 tree draws/example")
  small_b = tuple(Point(f"b1024_{p.name}", {**p.overrides, "mining.num_samples": 1024}, f"{p.label}, B=1,024")
                  for p in (*snm, ns, ssm))
  b2048 = Point("b2048_snm_k16", {**_SNM, "mining.k": 16, "mining.num_samples": 2048}, "SNM top-16, B=2,048")
  uniform = Point("uniform_s64", {"loss.kind": "logistic_ns", "mining.sampler": "uniform", "mining.per_example": True,
                                  "mining.num_samples": 64, "loss.logit_scale": SOFTMAX_SCALE},
                  "uniform negative sampling (Eq. 2), 64/example")
  tree16 = Point("tree_s16", {**tree.overrides, "mining.num_samples": 16},
                 "adversarial tree (Eq. 6 + Eq. 5), 16/example")
  full = Point("full_softmax", {"loss.kind": "full_softmax", "mining.sampler": "full",
                                "loss.logit_scale": SOFTMAX_SCALE}, "full softmax")
  if size == "1e6":  # the minimum at 10^6 (SNM top-16, negative sampling, the tree sampler),
    # uniform Eq. 2 for the tree's claim, and SNM top-1, the best k at 10^5
    return (snm[0], snm[1], ns, tree, uniform)
  # Negative sampling spreads each step over all B draws (weights 1/B): at the shared learning rate its
  # table moves slowly; this point shows how much a larger one recovers (same computation, same time).
  ns_lr = Point("ns_table_lr8", {**ns.overrides, "table.learning_rate": 4.0},
                "negative sampling, table learning rate x8")
  adaptive = Point(ADAPTIVE, {**_SNM, "mining.k": 16}, "SNM top-16, B grown 1,024 -> 2,048 -> 4,096")
  return (*snm, *snm_expect, ns, ssm, *msm, tree, tree_snm, full, *small_b, tree16, uniform, b2048,
          adaptive, ns_lr)


# Points whose step is the same computation as another's (a learning rate differs): the same step time.
SAME_STEP_AS = {"ns_table_lr8": "ns"}


def step_times_path(size: str) -> Path:
  return REPO / "results" / "large_k" / f"step_times_{size}.json"


def _calibrated_steps(size: str, points, budget_seconds: float) -> dict[str, int]:
  """Steps per point from the committed step times."""
  path = step_times_path(size)
  if not path.is_file():
    raise ValueError(f"{path} does not exist: measure the step times first (python -m "
                     f"benchmarks.sweep_step_times --sweep=experiments/sweeps/large_k.py:{size},uncalibrated "
                     f"--out={path})")
  times = step_times(size)
  missing = [p.name for p in points if p.name not in times and p.name != ADAPTIVE]
  if missing:
    raise ValueError(f"{path} has no step time for {missing}: re-run benchmarks/sweep_step_times.py")
  return {p.name: max(EVALS_PER_RUN, round(budget_seconds * 1000 / times[p.name] / EVALS_PER_RUN)
                      * EVALS_PER_RUN) for p in points if p.name != ADAPTIVE}


def step_times(size: str) -> dict[str, float]:
  """ms per step of every point: the measured ones (step_times_<size>.json) and SAME_STEP_AS."""
  times = json.loads(step_times_path(size).read_text())["ms_per_step"]
  return {**times, **{p: times[q] for p, q in SAME_STEP_AS.items() if q in times}}


def adaptive_schedule(times: dict, budget_seconds: float) -> tuple[tuple[int, int], ...]:
  """((start_step, B), ...): a third of the budget at each B of ADAPTIVE_PHASES."""
  starts, step = [], 0
  for b, point in ADAPTIVE_PHASES.items():
    starts.append((step, b))
    step += round(budget_seconds / len(ADAPTIVE_PHASES) * 1000 / times[point])
  return tuple(starts), step


def ms_phases(point: str, overrides: dict, times: dict) -> list[tuple[int, float]]:
  """[(start_step, ms per step)] of a point: one phase, or the adaptive point's phases."""
  schedule = overrides.get("mining.num_samples_schedule") or ()
  if not schedule:
    return [(0, times[point])]
  return [(start, times[ADAPTIVE_PHASES[b]]) for start, b in schedule]


def base_overrides(size: str) -> dict:
  """The settings every point of the sweep shares (its problem, model and schedule)."""
  s = SIZES[size]
  return {
      "dataset.synthetic.num_labels": s["num_labels"], "dataset.synthetic.num_train": s["num_train"],
      "dataset.synthetic.num_test": 5000,
      # Fast methods get many epochs in the budget: the reported state is the one with the best
      # validation R@5 (evaluated EVALS_PER_RUN times), so none is scored past its overfitting.
      "dataset.validation_fraction": s["validation_fraction"], "eval.select_metric": "R@5",
      "model.hidden": 256, "model.out": 128, "model.bag_matmul": "dense",
      # Unnormalised class rows from a small init: a row's norm can carry its label's prior, which
      # cosine scores cannot (validation R@5 after 3,494 steps of SNM top-16: 0.413 against 0.000
      # with cosine rows, 0.214 from init 0.1; large_k_probes.py).
      "model.normalize_classes": False, "table.init_scale": 0.01,
      "train.batch_size": 256, "train.log_every": 500, "train.keep_checkpoints": 1,
      "mining.num_samples": 4096, "mining.num_strata": 8, "loss.logit_scale": SNM_SCALE,
      "eval.recall_r": s["recall_r"], "diagnostics.probe_size": 64, "diagnostics.snr_draws": 8,
      **_schedule(EVALS_PER_RUN * 250),  # replaced per point once calibrated
  }


def get_sweep(arg: str = "1e5") -> Sweep:
  size, *options = (arg or "1e5").split(",")
  if size not in SIZES:
    raise ValueError(f"large_k sweep argument {size!r}: one of {sorted(SIZES)}")
  s = dict(SIZES[size])
  uncalibrated = False
  for option in options:
    key, _, value = option.partition("=")
    if option == "uncalibrated":  # what benchmarks/sweep_step_times.py times
      uncalibrated = True
    elif key != "budget" or not value.replace(".", "", 1).isdigit() or float(value) <= 0:
      raise ValueError(f"large_k sweep option {option!r}: budget=<seconds > 0> or uncalibrated")
    else:
      s["budget_seconds"] = float(value)
  points = _points(size)
  if not uncalibrated:  # each point's run length: its share of the equal budget
    steps = _calibrated_steps(size, points, s["budget_seconds"])
    adaptive = ()
    if any(p.name == ADAPTIVE for p in points):  # only the 1e5 sweep grows B
      adaptive, steps[ADAPTIVE] = adaptive_schedule(step_times(size), s["budget_seconds"])
    points = tuple(Point(p.name, {**p.overrides, **_schedule(steps[p.name]),
                                  **({"mining.num_samples_schedule": adaptive} if p.name == ADAPTIVE else {})},
                         p.label) for p in points)
  return Sweep(
      title=f"Large K (K = {s['num_labels']:,}): the papers' methods at equal wall-clock",
      config="experiments/configs/snm.py:synthetic",
      base_overrides=base_overrides(size),
      points=points,
      seeds=(0, 1, 2),
      baseline="ns",
      curve_metric="R@5",
      table_metrics=("R@1", "R@5", "P@1", "P@5", "PSP@5", "nDCG@5"),
      notes=(f"Synthetic generator, K = {s['num_labels']:,} labels (64 concepts x 8 sub-clusters, Zipf "
             f"labels inside each), dense 64-d features, {s['num_train']:,} training and 5,000 test points; "
             "SNM tower 256 -> 128, batch 256, B = 4,096 shared uniform negatives unless the point says "
             f"otherwise; each method trained for {s['budget_seconds']} s of calibrated time "
             "(results/large_k/step_times_*.json), the state with the best validation R@5 of 8 evaluations "
             f"({s['validation_fraction']:.1%} of the training points held out), 3 seeds (the data is the "
             "same for all seeds)."),
  )


def _schedule(num_steps: int) -> dict[str, int]:
  every = max(1, num_steps // EVALS_PER_RUN)
  return {"train.num_steps": num_steps, "train.eval_every": every, "train.checkpoint_every": every,
          "diagnostics.every": every}
