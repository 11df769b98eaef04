r"""POWL vs BOWL and each surrogate phi, with top-16 SNM on Bibtex.

  python -m experiments.ablate --sweep=experiments/sweeps/owl_phi.py --workdir=/tmp/owl_phi
  python -m experiments.report /tmp/owl_phi --out=results/owl_phi

POWL: sum_j theta_j phi(v_y - v_[j]) (pairwise); BOWL: phi(v_y) + sum_j
theta_j phi(-v_[j]) (binary); phi in {hinge, logistic, squared hinge,
exponential}, on cosine scores in [-1, 1] (loss.logit_scale = 1), plus the logistic
phi on 10 x the cosines.
"""

from experiments.sweeps.spec import RAW_COSINES, Point, Sweep, schedule

PHIS = ("hinge", "logistic", "squared_hinge", "exponential")


def get_sweep(arg: str = "") -> Sweep:
  del arg
  points = tuple(Point(f"{kind}_{phi}", {"loss.kind": kind, "loss.phi": phi},
                       f"{kind.upper()} {phi.replace('_', ' ')}")
                 for kind in ("bowl", "powl") for phi in PHIS)
  # The logistic phi of cosines in [-1, 1] has small gradients: also with scores x 10.
  points += tuple(Point(f"{kind}_logistic_x10", {"loss.kind": kind, "loss.phi": "logistic",
                                                 "loss.logit_scale": 10.0},
                        f"{kind.upper()} logistic, scale 10") for kind in ("bowl", "powl"))
  return Sweep(
      title="POWL vs BOWL x phi on Bibtex (SNM top-16, B = 64)",
      config="experiments/configs/snm.py:bibtex",
      base_overrides={**RAW_COSINES, "mining.num_samples": 64, "mining.k": 16,
                      **schedule(400, 200, 200)},
      points=points,
      seeds=(0,),
      baseline="bowl_hinge",
      notes=("Bibtex, SNM top-16 of B = 64 uniform shared negatives, batch 128, 400 steps, one "
             "seed per point, scores = cosines (loss.logit_scale = 1) except the two 'scale 10' points. "
             "Ratios are to BOWL/hinge (the default), not to negative sampling."),
  )
