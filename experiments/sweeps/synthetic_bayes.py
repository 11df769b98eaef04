r"""SNM, negative sampling and the full softmax (scale 10) against the Bayes-optimal predictor.

  python -m experiments.ablate --sweep=experiments/sweeps/synthetic_bayes.py --workdir=/tmp/bayes
  python -m experiments.report /tmp/bayes --out=results/synthetic_bayes

The synthetic generator knows p(y|x), so the top-5 of p(y|x) (Lemma 1 of
Reddi et al. 2019) gives the best achievable R@5 on its test set; the report
shows each method's R@5 as a fraction of it.
"""

from experiments.sweeps.spec import (RAW_COSINES, Point, Sweep, negative_sampling_point, schedule,
                                    top_k_points)


def get_sweep(arg: str = "") -> Sweep:
  del arg
  return Sweep(
      title="Synthetic data (K = 1024): SNM, negative sampling and full softmax vs the Bayes-optimal top-5",
      config="experiments/configs/snm.py:synthetic",
      base_overrides={**RAW_COSINES, "dataset.synthetic.num_labels": 1024,
                      "dataset.synthetic.num_train": 50_000, "mining.num_samples": 256,
                      **schedule(4000, 1000, 2000)},
      points=top_k_points((1, 16)) + (
          negative_sampling_point(),
          Point("k16_8k", {"mining.k": 16, "train.num_steps": 8000, "train.eval_every": 2000},
                "SNM top-16, 8,000 steps"),
          Point("softmax", {"loss.kind": "full_softmax", "mining.sampler": "full",
                            "loss.logit_scale": 10.0}, "full softmax"),
      ),
      seeds=(0,),
      baseline="ns",
      curve_metric="R@5",
      notes=("Synthetic generator with K = 1,024 labels (16 concepts x 8 sub-clusters, "
             "Zipf labels inside each), 3 subpopulations, 64-d dense features, 50,000 training "
             "and 2,000 test points (the generator's default test size and seed); BOWL/hinge, "
             "B = 256 uniform shared negatives, batch 128, 4,000 steps (~10 epochs; one SNM point "
             "also with 8,000). Full softmax: scores x 10 (experiments/configs/full_softmax.py)."),
  )
