r"""Adversarial negative sampling (Bamler & Mandt, ICLR 2020) and its baselines.

  python -m experiments.train --config=experiments/configs/adversarial.py:bibtex,method=adversarial --workdir=...
  python -m experiments.train --config=experiments/configs/adversarial.py:synthetic,method=uniform --workdir=...

Argument "<dataset>,method=<m>[,runlocal]": dataset in {bibtex, delicious, synthetic}; method:
  adversarial  tree sampler, Eq. 6 loss, prediction with xi + log p_n (Eq. 5)
  uniform      uniform negative sampling, logistic loss (Eq. 2)
  unigram      frequency-proportional negative sampling, logistic loss
  nce_tree     NCE with the tree as noise distribution (no bias removal)
  softmax      full softmax (small K only)
  adversarial_snm  tree-sampled negatives mined with top-k SNM (a combination none of the papers tried)
The model is their linear one, xi_y(x) = x^T w_y + b_y, trained with row-wise Adagrad,
one negative per example (per-example draws); first-label conversion of multi-label data.
"""

from experiments.configs import common

METHODS = ("adversarial", "uniform", "unigram", "nce_tree", "softmax", "adversarial_snm")


def get_config(arg: str = ""):
  args = common.parse_arg(arg, dataset="bibtex", method="adversarial", runlocal=False)
  method = common.one_of("method", args.method, METHODS)
  c = common.base_config()
  c.dataset.name = args.dataset
  c.dataset.conversion = "first_label"
  c.dataset.synthetic.num_labels = 16384
  c.dataset.synthetic.num_train = 60000
  c.dataset.synthetic.dim = 64
  c.model.kind = "linear"
  c.model.normalize_classes = False
  c.table.optimizer = "adagrad"
  c.table.learning_rate = 0.1
  c.optimizer.name = "sgd"          # the linear model has no tower parameters
  c.mining.num_strata = 1
  c.mining.per_example = True
  c.mining.num_samples = 1
  c.mining.k = 1
  c.loss.kind = "logistic_ns"
  c.loss.adv_lambda = 1e-3
  c.train.batch_size = 256
  c.train.num_steps = 2000
  c.train.log_every = 100
  c.train.eval_every = 200
  c.train.checkpoint_every = 1000
  c.eval.log_likelihood = True
  if method == "adversarial":
    c.mining.sampler, c.loss.kind = "tree", "adversarial_ns"
  elif method == "uniform":
    c.mining.sampler = "uniform"
  elif method == "unigram":
    c.mining.sampler = "unigram"
  elif method == "nce_tree":
    c.mining.sampler, c.loss.kind = "tree", "nce"
  elif method == "softmax":
    c.mining.sampler, c.loss.kind, c.mining.per_example = "full", "full_softmax", False
  elif method == "adversarial_snm":
    c.mining.sampler, c.loss.kind, c.mining.num_samples, c.mining.k = "tree", "bowl", 64, 4
    c.loss.phi = "logistic"

  def small(cfg):  # runlocal: the common small variant, with one negative (8 for adversarial_snm)
    common.apply_runlocal(cfg)
    cfg.mining.num_samples = 1 if method != "adversarial_snm" else 8
    cfg.mining.k = 1

  return common.finish(c, args, small)
