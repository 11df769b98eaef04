r"""Full softmax cross-entropy over all K labels: a baseline for small K only
(every step scores the whole table).

  python -m experiments.train --config=experiments/configs/full_softmax.py:bibtex --workdir=...

Argument: "<variant>[,runlocal]" with variant bibtex (default), delicious or synthetic.
"""

from experiments.configs import common


def get_config(arg: str = ""):
  args = common.parse_arg(arg, variant="bibtex", runlocal=False)
  if args.variant in common.PAPER_VARIANTS:
    raise ValueError(f"full softmax over {args.variant} is not feasible: use it on "
                     f"{', '.join(common.SMALL_DATASETS)}")
  c = common.configure_dataset(common.base_config(), args.variant)
  c.loss.kind = "full_softmax"
  c.loss.logit_scale = 10.0
  c.mining.sampler = "full"
  return common.finish(c, args)
