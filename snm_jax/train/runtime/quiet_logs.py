"""Keeps a run's console readable: what a user sees is the progress line, the
evaluations, the final table, and warnings about their data or config.

Dropped from the console (absl and root handlers):
  * orbax / tensorstore / etils INFO records: one per save and restore step
    (their warnings and errors still pass);
  * JAX's backend probes that fail harmlessly on a machine without that
    hardware, e.g. "Unable to initialize backend 'tpu': ... Failed to open
    libtpu.so" (logged once per process while JAX looks for plugins). A backend
    the user asked for (JAX_PLATFORMS) that fails still raises an error;
  * a line identical (level and text) to one this process already printed: a
    recipe's candidate group builds one task per member, each logging the same
    data summary and the same truncation warning. Errors always print.
"""

import logging as py_logging

# (logger name prefix, message prefix) of known-harmless backend probes, any level.
HARMLESS_PROBES = (
    ("jax._src.xla_bridge", "Unable to initialize backend"),
    ("jax._src.xla_bridge", "No GPU/TPU found, falling back to CPU"),
    ("jax._src.xla_bridge", "An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib"),
)


class _DropLibraryInfo(py_logging.Filter):
  _NOISY = ("orbax", "ocdbt", "tensorstore", "etils")

  def __init__(self):
    super().__init__()
    self._printed = set()  # (level, text) of the lines already printed

  def filter(self, record):
    if any(record.name.startswith(logger) and str(record.msg).startswith(prefix)
           for logger, prefix in HARMLESS_PROBES):
      return False
    if record.levelno < py_logging.WARNING and any(n in record.pathname for n in self._NOISY):
      return False
    if record.levelno >= py_logging.ERROR:
      return True
    key = (record.levelno, record.getMessage())
    if key in self._printed:
      return False
    self._printed.add(key)
    return True


def install() -> None:
  """Adds the filter to the absl and root handlers (idempotent)."""
  for handler in py_logging.getLogger("absl").handlers + py_logging.getLogger().handlers:
    if not any(isinstance(f, _DropLibraryInfo) for f in handler.filters):
      handler.addFilter(_DropLibraryInfo())
