r"""How the large-K sweep's shared hyper-parameters were chosen: short runs scored on VALIDATION.

  python -m experiments.ablate --sweep=experiments/sweeps/large_k_probes.py:1e5 --workdir=/tmp/large_k_probes
  python -m experiments.large_k_report --workdirs=/tmp/large_k_1e5 --probes=/tmp/large_k_probes

Each probe is the large-K problem and model (`large_k.base_overrides`) trained for PROBE_STEPS steps
(two evaluations), seed 0, and judged by its best validation R@5 (2 % of the training points; the
report shows only validation numbers). One choice per family, applied to all its points:
  snm_*   the ordered-weighted (bowl) family: SNM top-k, both normalisations, SNM over tree draws:
          the score scale, cosine vs unnormalised class rows, the rows' init (chosen on top-16);
  ssm_*   the softmax and logistic family (sampled / mined / full softmax, uniform and tree Eq. 2 / 6
          negative sampling): the score scale.
  ns_*    negative sampling (vartheta = 1/B), the baseline every ratio divides by, gets its own score
          scale: its weights spread each step over all B draws, so it prefers a smaller one than SNM
          (tuning the baseline separately makes the SNM-vs-NS ratios conservative).
"""

from __future__ import annotations

from experiments.sweeps import large_k
from experiments.sweeps.spec import Point, Sweep

PROBE_STEPS = 3494  # two evaluations at snm_k16's interval, a quarter of its K = 10^5 budget
_SNM = {"loss.kind": "bowl", "mining.vartheta": "top_k", "mining.sampler": "uniform", "mining.k": 16}
_NS = {"loss.kind": "bowl", "mining.vartheta": "negative_sampling", "mining.sampler": "uniform"}
_SSM = {"loss.kind": "sampled_softmax"}
# Cosine scores: L2-normalised rows, started at unit scale (table.init_scale 1; the raw rows' 0.01
# would make the normalised rows' effective step 100x larger), as these probes ran.
COSINE = {"model.normalize_classes": True, "table.init_scale": 1.0}
CHOOSING = ("snm", "softmax", "ns")  # every family's best probe sets its points
# Probe name -> (family, overrides); the family's chosen probe is the one with the best validation R@5.
PROBES = {
    "snm_s2": ("snm", {**_SNM, "loss.logit_scale": 2.0}),
    "snm_s4": ("snm", {**_SNM, "loss.logit_scale": 4.0}),
    "snm_s8": ("snm", {**_SNM, "loss.logit_scale": 8.0}),
    "snm_s16": ("snm", {**_SNM, "loss.logit_scale": 16.0}),
    "snm_s8_cosine": ("snm", {**_SNM, **COSINE, "loss.logit_scale": 8.0}),
    "snm_s8_init0.1": ("snm", {**_SNM, "loss.logit_scale": 8.0, "table.init_scale": 0.1}),
    "ssm_s5": ("softmax", {**_SSM, "loss.logit_scale": 5.0}),
    "ssm_s10": ("softmax", {**_SSM, "loss.logit_scale": 10.0}),
    "ssm_s20": ("softmax", {**_SSM, "loss.logit_scale": 20.0}),
    "ssm_s10_cosine": ("softmax", {**_SSM, **COSINE, "loss.logit_scale": 10.0}),
    "ns_s1": ("ns", {**_NS, "loss.logit_scale": 1.0}),
    "ns_s2": ("ns", {**_NS, "loss.logit_scale": 2.0}),
    "ns_s4": ("ns", {**_NS, "loss.logit_scale": 4.0}),
    "ns_s8": ("ns", {**_NS, "loss.logit_scale": 8.0}),
}


def get_sweep(arg: str = "1e5") -> Sweep:
  size = arg or "1e5"
  if size != "1e5":
    raise ValueError(f"large_k_probes argument {arg!r}: only 1e5 (1e6 uses the 1e5 choices)")
  base = {**large_k.base_overrides(size), "train.num_steps": PROBE_STEPS,
          "train.eval_every": PROBE_STEPS // 2, "train.checkpoint_every": PROBE_STEPS // 2,
          "diagnostics.every": 0}
  return Sweep(
      title="Large K hyper-parameter probes (validation R@5)",
      config="experiments/configs/snm.py:synthetic",
      base_overrides=base,
      points=tuple(Point(name, over, f"{family}: {name}") for name, (family, over) in PROBES.items()),
      seeds=(0,),
      baseline="ns_s8",
      curve_metric="R@5",
      table_metrics=("R@5",),
      notes=f"{PROBE_STEPS} steps of the large-K problem; judged on validation R@5 only.",
  )
