"""Host-side helpers: device -> host transfers that work with several processes,
the cadence test, "am I the writer" (only process 0 writes files), and the
workdir lock (one run per workdir at a time)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from snm_jax.errors import WorkdirInUseError

LOCK_FILE = "run.lock"


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


def _holder(fd: int) -> str:
  """What the lock file says about the run holding it."""
  try:
    info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
  except (OSError, ValueError):
    info = {}
  if not info:
    return "another run (its pid and host are not written yet)"
  since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
  return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (since {since})"


@contextlib.contextmanager
def workdir_lock(workdir):
  """Holds an exclusive lock on `workdir` for the duration of the with-block.

  Process 0 takes an `fcntl.flock` on `workdir/run.lock` and writes its pid,
  host and start time into it; the lock is released when the block ends,
  normally or by an exception, and by the kernel if the process dies (a
  SIGKILLed run leaves no stale lock). If another run holds it, every process
  raises WorkdirInUseError naming the holder's pid and host, before anything in
  the workdir is read or written. The workdir should be on a filesystem with
  working flock (local disks, NFSv4; Linux maps flock to POSIX locks on NFS).
  """
  workdir = Path(workdir)
  path = workdir / LOCK_FILE
  fd, error = None, None
  if is_writer():
    workdir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        os.close(fd)
        raise
      error = WorkdirInUseError(f"workdir {workdir} is in use by {_holder(fd)}: one run per workdir "
                                f"at a time (lock {path}); wait for it to finish or use another "
                                "--workdir")
      os.close(fd)
      fd = None
    else:
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                "since": time.time()}).encode(), 0)
  if jax.process_count() > 1:  # every process stops, not only process 0
    locked_out = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
    if locked_out and error is None:
      error = WorkdirInUseError(f"workdir {workdir} is in use by another run (process 0 could not "
                                f"lock {path}; it names the holder)")
  if error is not None:
    raise error
  try:
    yield
  finally:
    if fd is not None:
      os.ftruncate(fd, 0)  # a run that reads the file before the next holder writes sees "not written"
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)
