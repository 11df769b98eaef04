"""Interrupting `python -m experiments.train` processes in tests: a signal once a run is ready
(e.g. has written its first checkpoint), at a chosen delay after that."""

import time


def wait_until(procs, ready, timeout: float = 180) -> None:
  """Until `ready()`, or a process of `procs` has ended, or `timeout` seconds have passed."""
  deadline = time.time() + timeout
  while all(p.poll() is None for p in procs) and not ready() and time.time() < deadline:
    time.sleep(0.01)


def signal_when(proc, ready, sig, delay: float, timeout: float = 180) -> str:
  """`wait_until` `ready()`, then `delay` seconds, then `sig` to `proc` unless it has ended; waits for
  its end and returns its stderr (`proc` started with stderr=PIPE, text=True)."""
  wait_until([proc], ready, timeout)
  time.sleep(delay)
  if proc.poll() is None:
    proc.send_signal(sig)
  return proc.communicate(timeout=300)[1]
