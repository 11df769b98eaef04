r"""Full softmax cross-entropy over all K labels: a baseline for small K only
(every step scores the whole table).

  python -m experiments.train --config=experiments/configs/full_softmax.py:bibtex --workdir=...
"""

from experiments.configs import common, snm


def get_config(arg: str = ""):
  variant, kv = common.parse_arg(arg)
  if variant in snm.VARIANTS:
    raise ValueError(f"full softmax over {variant} is not feasible: use it on bibtex, delicious or synthetic")
  c = snm.configure_dataset(common.base_config(), variant)
  c.loss.kind = "full_softmax"
  c.loss.logit_scale = 10.0
  c.mining.sampler = "full"
  return common.finish(c, kv)
