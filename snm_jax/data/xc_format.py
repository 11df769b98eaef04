"""Reader and writer for the Extreme Classification Repository text formats.

Main format (one file per split, e.g. `bibtex_train.txt`)::

    num_points num_features num_labels
    l1,l2,... f1:v1 f2:v2 ...        <- one line per point, ids 0-based

A point without labels has an empty label field (its line starts with a space,
or directly with an `id:value` pair). Files ending in `.gz` (or starting with
the gzip magic bytes) are decompressed transparently.

Also supported: the "X/Y pair" variant (`trn_X_Xf.txt` + `trn_X_Y.txt`, each
`num_rows num_cols` then `id:value` lines) and split files (`*_trSplit.txt`,
one column of 1-based point indices per random split).

Every malformed input raises `DataFormatError(path, line, what)` with the
1-based line number. Reading streams line by line into `array` buffers, so
peak memory is about the size of the resulting CSR matrices.
"""
from __future__ import annotations

import gzip
import math
import os
import re
import zlib
from array import array
from typing import Iterator

import numpy as np
import scipy.sparse as sp

from snm_jax.errors import DataFormatError

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_GZIP_MAGIC = b"\x1f\x8b"
# Values never contain "_": Python's float() reads "1_5" as 15.0, the format does not.
_PAIRS_RE = re.compile(rb"[0-9]+:[^\s:_]+(?: [0-9]+:[^\s:_]+)*")
# Ids are stored as int32 (CSR indices): a dimension above this cannot be indexed.
_MAX_DIM = 2**31


def is_gzip(path) -> bool:
  """True if the file starts with the gzip magic bytes (whatever its name)."""
  with open(path, "rb") as f:
    return f.read(2) == _GZIP_MAGIC


def _lines(path) -> Iterator[tuple[int, bytes]]:
  """Yields (1-based line number, line without newline); typed errors on bad gzip."""
  gz = is_gzip(path)
  raw = open(path, "rb")
  f = gzip.GzipFile(fileobj=raw) if gz else raw
  lineno = 0
  try:
    while True:
      try:
        line = f.readline()
      except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataFormatError(
            path, lineno + 1, f"truncated or corrupt gzip stream ({e})") from e
      if not line:
        return
      lineno += 1
      yield lineno, line.rstrip(b"\r\n")
  finally:
    f.close()
    raw.close()


def _parse_header(path, lineno: int, line: bytes, names: tuple[str, ...]) -> list[int]:
  toks = line.split()
  want = " ".join(names)
  if b":" in line or b"," in line:
    raise DataFormatError(
        path, lineno, f"header line missing: expected '{want}', got a data line")
  if len(toks) != len(names) or not all(t.isdigit() for t in toks):
    shown = line.decode("utf-8", "replace")[:80]
    raise DataFormatError(
        path, lineno, f"header must be {len(names)} non-negative integers '{want}', "
        f"got '{shown}'")
  values = [int(t) for t in toks]
  for name, v in zip(names, values):
    if name != names[0] and v > _MAX_DIM:
      raise DataFormatError(
          path, lineno, f"header {name}={v} exceeds 2^31 = {_MAX_DIM}: ids are stored as "
          "int32, so larger dimensions cannot be read")
  return values


class _CsrBuilder:
  """Growable CSR buffers (int32 ids, float32 values, int64 row pointers)."""

  def __init__(self):
    self.indices = array("i")
    self.data = array("f")
    self.indptr = array("q", [0])

  def add_row(self, ids: list[int], vals: list[float]):
    self.indices.extend(ids)
    self.data.extend(vals)
    self.indptr.append(len(self.indices))

  def build(self, shape) -> sp.csr_matrix:
    indptr = np.frombuffer(self.indptr, dtype=np.int64)
    if indptr[-1] < np.iinfo(np.int32).max:
      indptr = indptr.astype(np.int32)
    indices = np.frombuffer(self.indices, dtype=np.int32)
    data = np.frombuffer(self.data, dtype=np.float32)
    # Keep the stored order of ids (e.g. label order in the file): no sorting.
    return sp.csr_matrix((data, indices, indptr), shape=shape, copy=False)


def _parse_label_field(path, lineno, field: bytes, num_labels: int) -> list[int]:
  toks = field.split(b",")
  if b"" not in toks and b"".join(toks).isdigit():  # Fast path, C-level checks only.
    ids = list(map(int, toks))
    if max(ids) < num_labels and len(set(ids)) == len(ids):
      return ids
  ids = []
  for tok in field.split(b","):
    if not tok.isdigit():
      raise DataFormatError(path, lineno, f"malformed label id {tok.decode('utf-8', 'replace')!r}")
    k = int(tok)
    if k >= num_labels:
      raise DataFormatError(path, lineno, f"label id {k} out of range [0, {num_labels})")
    ids.append(k)
  if len(set(ids)) != len(ids):
    raise DataFormatError(path, lineno, "duplicate label id in the label list")
  return ids


