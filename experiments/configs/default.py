r"""SNM top-k on Bibtex: the README demo's base configuration.

  python -m experiments.train --config=experiments/configs/default.py --workdir=/tmp/snm_default
  python -m experiments.train --config=experiments/configs/default.py:runlocal --workdir=/tmp/snm_tiny

Argument: "[runlocal]": "" (default, a few minutes on 2 CPU cores), "runlocal" (seconds; for tests).
The same as snm.py:bibtex,k=1.
"""

from experiments.configs import common


def get_config(arg: str = ""):
  args = common.parse_arg(arg, runlocal=False)
  c = common.configure_dataset(common.base_config(), "bibtex")
  c.mining.k = 1
  return common.finish(c, args)
