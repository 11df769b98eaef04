"""Metric outputs of a run (process 0 only): a progress line via absl logging,
`metrics.jsonl`, TensorBoard event files, and JSON files in the workdir.

The workdir may be remote (`gs://...`, `snm_jax.train.runtime.workpath`). Object
stores cannot append, so there `metrics.jsonl` is kept in memory and the
object rewritten whole, at most every `REMOTE_SYNC_SECONDS` and at every
`sync()` (the loop calls it before each checkpoint, so every row up to a
checkpoint's step is stored with it) and `close()`; TensorBoard event files
are rewritten whole at each of tensorboardX's flushes (every 120 s and at
close), as tensorboardX's own gs:// and s3:// writers do.
"""

from __future__ import annotations

import io
import json
import re
import threading
import time

from absl import logging
from etils import epath

from snm_jax.train.runtime import workpath
from snm_jax.train.runtime.host import is_writer

REMOTE_SYNC_SECONDS = 30.0


def tensorboard_tag(name: str) -> str:
  """A metric name as a legal TensorBoard tag: `eval/P@1` -> `eval/P_at_1`
  (TensorBoard allows only [A-Za-z0-9_./-]; metrics.jsonl keeps the plain names)."""
  return re.sub(r"[^A-Za-z0-9_./-]", "_", name.replace("@", "_at_"))


class _LocalLines:
  """An append-only text file, each line flushed as it is written."""

  def __init__(self, path: epath.Path):
    self.path = path
    self._file = open(path, "a", encoding="utf-8")

  def append(self, line: str) -> None:
    self._file.write(line)
    self._file.flush()

  def keep(self, predicate) -> None:
    """Keeps only the lines `predicate` accepts (the file is replaced atomically)."""
    self._file.close()
    lines = [x for x in self.path.read_text(encoding="utf-8").splitlines(keepends=True)
             if x.strip() and predicate(x)]
    workpath.write_text(self.path, "".join(lines))
    self._file = open(self.path, "a", encoding="utf-8")

  def sync(self) -> None:
    pass  # every line was flushed when written

  def close(self) -> None:
    self._file.close()


class _RemoteLines:
  """The same file on an object store: held in memory, the object rewritten whole (no append there),
  at most every `every` seconds on `append` and always on `keep`, `sync` and `close`."""

  def __init__(self, path: epath.Path, every: float = REMOTE_SYNC_SECONDS):
    self.path, self._every = path, every
    self._lines = (path.read_text(encoding="utf-8").splitlines(keepends=True)
                   if path.exists() else [])
    self._dirty, self._written = False, time.monotonic()

  def append(self, line: str) -> None:
    self._lines.append(line)
    self._dirty = True
    if time.monotonic() - self._written >= self._every:
      self.sync()

  def keep(self, predicate) -> None:
    self._lines = [x for x in self._lines if x.strip() and predicate(x)]
    self._dirty = True
    self.sync()

  def sync(self) -> None:
    if self._dirty:
      workpath.write_text(self.path, "".join(self._lines))
      self._dirty, self._written = False, time.monotonic()

  def close(self) -> None:
    self.sync()


class _EpathRecordFile:
  """A tensorboardX record file on any epath URI: bytes buffered, the object rewritten whole at
  each flush (what tensorboardX's own gs:// and s3:// writers do, without their cloud SDKs)."""

  def __init__(self, path: str):
    self._path, self._buffer, self._lock = epath.Path(path), io.BytesIO(), threading.Lock()

  def write(self, data: bytes) -> None:
    with self._lock:
      self._buffer.write(data)

  def flush(self) -> None:
    with self._lock:
      self._path.write_bytes(self._buffer.getvalue())

  def close(self) -> None:
    self.flush()


class _EpathRecordFactory:
  def open(self, path: str) -> _EpathRecordFile:
    return _EpathRecordFile(path)

  def directory_check(self, path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def _tensorboard_writer(logdir: epath.Path):
  """A tensorboardX SummaryWriter writing under `logdir`, local or remote; None without tensorboardX.

  For a remote logdir, tensorboardX's writer for its scheme (e.g. "gs", which needs
  google-cloud-storage) is replaced, for the process, by one that writes through epath.
  """
  try:
    from tensorboardX import SummaryWriter, record_writer  # pylint: disable=g-import-not-at-top
  except ImportError:  # optional: jsonl is the canonical record
    logging.warning("tensorboardX not installed: TensorBoard events are not written")
    return None
  if not workpath.is_local(logdir):
    record_writer.register_writer_factory(str(logdir).split("://", 1)[0], _EpathRecordFactory())
  return SummaryWriter(str(logdir))


class MetricWriter:
  def __init__(self, workdir, total_steps: int, batch_size: int):
    self.workdir = workpath.workdir_path(workdir)
    self.total_steps, self.batch_size = total_steps, batch_size
    self.enabled = is_writer()
    self._tb = None
    self._jsonl = None
    if self.enabled:
      self.workdir.mkdir(parents=True, exist_ok=True)
      lines = _LocalLines if workpath.is_local(self.workdir) else _RemoteLines
      self._jsonl = lines(self.workdir / "metrics.jsonl")
      self._tb = _tensorboard_writer(self.workdir / "tensorboard")
    self._last_time = None
    self._last_step = None

  def truncate_after(self, step: int) -> None:
    """Drops metrics.jsonl rows of steps > `step`: a run resumed from `step`
    writes them again, and each step must appear once."""
    if self.enabled:
      self._jsonl.keep(lambda line: json.loads(line)["step"] <= step)

  def sync(self) -> None:
    """Stores every row written so far (a no-op locally, where each row is flushed as written)."""
    if self.enabled:
      self._jsonl.sync()

  def write_scalars(self, step: int, scalars: dict, wall: float) -> None:
    if not self.enabled:
      return
    record = {"step": step, "wall_time": wall, **scalars}
    self._jsonl.append(json.dumps(record) + "\n")
    if self._tb is not None:
      for k, v in scalars.items():
        if isinstance(v, (int, float)):
          self._tb.add_scalar(tensorboard_tag(k), v, step)

  def progress(self, step: int, scalars: dict) -> None:
    """The progress line: step, steps/s, examples/s, ETA, loss."""
    now = time.perf_counter()
    if self._last_time is not None and step > self._last_step:
      sps = (step - self._last_step) / (now - self._last_time)
      eta = (self.total_steps - step) / max(sps, 1e-9)
      scalars = {**scalars, "steps_per_sec": sps, "examples_per_sec": sps * self.batch_size}
      if self.enabled:
        logging.info("step %d/%d | %.1f steps/s | %.0f ex/s | ETA %.0fs | loss %.4f",
                     step, self.total_steps, sps, sps * self.batch_size, eta, scalars.get("loss", float("nan")))
    self._last_time, self._last_step = now, step
    return scalars

  def write_json(self, name: str, obj) -> None:
    """Writes workdir/`name` whole (a reader never sees a part: `workpath.write_text`)."""
    if self.enabled:
      workpath.write_text(self.workdir / name, json.dumps(obj, indent=2, sort_keys=True))

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