def _parse_pairs_fast(toks: list[bytes], num_cols: int):
  """(ids, values) if every check passes, else None (the slow path names the error)."""
  joined = b" ".join(toks)
  if not _PAIRS_RE.fullmatch(joined):
    return None
  parts = joined.replace(b":", b" ").split()
  id_parts, val_parts = parts[0::2], parts[1::2]
  try:
    vals = list(map(float, val_parts))
    if not math.isfinite(math.fsum(vals)):
      return None
  except ValueError:
    return None
  ids = list(map(int, id_parts))
  if (max(ids) >= num_cols or max(vals) > _FLOAT32_MAX or min(vals) < -_FLOAT32_MAX
      or len(set(ids)) != len(ids)):
    return None
  return ids, vals


def _parse_pairs(path, lineno, toks: list[bytes], num_cols: int, what: str):
  if not toks:
    return [], []
  fast = _parse_pairs_fast(toks, num_cols)
  if fast is not None:
    return fast
  ids, vals = [], []
  for tok in toks:
    id_b, sep, val_b = tok.partition(b":")
    if not sep or not id_b.isdigit() or b":" in val_b:
      raise DataFormatError(
          path, lineno, f"malformed {what} pair {tok.decode('utf-8', 'replace')!r} "
          "(expected 'id:value' with a 0-based integer id)")
    j = int(id_b)
    if j >= num_cols:
      raise DataFormatError(path, lineno, f"{what} id {j} out of range [0, {num_cols})")
    try:
      if b"_" in val_b:  # float() accepts digit separators ("1_5" -> 15.0); the format does not
        raise ValueError
      v = float(val_b)
    except ValueError:
      raise DataFormatError(
          path, lineno, f"malformed value {val_b.decode('utf-8', 'replace')!r} "
          f"for {what} id {j}") from None
    if not math.isfinite(v):
      raise DataFormatError(path, lineno, f"non-finite value {v} for {what} id {j}")
    if abs(v) > _FLOAT32_MAX:
      raise DataFormatError(path, lineno, f"value {v} for {what} id {j} overflows float32")
    ids.append(j)
    vals.append(v)
  if len(set(ids)) != len(ids):
    raise DataFormatError(path, lineno, f"duplicate {what} id in one line")
  return ids, vals


def _missing_rows(path, got: int, want: int):
  return DataFormatError(
      path, got + 2, f"file ends after {got} rows but the header says {want}")


def _extra_row(path, lineno: int, want: int, first_blank: int | None, what: str):
  """The error for a data line past the header's count; blames the first blank
  line when there is one (it was read as an empty row and shifted the count)."""
  if first_blank is not None:
    return DataFormatError(
        path, first_blank, f"blank line read as a {what} with no entries, and the file then has "
        f"more {what}s than the header's {want} (extra data line {lineno}); remove the blank "
        f"line, or fix the header if the {what} is really empty")
  return DataFormatError(path, lineno, f"more {what}s than the header's {want} (extra data line)")


def read_xc(path) -> tuple[sp.csr_matrix, sp.csr_matrix]:
  """Reads an Extreme Classification Repository data file.

  Args:
    path: a `.txt` file (or gzip-compressed) in the format described above.

  Returns:
    (features, labels): CSR float32 of shape (N, d) and (N, K), where
    `N d K` is the header. Label values are 1.0; the stored order of each
    row's label ids is the order in the file (so `first_label` is meaningful).

  Raises:
    DataFormatError: naming the file and the 1-based line of the problem.
  """
  path = os.fspath(path)
  lines = _lines(path)
  first = next(lines, None)
  if first is None:
    raise DataFormatError(path, 1, "empty file (expected header "
                          "'num_points num_features num_labels')")
  n, d, k = _parse_header(path, first[0], first[1],
                          ("num_points", "num_features", "num_labels"))
  feats, labs = _CsrBuilder(), _CsrBuilder()
  i = 0
  first_blank = None  # a blank line is a point without labels or features
  for lineno, line in lines:
    if i == n:
      if line.strip():
        raise _extra_row(path, lineno, n, first_blank, "point")
      continue
    if not line.strip() and first_blank is None:
      first_blank = lineno
    if not line or line[:1].isspace():
      label_field, rest = b"", line
    else:
      head, *tail = line.split(None, 1)
      rest = tail[0] if tail else b""
      if b":" in head:  # No label field at all: the line starts with a feature.
        label_field, rest = b"", line
      else:
        label_field = head
    label_ids = _parse_label_field(path, lineno, label_field, k) if label_field else []
    feat_ids, feat_vals = _parse_pairs(path, lineno, rest.split(), d, "feature")
    feats.add_row(feat_ids, feat_vals)
    labs.add_row(label_ids, [1.0] * len(label_ids))
    i += 1
  if i < n:
    raise _missing_rows(path, i, n)
  return feats.build((n, d)), labs.build((n, k))


