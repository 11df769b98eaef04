r"""Table 2 of Reddi et al. (2019) on Delicious: k in {1, 16, 64, 256} vs negative sampling.

  python -m experiments.ablate --sweep=experiments/sweeps/table2_delicious.py --workdir=/tmp/t2_del
  python -m experiments.report /tmp/t2_del --out=results/table2_delicious

Delicious has K = 983 labels, so B = 512 sampled negatives leave room for the
paper's full k list.
"""

from experiments.sweeps.spec import Point, Sweep


def get_sweep(arg: str = "") -> Sweep:
  del arg
  return Sweep(
      title="Table 2 (Reddi et al. 2019) on Delicious: SNM top-k vs negative sampling",
      config="experiments/configs/snm.py:delicious",
      base_overrides={"loss.logit_scale": 1.0,  # the scale these results were measured at
                      "mining.num_samples": 512, "train.num_steps": 300,
                      "train.eval_every": 150, "train.checkpoint_every": 150},
      points=(
          Point("k1", {"mining.k": 1}, "SNM top-1"),
          Point("k16", {"mining.k": 16}, "SNM top-16"),
          Point("k64", {"mining.k": 64}, "SNM top-64"),
          Point("k256", {"mining.k": 256}, "SNM top-256"),
          Point("ns", {"mining.vartheta": "negative_sampling"}, "negative sampling"),
      ),
      seeds=(0, 1),
      baseline="ns",
      notes=("Delicious (K = 983): B = 512 uniform shared negatives, BOWL with the hinge phi, "
             "256-wide tower, batch 128, 300 steps (~3 epochs of 12,920 points)."),
  )
