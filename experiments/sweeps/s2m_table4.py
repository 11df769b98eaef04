r"""Table 4 of Rawat et al. (2021), scaled down: S2M's k' in {N_mb/8, N_mb/4, N_mb}
with top-k mining, recall@r per Head / Torso / Tail, on synthetic data.

  python -m experiments.ablate --sweep=experiments/sweeps/s2m_table4.py --workdir=/tmp/s2m
  python -m experiments.report /tmp/s2m --out=results/s2m_table4

The paper: N_mb = 2,048, k = 64 of K-bar = 4,096 sampled negatives, k' in
{256, 512, 2048}, logistic phi, on AmazonCat-13K / Wiki-LSHTC / Amazon-670K.
Here: N_mb = 128, k = 16 of B = 1,024 (the same k / B = 1/64), k' in
{16, 32, 128}, on the synthetic generator with K = 4,096 long-tailed labels
and 3 feature subpopulations (k' = N_mb is plain SNM).
"""

from experiments.sweeps.spec import Point, Sweep


def get_sweep(arg: str = "") -> Sweep:
  del arg
  n_mb = 128
  return Sweep(
      title="Table 4 (Rawat et al. 2021) scaled down: S2M k' on synthetic data (K = 4096)",
      config="experiments/configs/s2m.py:synthetic",
      base_overrides={"train.batch_size": n_mb, "mining.num_samples": 1024, "mining.k": 16,
                      "loss.scale": 10.0,
                      "dataset.synthetic.num_train": 50_000, "train.num_steps": 1500,
                      "train.eval_every": 500, "train.checkpoint_every": 1000},
      points=tuple(Point(f"kprime{k}", {"loss.k_prime": k},
                         f"k'={k}" + (" (=N_mb, plain SNM)" if k == n_mb else f" (N_mb/{n_mb // k})"))
                   for k in (n_mb // 8, n_mb // 4, n_mb)),
      seeds=(0, 1),
      baseline=f"kprime{n_mb}",
      curve_metric="R@5",
      notes=("Synthetic generator, K = 4,096 labels, 50,000 training / 2,000 test points, "
             "64-d dense features; SNM top-16 of B = 1,024 uniform shared negatives, BOWL with "
             "the logistic phi on 10 x the cosine scores (at scale 1 the logistic loss of "
             "cosines in [-1, 1] barely trains: R@5 < 0.03 after 1,500 steps), N_mb = 128, 1,500 steps (~4 epochs). Ratios are to k' = N_mb "
             "(plain SNM)."),
  )
