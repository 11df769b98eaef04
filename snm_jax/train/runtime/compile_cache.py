"""JAX's persistent compilation cache, on by default, and what it saved.

A run compiles a handful of programs (the train step, the evaluators, the state's init); a
recipe compiles them once per candidate group. With the cache a second run of the same shapes
(a rerun, the next seed, the next sweep point) loads them from disk instead of compiling.

`enable(path)`: "" turns it off; None uses $JAX_COMPILATION_CACHE_DIR if set, else
$XDG_CACHE_HOME/snm_jax/jax_compilation_cache (~/.cache/...). Every program is cached, however
fast it compiled (`jax_persistent_cache_min_compile_time_secs=0`): a recipe's many small
programs add up. `stats()` counts this process's cache hits and misses (jax.monitoring events),
which `results.json` records next to the compile seconds.
"""

from __future__ import annotations

import logging as py_logging
import os
import pathlib

import jax
from jax import monitoring

_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_counts = {"hits": 0, "misses": 0}


def default_dir() -> str:
  """$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME (or ~/.cache)/snm_jax/jax_compilation_cache."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "snm_jax", "jax_compilation_cache")


def enable(path: str | None = None, min_compile_seconds: float = 0.0) -> str:
  """Points the persistent cache at `path` (None: `default_dir()`; "": off) for every program that
  compiles in at least `min_compile_seconds`. Returns the folder in use ("" when off)."""
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top
  path = default_dir() if path is None else str(path)
  if path and "://" not in path:
    pathlib.Path(path).mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_enable_compilation_cache", bool(path))
  jax.config.update("jax_compilation_cache_dir", path or None)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  # JAX opens the folder once, at its first compilation; a reset makes it open the new one (and
  # logs "Resetting cache" at INFO, which a user does not need to see).
  logger = py_logging.getLogger("jax._src.compilation_cache")
  level = logger.level
  logger.setLevel(py_logging.WARNING)
  try:
    compilation_cache.reset_cache()
  finally:
    logger.setLevel(level)
  return path


def _count(event: str, **_) -> None:
  if event in _EVENTS:
    _counts[_EVENTS[event]] += 1


monitoring.register_event_listener(_count)


def stats() -> dict:
  """{"dir", "hits", "misses"} of this process so far (hits + misses: the programs compiled
  through the cache)."""
  return {"dir": jax.config.jax_compilation_cache_dir or "", **_counts}
