r"""Top-k stochastic negative mining (Reddi et al. 2019), on every dataset.

  python -m experiments.train --config=experiments/configs/snm.py --workdir=/tmp/snm_bibtex
  python -m experiments.train --config=experiments/configs/snm.py:delicious,k=64 --workdir=...
  python -m experiments.train --config=experiments/configs/snm.py:amazon670k --workdir=...

Argument: "<variant>[,k=K][,kind=bowl|powl][,runlocal]" where variant is one of
bibtex (default), delicious, synthetic, amazoncat13k, wikilshtc325k, amazon670k, amazon3m
(common.configure_dataset). The paper's ablation is k in {1, 16, 64, 256}.
"""

from experiments.configs import common


def get_config(arg: str = ""):
  args = common.parse_arg(arg, variant="bibtex", k=16, kind="bowl", runlocal=False)
  c = common.configure_dataset(common.base_config(), args.variant)
  c.mining.vartheta = "top_k"
  c.mining.k = args.k
  c.loss.kind = args.kind
  return common.finish(c, args)
