"""Host-side helpers: device -> host transfers that work with several processes,
the cadence test, and "am I the writer" (only process 0 writes files)."""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def to_host(x) -> np.ndarray:
  """Global jax.Array -> full numpy value on every process."""
  if jax.process_count() == 1 or getattr(x, "is_fully_addressable", True):
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def itstime(step: int, every: int, total: int | None = None) -> bool:
  """True every `every` steps (step counted from 1) and at the last step."""
  return (every > 0 and step % every == 0) or (total is not None and step == total)


def is_writer() -> bool:
  return jax.process_index() == 0
