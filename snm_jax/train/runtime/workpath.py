"""Workdirs as paths, local or remote (`gs://bucket/run`, `s3://...`: anything `etils.epath` reads).

Every file of a run (checkpoints, metrics.jsonl, TensorBoard events, JSON
files, figures) is reached through `workdir_path(workdir)`, an `epath.Path`:
a local workdir is made absolute, as it always was; a URI is kept as it is
(`pathlib.Path("gs://b/run").absolute()` would be the local folder
`$PWD/gs:/b/run`). epath picks the backend from the scheme (fsspec: gcsfs for
`gs://`, s3fs for `s3://`; TensorFlow's gfile when TensorFlow is installed);
orbax writes `gs://` arrays with TensorStore's own GCS driver.

What differs on a remote workdir (object stores have no flock, no append and
no atomic rename; an object appears whole when its writer closes):
  * `write_text` writes the object directly (readers see the old or the new
    whole file, as with the local temp-file-and-rename);
  * append-only files are rewritten whole instead (`writers.MetricWriter`);
  * the workdir lock is advisory (`host.workdir_lock`).
"""

from __future__ import annotations

import os
import tempfile

from etils import epath


def is_local(path) -> bool:
  """True for a path on the local filesystem (no `scheme://` prefix)."""
  return "://" not in os.fspath(path)


def workdir_path(path) -> epath.Path:
  """`path` as an `epath.Path`: a local one made absolute, a URI unchanged."""
  if is_local(path):
    return epath.Path(os.path.abspath(os.fspath(path)))
  return epath.Path(path)


def write_bytes(path, data: bytes) -> None:
  """Writes `data` to `path` so that a reader sees the old file or the new one, never a part.

  Local: a temporary file in the same folder, fsynced, then `os.replace`
  (atomic on POSIX within one filesystem). Remote: one object write (an object
  store publishes an object whole when it is closed; its "rename" is a copy and
  a delete, which would not be atomic). The parent folder is created.
  """
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if not is_local(path):
    path.write_bytes(data)
    return
  fd, tmp = tempfile.mkstemp(dir=os.fspath(path.parent), prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o666 & ~_umask())  # the mode open() would give (mkstemp's is 0600)
    os.replace(tmp, os.fspath(path))
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _umask() -> int:
  """The process's umask, read without changing it (`os.umask` sets it, racing other threads)."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError):
    pass
  return 0o022


def write_text(path, text: str) -> None:
  """`write_bytes` of `text` in UTF-8."""
  write_bytes(path, text.encode("utf-8"))
