"""Keeps a run's console readable: orbax logs every save and restore step at
INFO level through absl; they still reach the log files at WARNING and above."""

import logging as py_logging


class _DropLibraryInfo(py_logging.Filter):
  _NOISY = ("orbax", "ocdbt", "tensorstore", "etils")

  def filter(self, record):
    return record.levelno >= py_logging.WARNING or not any(n in record.pathname for n in self._NOISY)


def install() -> None:
  for handler in py_logging.getLogger("absl").handlers + py_logging.getLogger().handlers:
    handler.addFilter(_DropLibraryInfo())
