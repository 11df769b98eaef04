"""Preemption: a run told to stop (SIGTERM from TPU VMs, GKE, SLURM) finishes its step, checkpoints
and exits with `PREEMPTED_EXIT_STATUS`; the same command resumes it bit-identically.

One process: a Python handler for `train.preemption_signals` sets a flag the loop reads after each
step. Several processes (`jax.distributed`): JAX's preemption service receives SIGTERM on any
process and agrees on one step for all of them (`multihost_utils.reached_preemption_sync_point`,
which the loop calls after every step); another listed signal is turned into a SIGTERM to this
process so the service sees it.

The service wants the ids it is called with to increase from one call to the next on every
process alike. A recipe steps its candidate groups one after another, each from its own step 0,
and may then train runs alone: so the id is not a run's step but the number of calls this
process has made (`reached`), the same sequence on every process because they run the same
program.
"""
from __future__ import annotations

import itertools
import os
import signal
import threading

import jax
from absl import logging
from jax.experimental import multihost_utils

from snm_jax.errors import ConfigError, SnmJaxError

# EX_TEMPFAIL (sysexits.h): "try again later" -- the checkpoint is written, rerun the same command.
PREEMPTED_EXIT_STATUS = 75

# The ids passed to JAX's preemption sync point: increasing over the whole process (see above).
_SYNC_IDS = itertools.count(1)


class Preempted(SnmJaxError):
  """The run stopped at a preemption notice after checkpointing step `step`."""

  def __init__(self, step: int, directory):
    self.step = step
    super().__init__(f"preempted: checkpoint of step {step} written in {directory}; run the same "
                     "command again to resume")


def parse_signals(spec: str) -> tuple[signal.Signals, ...]:
  """'SIGTERM,SIGUSR1' -> the signals ('' -> none); ConfigError for an unknown name."""
  out = []
  for name in filter(None, (s.strip() for s in spec.split(","))):
    try:
      out.append(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
    except KeyError:
      raise ConfigError("train.preemption_signals", f"unknown signal {name!r} (e.g. SIGTERM, "
                        "SIGUSR1)") from None
  return tuple(out)


class PreemptionWatch:
  """Context manager: installs the handlers on enter, restores the previous ones on exit;
  `reached()`, called after every step, is True at the step every process stops at after a
  notice."""

  def __init__(self, spec: str = "SIGTERM"):
    self.signals = parse_signals(spec)
    self._notice = threading.Event()
    self._previous = {}
    self._multi = jax.distributed.is_initialized()

  def _on_signal(self, signum, frame):
    del frame
    logging.warning("received %s: finishing the step, then checkpointing and exiting",
                    signal.Signals(signum).name)
    self._notice.set()

  def _forward_to_jax(self, signum, frame):
    del frame
    logging.warning("received %s: passed on as SIGTERM to JAX's preemption service",
                    signal.Signals(signum).name)
    os.kill(os.getpid(), signal.SIGTERM)

  def __enter__(self) -> "PreemptionWatch":
    if threading.current_thread() is not threading.main_thread():
      if self.signals:
        logging.warning("not in the main thread: preemption signals %s are not handled",
                        [s.name for s in self.signals])
      return self
    for sig in self.signals:
      if self._multi and sig == signal.SIGTERM:
        continue  # JAX's preemption service owns SIGTERM
      handler = self._forward_to_jax if self._multi else self._on_signal
      self._previous[sig] = signal.signal(sig, handler)
    return self

  def __exit__(self, *exc) -> None:
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous.clear()

  def reached(self) -> bool:
    if self._multi:
      return bool(self.signals) and multihost_utils.reached_preemption_sync_point(next(_SYNC_IDS))
    return self._notice.is_set()
