r"""The negative sampling baseline: the same loss as SNM with constant weights
over all B sampled negatives (vartheta_j = 1/B, mining.vartheta_norm="mean").

  python -m experiments.train --config=experiments/configs/negative_sampling.py:bibtex --workdir=...

Argument: "<variant>[,runlocal]" (variants as snm.py).
"""

from experiments.configs import common


def get_config(arg: str = ""):
  args = common.parse_arg(arg, variant="bibtex", runlocal=False)
  c = common.configure_dataset(common.base_config(), args.variant)
  c.mining.vartheta = "negative_sampling"
  c.mining.k = 1
  return common.finish(c, args)
