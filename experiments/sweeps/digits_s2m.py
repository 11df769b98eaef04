r"""Table 3 of Rawat et al. (2021): average top-k' SGD on the 100:1 head/tail digits.

  python -m experiments.ablate --sweep=experiments/sweeps/digits_s2m.py --workdir=/tmp/digits
  python -m experiments.report /tmp/digits --out=results/digits_s2m

k' in {1, 16, 32, 64} of N_mb = 64 (k' = 64 is plain minibatch SGD). Each seed
redraws which 5 classes are Tail, the one training example each keeps, and
the data order (the test half of the digits is never downsampled).
Head / Tail accuracy = recall@1 on the test points of the Head / Tail classes.
"""

from experiments.sweeps.spec import Sweep, k_prime_points, schedule


def get_sweep(arg: str = "") -> Sweep:
  del arg
  return Sweep(
      title="Table 3 (Rawat et al. 2021): average top-k' SGD on head/tail digits",
      config="experiments/configs/digits_s2m.py",
      base_overrides=schedule(3000, 500, 1000),
      points=k_prime_points((1, 16, 32, 64), lambda k: f"k'={k}" + (" (plain SGD)" if k == 64 else "")),
      seeds=(0, 1, 2, 3, 4),
      seed_fields=("seed", "dataset.synthetic.seed"),
      baseline="kprime64",
      curve_metric="P@1",
      table_metrics=("P@1", "R@3", "PSP@1"),
      class_accuracy=True,
      notes=("Linear softmax classifier on the 64 raw pixel features, full softmax over the "
             "K = 10 classes (nothing to mine), SGD with learning rate 0.5, batch N_mb = 64, "
             "3,000 steps (~420 epochs of the ~455 training digits)."),
  )
