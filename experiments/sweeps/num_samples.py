r"""B in {256, 1024, 4096} sampled negatives at fixed k = 16, on synthetic data with K = 20,000.

  python -m experiments.ablate --sweep=experiments/sweeps/num_samples.py --workdir=/tmp/bsweep
  python -m experiments.report /tmp/bsweep --out=results/num_samples

A larger B finds harder negatives (the top 16 of more candidates) at a cost
per step that grows with B: the report's cost table is the point here.
"""

from experiments.sweeps.spec import RAW_COSINES, Point, Sweep, schedule


def get_sweep(arg: str = "") -> Sweep:
  del arg
  return Sweep(
      title="B (sampled negatives) at fixed k = 16, synthetic K = 20,000",
      config="experiments/configs/snm.py:synthetic",
      base_overrides={**RAW_COSINES, "dataset.synthetic.num_labels": 20_000,
                      "dataset.synthetic.num_train": 50_000, "mining.k": 16,
                      **schedule(1500, 500, 1000)},
      points=tuple(Point(f"B{b}", {"mining.num_samples": b}, f"B={b}") for b in (256, 1024, 4096)),
      seeds=(0,),
      baseline="B256",
      curve_metric="R@5",
      notes=("Synthetic generator, K = 20,000 labels (64 concepts x 8 sub-clusters, ~39 labels "
             "each), 50,000 training / 2,000 test points; SNM top-16 BOWL/hinge, batch 128, "
             "1,500 steps. Ratios are to B = 256."),
  )
