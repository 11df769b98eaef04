r"""Trains and evaluates one configuration; resumes from --workdir.

  python -m experiments.train --config=experiments/configs/default.py --workdir=/tmp/run1
  python -m experiments.train --config=experiments/configs/default.py \
      --config.mining.k=16 --config.loss.phi=logistic --workdir=/tmp/run2
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from snm_jax.errors import ConfigError
from snm_jax.train import distributed, quiet_logs, runs

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a get_config() file[:variant].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, results).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  quiet_logs.install()
  config = _CONFIG.value
  distributed.maybe_initialize(config.distributed)
  try:
    results = runs.train(config, _WORKDIR.value)
  except ConfigError as e:  # A bad config field: one line naming it on stderr, exit status 1.
    sys.exit(f"error: {e}")
  logging.info("final: %s", {k: round(v, 4) for k, v in results["final"].items() if isinstance(v, float)})


if __name__ == "__main__":
  app.run(main)
