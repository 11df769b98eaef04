r"""Table 2 of Reddi et al. (2019) on Bibtex: top-k SNM vs negative sampling.

  python -m experiments.ablate --sweep=experiments/sweeps/table2_bibtex.py --workdir=/tmp/t2_bibtex
  python -m experiments.ablate --sweep=experiments/sweeps/table2_bibtex.py:b16 --workdir=/tmp/t2_b16
  python -m experiments.report /tmp/t2_bibtex --out=results/table2_bibtex

Bibtex has K = 159 labels, so the paper's k = 256 cannot exist. Default: B =
128 sampled negatives per minibatch (shared, uniform) and k in {1, 16, 64}.
"b16": B = 16 (~10% of K, the paper's B/K: 1,024 of 13,330 for AmazonCat-13K,
32,768 of 670,091 for Amazon-670K) and k in {1, 4}. "logistic": the default
with the logistic phi on 10 x the cosine scores instead of the hinge, one
seed. In all, the "negative sampling" point is the same loss with
vartheta_j = 1/B (k = B).
"""

from experiments.sweeps.spec import (RAW_COSINES, Sweep, negative_sampling_point, schedule,
                                    top_k_points)


def get_sweep(arg: str = "") -> Sweep:
  if arg not in ("", "b16", "logistic"):
    raise ValueError(f"unknown variant {arg!r} of table2_bibtex; choose '', 'b16' or 'logistic'")
  b, ks = (16, (1, 4)) if arg == "b16" else (128, (1, 16, 64))
  phi = {"loss.phi": "logistic", "loss.logit_scale": 10.0} if arg == "logistic" else {}
  return Sweep(
      title=(f"Table 2 (Reddi et al. 2019) on Bibtex: SNM top-k vs negative sampling, B = {b}"
             + (", logistic phi x 10" if phi else "")),
      config="experiments/configs/snm.py:bibtex",
      base_overrides={**RAW_COSINES, "mining.num_samples": b, **schedule(600, 200, 300), **phi},
      points=top_k_points(ks) + (negative_sampling_point(),),
      seeds=(0,) if phi else (0, 1),
      baseline="ns",
      notes=(f"Bibtex (K = 159): B = {b} uniform shared negatives per minibatch, k in "
             f"{{{', '.join(map(str, ks))}}} (k <= B, so the paper's k = 256 is left out); BOWL with the "
             + ("logistic phi on 10 x the cosines, " if phi else "hinge phi, ")
             + "256-wide tower, batch 128, 600 steps (~16 epochs)."),
  )
