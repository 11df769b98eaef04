"""quiet_logs drops known-harmless backend probes and library INFO chatter, nothing else."""

import logging

from snm_jax.train.runtime import quiet_logs


def _record(name, level, msg, pathname="x.py"):
  return logging.LogRecord(name, level, pathname, 1, msg, None, None)


def test_filter_drops_backend_probes_and_keeps_user_warnings():
  f = quiet_logs._DropLibraryInfo()  # pylint: disable=protected-access
  probe = ("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: "
           "cannot open shared object file: No such file or directory")
  assert not f.filter(_record("jax._src.xla_bridge", logging.INFO, probe))
  assert not f.filter(_record("root", logging.INFO, "saved", pathname="/site-packages/orbax/x.py"))
  # Kept: library warnings, the run's own lines, and the same words from another logger.
  assert f.filter(_record("root", logging.WARNING, "slow", pathname="/site-packages/orbax/x.py"))
  assert f.filter(_record("absl", logging.INFO, "step 5/20 | 2.3 steps/s"))
  assert f.filter(_record("absl", logging.WARNING, "checkpoint at step 20 is unreadable"))
  assert f.filter(_record("snm_jax", logging.INFO, "Unable to initialize backend 'x'"))


def test_install_is_idempotent():
  handler = logging.StreamHandler()
  root = logging.getLogger()
  root.addHandler(handler)
  try:
    quiet_logs.install()
    quiet_logs.install()
    assert sum(isinstance(f, quiet_logs._DropLibraryInfo) for f in handler.filters) == 1  # pylint: disable=protected-access
  finally:
    root.removeHandler(handler)


def test_a_repeated_line_prints_once_and_errors_always():
  f = quiet_logs._DropLibraryInfo()  # pylint: disable=protected-access
  line = "data: bibtex, 4392 train / 488 validation / 2515 test points, d=1836, K=159"
  assert f.filter(_record("absl", logging.INFO, line))
  assert not f.filter(_record("absl", logging.INFO, line))
  assert f.filter(_record("absl", logging.WARNING, line))  # another level is another line
  assert f.filter(_record("absl", logging.INFO, "step 5/20"))
  assert f.filter(_record("absl", logging.ERROR, "boom")) and f.filter(_record("absl", logging.ERROR, "boom"))
