"""Interrupting `python -m experiments.train` processes in tests: a signal once a run is ready
(e.g. has written its first checkpoint), at a chosen delay after that; what a rerun says it
resumed from."""

import time

from snm_jax.train.trainer.checkpointing import saved_steps


def checkpoint_after(workdir, step):
  """`wait_until`'s test: a checkpoint of a step > `step` is in `workdir`/checkpoints."""
  return lambda: any(s > step for s in saved_steps(workdir / "checkpoints"))


def resumed_from(err: str) -> int:
  """The step a rerun says it resumed from (loop.py logs it at INFO; 0 if it started afresh)."""
  return int(err.split("resumed from step ")[1].split()[0]) if "resumed from step " in err else 0


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
