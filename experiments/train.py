r"""Trains and evaluates one configuration; resumes from --workdir.

  python -m experiments.train --config=experiments/configs/default.py --workdir=/tmp/run1
  python -m experiments.train --config=experiments/configs/default.py \
      --config.mining.k=16 --config.loss.phi=logistic --workdir=/tmp/run2

Errors are one line on stderr, `error: ...`, decided by exception type:
  exit status 2: the command line or the config is wrong (ConfigError, an unknown
    --config.<field>, an unparsable value); nothing was trained;
  exit status 1: the run stopped on purpose (SnmJaxError: a malformed data file,
    a non-finite loss, the workdir locked by another run, no usable checkpoint);
  exit status 75: preempted (a signal of train.preemption_signals, SIGTERM by default): the step
    in flight finished and was checkpointed; the same command resumes the run.
Anything else is a bug and keeps its traceback.
"""

import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import compile_cache_flag
from snm_jax.errors import ConfigError, SnmJaxError
from snm_jax.train.config import overrides, validation
from snm_jax.train.runtime import distributed, member_devices, preemption, quiet_logs
from snm_jax.train.recipes import runs

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a get_config() file[:variant].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, results): "
                               "local, or any URI etils.epath reads (gs://bucket/run).")
_TREE_CACHE = flags.DEFINE_string("tree_cache", "", "Folder of fitted adversarial trees shared by runs "
                                  "(snm_jax.adversarial.cache: a hit loads the identical fit); '' = off.")
flags.mark_flags_as_required(["config", "workdir"])

USAGE_ERROR, RUN_ERROR = 2, 1


def _fail(message: str, status: int):
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(status)


def _one_line(e: Exception) -> str:
  """The first and the last line of a multi-line message (e.g. a config file's traceback)."""
  lines = [" ".join(line.split()) for line in str(e).splitlines() if line.strip()]
  if not lines:
    return type(e).__name__
  return lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"


def _unknown_override(argv) -> ConfigError | None:
  """The ConfigError for the first --config.<field> override the config does not have."""
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith(("--config=", "-config="))), None)
  if spec is None:
    return None
  from experiments.sweeps.spec import load_config  # pylint: disable=g-import-not-at-top
  try:
    config = load_config(spec)
  except Exception:  # pylint: disable=broad-except  (the flag parser reports a broken file)
    return None
  fields = set(overrides.config_fields(config))
  for arg in argv:
    m = re.match(r"^--?(?:no)?config\.([^=]+)", arg)
    if m and m.group(1) not in fields and not any(f.startswith(m.group(1) + ".") for f in fields):
      return overrides.unknown_field_error(config, m.group(1))
  return None


def parse_flags(argv):
  """absl's flag parsing, with one `error:` line (exit 2) instead of a traceback or the usage text."""
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    unknown = _unknown_override(argv)
    if unknown is not None:
      _fail(str(unknown), USAGE_ERROR)
    _fail(_one_line(e), USAGE_ERROR)


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]} (overrides are --config.<field>=<value>)", USAGE_ERROR)
  quiet_logs.install()
  compile_cache_flag.enable()
  if _TREE_CACHE.value:
    from snm_jax.adversarial import cache  # pylint: disable=g-import-not-at-top
    cache.use_tree_cache(_TREE_CACHE.value)
  try:
    config = _CONFIG.value
    config.keys()  # a config file that failed to load raises its error on first use
  except Exception as e:  # pylint: disable=broad-except
    _fail(_one_line(e), USAGE_ERROR)
  try:
    validation.validate(config)  # before the cluster, the data and any compilation
    member_devices.request_cpu_devices(config)  # (a recipe: one CPU device per core, before jax starts)
    distributed.maybe_initialize(config.distributed)
    results = runs.train(config, _WORKDIR.value)
  except ConfigError as e:
    _fail(str(e), USAGE_ERROR)
  except preemption.Preempted as e:
    _fail(str(e), preemption.PREEMPTED_EXIT_STATUS)
  except SnmJaxError as e:
    _fail(f"{e} ({type(e).__name__})", RUN_ERROR)
  logging.info("final: %s", {k: round(v, 4) for k, v in results["final"].items() if isinstance(v, float)})


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