def read_sparse_matrix(path) -> sp.csr_matrix:
  """Reads the `num_rows num_cols` + `id:value` lines format (`trn_X_Xf.txt`).

  Returns:
    CSR float32 of shape (num_rows, num_cols). An empty line is an empty row.
  """
  path = os.fspath(path)
  lines = _lines(path)
  first = next(lines, None)
  if first is None:
    raise DataFormatError(path, 1, "empty file (expected header 'num_rows num_cols')")
  n, d = _parse_header(path, first[0], first[1], ("num_rows", "num_cols"))
  rows = _CsrBuilder()
  i = 0
  first_blank = None
  for lineno, line in lines:
    if i == n:
      if line.strip():
        raise _extra_row(path, lineno, n, first_blank, "row")
      continue
    if not line.strip() and first_blank is None:
      first_blank = lineno
    ids, vals = _parse_pairs(path, lineno, line.split(), d, "column")
    rows.add_row(ids, vals)
    i += 1
  if i < n:
    raise _missing_rows(path, i, n)
  return rows.build((n, d))


def read_xc_pair(x_path, y_path) -> tuple[sp.csr_matrix, sp.csr_matrix]:
  """Reads an X/Y pair (`trn_X_Xf.txt`, `trn_X_Y.txt`); labels are the Y nonzeros set to 1."""
  features = read_sparse_matrix(x_path)
  labels = read_sparse_matrix(y_path)
  if labels.shape[0] != features.shape[0]:
    raise DataFormatError(
        y_path, 1, f"{labels.shape[0]} rows but the feature file {os.fspath(x_path)} "
        f"has {features.shape[0]}")
  labels.data[:] = 1.0
  return features, labels


def read_split_indices(path, num_points: int, column: int = 0) -> np.ndarray:
  """Reads an XC split file (1-based point indices, one column per random split).

  Returns:
    int64 array of 0-based point indices from the chosen column.
  """
  path = os.fspath(path)
  out = array("q")
  for lineno, line in _lines(path):
    toks = line.split()
    if not toks:
      continue
    if column >= len(toks) or not toks[column].isdigit():
      raise DataFormatError(
          path, lineno, f"expected a 1-based point index in column {column}, "
          f"got {line.decode('utf-8', 'replace')[:60]!r}")
    v = int(toks[column])
    if not 1 <= v <= num_points:
      raise DataFormatError(path, lineno, f"point index {v} out of range [1, {num_points}]")
    out.append(v - 1)
  if not out:
    raise DataFormatError(path, 1, "empty split file")
  return np.frombuffer(out, dtype=np.int64).copy()


def _format_value(v: float) -> str:
  if v == int(v) and abs(v) < 1e15:
    return str(int(v))
  return "%.9g" % v  # 9 significant digits round-trip any float32.


def _open_write(path):
  path = os.fspath(path)
  if path.endswith(".gz"):
    return gzip.GzipFile(path, "wb", mtime=0)
  return open(path, "wb")


def _row_pairs(m: sp.csr_matrix, i: int) -> str:
  lo, hi = m.indptr[i], m.indptr[i + 1]
  vals = m.data[lo:hi]
  if np.all((vals == np.round(vals)) & (np.abs(vals) < 1e15)):
    strs = map(str, vals.astype(np.int64).tolist())
  else:
    strs = map(_format_value, vals.tolist())
  return " ".join(f"{j}:{v}" for j, v in zip(m.indices[lo:hi].tolist(), strs))


def write_xc(path, features: sp.spmatrix, labels: sp.spmatrix) -> None:
  """Writes (features (N, d), labels (N, K)) in the Extreme Classification format.

  Label ids are written in their stored CSR order (stored zeros count as
  labels); feature values that are integral are written as integers, others
  with 9 significant digits (exact for float32). `.gz` paths are gzipped.
  """
  features = sp.csr_matrix(features)
  labels = sp.csr_matrix(labels)
  if features.shape[0] != labels.shape[0]:
    raise ValueError(f"features have {features.shape[0]} rows, labels {labels.shape[0]}")
  n, d = features.shape
  with _open_write(path) as f:
    f.write(f"{n} {d} {labels.shape[1]}\n".encode())
    for i in range(n):
      lab = ",".join(map(str, labels.indices[labels.indptr[i]:labels.indptr[i + 1]].tolist()))
      feat = _row_pairs(features, i)
      f.write(f"{lab} {feat}\n".encode() if feat else f"{lab}\n".encode())


def write_sparse_matrix(path, matrix: sp.spmatrix) -> None:
  """Writes a matrix in the `num_rows num_cols` + `id:value` lines format."""
  matrix = sp.csr_matrix(matrix)
  with _open_write(path) as f:
    f.write(f"{matrix.shape[0]} {matrix.shape[1]}\n".encode())
    for i in range(matrix.shape[0]):
      f.write((_row_pairs(matrix, i) + "\n").encode())
