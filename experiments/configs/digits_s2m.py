r"""S2M's small-scale experiment (Rawat et al. 2021, Table 3): average top-k' SGD
on the digits with 5 of the 10 classes downsampled 100:1 in training.

  python -m experiments.train --config=experiments/configs/digits_s2m.py --workdir=/tmp/digits
  python -m experiments.train --config=experiments/configs/digits_s2m.py:kprime=16 --workdir=...
  python -m experiments.ablate --sweep=experiments/sweeps/digits_s2m.py --workdir=/tmp/digits_sweep

Argument: "[kprime=K'][,runlocal]"; k' = train.batch_size (64, also kprime=0, the default) is plain SGD.

Model and loss: a linear classifier (the class table holds [w_y, b_y] over the
64 raw pixel features in [0, 1]) trained with the full softmax
cross-entropy over the K = 10 classes. With K = 10 there is nothing to mine:
SNM would need B <= 9 sampled negatives and would add sampling noise that
confounds the one knob studied here, the k' of the minibatch reduction, so
the exact multiclass logistic loss of the paper's small-scale study is used.
Classes are not L2-normalised (the linear table starts at zero).
"""

from experiments.configs import common


def small(c):
  """The seconds-long variant (runlocal): fewer, smaller steps; the model is already tiny."""
  return common.shorten_run(c, num_steps=40, log_every=10)


def get_config(arg: str = ""):
  args = common.parse_arg(arg, kprime=0, runlocal=False)
  c = common.base_config()
  c.dataset.name = "digits_head_tail"
  c.dataset.synthetic.seed = 0     # Which classes are Tail and which examples they keep.
  c.dataset.normalize_rows = False  # Raw pixels / 16, as in scikit-learn's digits.
  c.model.kind = "linear"
  c.model.normalize_classes = False
  c.loss.kind = "full_softmax"
  c.loss.logit_scale = 1.0
  c.loss.reduction = "s2m"
  c.mining.sampler = "full"
  c.table.optimizer = "sgd"
  c.table.learning_rate = 0.5
  c.train.batch_size = 64          # N_mb of the paper's Table 3.
  c.loss.k_prime = args.kprime or c.train.batch_size
  c.train.num_steps = 1500         # ~200 epochs of the ~455 training digits.
  c.train.log_every = 100
  c.train.eval_every = 250
  c.train.checkpoint_every = 500
  c.eval.k_max = 5
  c.eval.recall_r = 10
  return common.finish(c, args, small)
