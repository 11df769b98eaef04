r"""Table 4 of Rawat et al. (2021), scaled down: S2M's k' in {N_mb/8, N_mb/4, N_mb}
with top-k mining, recall@r per Head / Torso / Tail.

  python -m experiments.ablate --sweep=experiments/sweeps/s2m_table4.py --workdir=/tmp/s2m
  python -m experiments.ablate --sweep=experiments/sweeps/s2m_table4.py:synthetic --workdir=/tmp/s2m_syn
  python -m experiments.report /tmp/s2m --out=results/s2m_table4

The paper: N_mb = 2,048, k = 64 of K-bar = 4,096 sampled negatives, k' in
{256, 512, 2048}, logistic phi, on AmazonCat-13K / Wiki-LSHTC / Amazon-670K.
Here: N_mb = 128 and k' in {16, 32, 128} (k' = N_mb is plain SNM), logistic
phi on 10 x the cosine scores (at scale 1 the logistic loss of cosines in
[-1, 1] barely trains: R@5 < 0.03 after 1,500 steps on the synthetic data).
  "" (default): Delicious, K = 983, k = 16 of B = 512.
  "synthetic": the generator with K = 4,096 and 3 feature subpopulations,
    k = 16 of B = 1,024 (the paper's k / B = 1/64), 50,000 training points.
"""

from experiments.sweeps.spec import Sweep, k_prime_points, schedule


def get_sweep(arg: str = "") -> Sweep:
  n_mb = 128
  common = {"train.batch_size": n_mb, "mining.k": 16, "loss.logit_scale": 10.0}
  if arg == "synthetic":
    config = "experiments/configs/s2m.py:synthetic"
    base = {**common, "mining.num_samples": 1024, "dataset.synthetic.num_train": 50_000,
            **schedule(1500, 500, 1000)}
    notes = ("Synthetic generator, K = 4,096 labels, 50,000 training / 2,000 test points, 64-d "
             "dense features; SNM top-16 of B = 1,024 uniform shared negatives, BOWL with the "
             "logistic phi on 10 x the cosines, N_mb = 128, 1,500 steps (~4 epochs).")
  elif arg == "":
    config = "experiments/configs/s2m.py:delicious"
    base = {**common, "mining.num_samples": 512, **schedule(400, 200, 200)}
    notes = ("Delicious (K = 983), SNM top-16 of B = 512 uniform shared negatives, BOWL with the "
             "logistic phi on 10 x the cosines, N_mb = 128, 400 steps (~4 epochs).")
  else:
    raise ValueError(f"unknown variant {arg!r} of s2m_table4; choose '' or 'synthetic'")
  return Sweep(
      title=f"Table 4 (Rawat et al. 2021) scaled down: S2M k' on {arg or 'delicious'}",
      config=config,
      base_overrides=base,
      points=k_prime_points(
          (n_mb // 8, n_mb // 4, n_mb),
          lambda k: f"k'={k}" + (" (=N_mb, plain SNM)" if k == n_mb else f" (N_mb/{n_mb // k})")),
      seeds=(0, 1),
      baseline=f"kprime{n_mb}",
      curve_metric="R@5",
      notes=notes + " Ratios are to k' = N_mb (plain SNM).",
  )
