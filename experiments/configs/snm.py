r"""Top-k stochastic negative mining (Reddi et al. 2019), on every dataset.

  python -m experiments.train --config=experiments/configs/snm.py --workdir=/tmp/snm_bibtex
  python -m experiments.train --config=experiments/configs/snm.py:delicious,k=64 --workdir=...
  python -m experiments.train --config=experiments/configs/snm.py:amazon670k --workdir=...

Argument: "<variant>[,k=K][,kind=bowl|powl][,runlocal=1]" where variant is one of
bibtex (default), delicious, synthetic, amazoncat13k, wikilshtc325k, amazon670k, amazon3m.
The paper's ablation is k in {1, 16, 64, 256}.
"""

from experiments.configs import common

VARIANTS = {
    "amazoncat13k": "amazoncat-13k",
    "wikilshtc325k": "wiki-lshtc-325k",
    "amazon670k": "amazon-670k",
    "amazon3m": "amazon-3m",
}


def configure_dataset(c, variant: str):
  """Dataset-dependent settings shared by the SNM / NS / S2M / softmax configs."""
  if variant in VARIANTS:
    common.apply_paper_scale(c, VARIANTS[variant])
  elif variant in ("", "bibtex", "delicious", "synthetic"):
    c.dataset.name = variant or "bibtex"
    c.model.hidden = 256
    c.model.out = 256
    c.mining.num_samples = 64 if c.dataset.name == "bibtex" else 256
    c.table.learning_rate = 0.5
    c.optimizer.learning_rate = 0.05
    c.loss.logit_scale = 8.0  # see default.py: hinge margins on raw cosines are degenerate
    c.train.batch_size = 128
    c.train.num_steps = 1000 if c.dataset.name == "bibtex" else 2000
    c.train.log_every = 100
    c.train.eval_every = 250
    c.train.checkpoint_every = 500
  else:
    raise ValueError(f"unknown dataset variant {variant!r}; choose from bibtex, delicious, "
                     f"synthetic, {', '.join(VARIANTS)}")
  return c


def get_config(arg: str = ""):
  variant, kv = common.parse_arg(arg)
  c = configure_dataset(common.base_config(), variant)
  c.mining.vartheta = "top_k"
  c.mining.k = int(kv.pop("k", 16))
  c.loss.kind = kv.pop("kind", "bowl")
  return common.finish(c, kv)
