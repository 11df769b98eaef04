"""Host-side helpers: device -> host transfers that work with several processes,
the cadence test, "am I the writer" (only process 0 writes files), and the
workdir lock (one run per workdir at a time; advisory on remote workdirs)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from snm_jax.errors import WorkdirInUseError
from snm_jax.train.runtime.workpath import is_local, workdir_path

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
    return _describe(os.pread(fd, 4096, 0).decode())
  except OSError:
    return _describe("")


def _describe(text: str) -> str:
  try:
    info = json.loads(text or "{}")
  except ValueError:
    info = {}
  if not info:
    return "another run (its pid and host are not written yet)"
  since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
  return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (since {since})"


def _me() -> bytes:
  return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()


@contextlib.contextmanager
def _advisory_lock(workdir):
  """`workdir_lock` on a remote workdir: the holder is recorded and cleared, nothing is refused."""
  path = workdir / LOCK_FILE
  if is_writer():
    held = path.read_text() if path.exists() else ""
    if held.strip():
      logging.warning(
          "%s names %s: a run still going, or one that died (e.g. preempted) without clearing it. "
          "Remote workdirs are not locked (object stores have no flock): make sure no other run "
          "uses %s, or they overwrite each other's checkpoints", path, _describe(held), workdir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_me())
  try:
    yield
  finally:
    if is_writer():
      path.write_text("")


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

  A remote workdir (gs://...: object stores have no flock and no exclusive
  create through epath) gets an advisory lock instead (`_advisory_lock`): the
  holder is written into `run.lock` and cleared at the end, and a run that
  finds it set logs a warning naming the holder and goes on. One run per
  remote workdir is then the user's responsibility: a refusal would also stop
  every resume after a preemption, which leaves the lock set.
  """
  workdir = workdir_path(workdir)
  if not is_local(workdir):
    with _advisory_lock(workdir):
      yield
    return
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
      os.pwrite(fd, _me(), 0)
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
