r"""vartheta families (Reddi et al. 2019, Sec. 4): top-k with "mean" vs
"expectation" scaling, power laws, top-k with a calibration floor, on Bibtex.

  python -m experiments.ablate --sweep=experiments/sweeps/vartheta.py --workdir=/tmp/vartheta
  python -m experiments.report /tmp/vartheta --out=results/vartheta

"mean" normalises the weights to sum 1 (top-k: the average of the k hardest
sampled negatives); "expectation" to (K-1)/B, so that the expected loss is
the OWL of Lemma 2. Power laws weigh the j-th hardest of all B negatives by
j^-alpha; the floor gives every negative beyond the top k the weight eps
(footnote 2: a strictly positive floor restores calibration).
"""

from experiments.sweeps.spec import RAW_COSINES, Point, Sweep, negative_sampling_point, schedule


def get_sweep(arg: str = "") -> Sweep:
  del arg
  b = 64
  return Sweep(
      title="vartheta families on Bibtex (B = 64)",
      config="experiments/configs/snm.py:bibtex",
      base_overrides={**RAW_COSINES, "mining.num_samples": b, **schedule(400, 200, 200)},
      points=(
          negative_sampling_point("negative sampling (1/B)"),
          Point("top16_mean", {"mining.k": 16, "mining.vartheta_norm": "mean"}, "top-16, mean"),
          Point("top16_expect", {"mining.k": 16, "mining.vartheta_norm": "expectation"},
                "top-16, expectation"),
          Point("pow0.5", {"mining.vartheta": "power_law", "mining.k": b,
                           "mining.power_alpha": 0.5}, "power law a=0.5"),
          Point("pow1", {"mining.vartheta": "power_law", "mining.k": b,
                         "mining.power_alpha": 1.0}, "power law a=1"),
          Point("pow2", {"mining.vartheta": "power_law", "mining.k": b,
                         "mining.power_alpha": 2.0}, "power law a=2"),
          Point("top1", {"mining.k": 1}, "top-1"),
          Point("top1_floor", {"mining.k": 1, "mining.floor": 0.01}, "top-1 + floor 0.01"),
      ),
      seeds=(0,),
      baseline="ns",
      notes=("Bibtex, B = 64 uniform shared negatives, BOWL/hinge, batch 128, 400 steps, "
             "one seed per point (short runs: differences below ~0.01 are within noise, see "
             "the two-seed spread of the Table 2 sweep)."),
  )
