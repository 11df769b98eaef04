r"""Table 2 of Reddi et al. (2019) on Delicious: k in {1, 16, 64, 256} vs negative sampling.

  python -m experiments.ablate --sweep=experiments/sweeps/table2_delicious.py --workdir=/tmp/t2_del
  python -m experiments.report /tmp/t2_del --out=results/table2_delicious

Delicious has K = 983 labels, so B = 512 sampled negatives leave room for the
paper's full k list.
"""

from experiments.sweeps.spec import (RAW_COSINES, Sweep, negative_sampling_point, schedule,
                                    top_k_points)


def get_sweep(arg: str = "") -> Sweep:
  del arg
  return Sweep(
      title="Table 2 (Reddi et al. 2019) on Delicious: SNM top-k vs negative sampling",
      config="experiments/configs/snm.py:delicious",
      base_overrides={**RAW_COSINES, "mining.num_samples": 512, **schedule(300, 150, 150)},
      points=top_k_points((1, 16, 64, 256)) + (negative_sampling_point(),),
      seeds=(0, 1),
      baseline="ns",
      notes=("Delicious (K = 983): B = 512 uniform shared negatives, BOWL with the hinge phi, "
             "256-wide tower, batch 128, 300 steps (~3 epochs of 12,920 points)."),
  )
