r"""The negative sampling baseline: the same loss as SNM with constant weights
over all B sampled negatives (vartheta_j = 1/B, mining.vartheta_norm="mean").

  python -m experiments.train --config=experiments/configs/negative_sampling.py:bibtex --workdir=...
"""

from experiments.configs import common, snm


def get_config(arg: str = ""):
  variant, kv = common.parse_arg(arg)
  c = snm.configure_dataset(common.base_config(), variant)
  c.mining.vartheta = "negative_sampling"
  c.mining.k = 1
  return common.finish(c, kv)
