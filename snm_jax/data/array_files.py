"""Features and labels from files named one by one (`dataset.name="files"`).

For data that is not an XC-repository folder, e.g. image or text embeddings:

  features  `.npy`: a dense (N, d) array (`np.save`);
            `.npz`: a scipy.sparse matrix (`scipy.sparse.save_npz`), or a dense
                    (N, d) array (`np.savez`: the file's only array, or the one
                    named "features");
            anything else: the XC sparse text format (`num_rows num_cols`, then
                    `id:value` lines, as `trn_X_Xf.txt`; `.gz` read transparently).
  labels    `.npz`: a scipy.sparse (N, K) matrix, each stored nonzero a positive;
            anything else: the XC label text format (`num_rows num_labels`, then
                    `id:value` lines, as `trn_X_Y.txt`).

Dense features stay dense (float32, (N, d)); sparse ones are CSR float32. Labels
are CSR float32 with value 1 at each positive, in the stored order of each row.

Every problem is a `DataFormatError` naming the file (and, for text files, the
1-based line): an array that is not 2-D or not numeric, a non-finite value
(also one beyond float32's range), a label id >= K or < 0, a label repeated
in a row, a label file whose N differs from its feature file's, and a test
split whose d or K differs from the training split's.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from snm_jax.data import xc_format
from snm_jax.data.datasets import XCDataset
from snm_jax.errors import DataFormatError

# Rows per chunk of the finiteness check of a dense array (bounds its temporary).
_CHECK_ROWS = 65_536


def _row_of(indptr: np.ndarray, entry: int) -> int:
  """The row of CSR entry number `entry`."""
  return int(np.searchsorted(indptr, entry, side="right")) - 1


def _load_npz(path: Path):
  """A scipy.sparse matrix (CSR) or the dense array of an `.npz` file."""
  try:
    with np.load(path, allow_pickle=False) as z:
      names = list(z.files)
      if "format" in names and "shape" in names:  # scipy.sparse.save_npz's layout
        return sp.csr_matrix(sp.load_npz(path))
      if len(names) == 1:
        return z[names[0]]
      if "features" in names:
        return z["features"]
  except (OSError, ValueError, zipfile.BadZipFile, KeyError) as e:
    raise DataFormatError(path, None, f"not a readable .npz file ({e})") from None
  raise DataFormatError(path, None, f"holds the arrays {names}: expected a scipy.sparse matrix "
                        "(scipy.sparse.save_npz), a single array, or one named 'features'")


def _check_dense(x, path: Path) -> np.ndarray:
  """x as float32 (N, d), all finite."""
  x = np.asarray(x)
  if x.ndim != 2:
    raise DataFormatError(path, None, f"features must be a 2-D (N, d) array, got shape {x.shape}")
  if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)
          or x.dtype == bool):
    raise DataFormatError(path, None, f"features must be real numbers, got dtype {x.dtype}")
  with np.errstate(over="ignore"):  # a value beyond float32's range becomes inf: reported below
    x = np.ascontiguousarray(x, dtype=np.float32)
  for start in range(0, x.shape[0], _CHECK_ROWS):
    bad = ~np.isfinite(x[start:start + _CHECK_ROWS])
    if bad.any():
      row, col = np.argwhere(bad)[0]
      raise DataFormatError(path, None, f"non-finite feature value (NaN, inf, or beyond "
                            f"float32's range) at row {start + row}, column {col} (0-based)")
  return x


def _check_csr(m: sp.csr_matrix, path: Path, what: str) -> sp.csr_matrix:
  """m as canonical-shaped CSR float32 whose ids lie in [0, num_cols) and values are finite."""
  n, cols = m.shape
  if m.nnz and (m.indices.min() < 0 or m.indices.max() >= cols):
    entry = int(np.flatnonzero((m.indices < 0) | (m.indices >= cols))[0])
    raise DataFormatError(path, None, f"{what} id {int(m.indices[entry])} in row "
                          f"{_row_of(m.indptr, entry)} (0-based) is outside [0, {cols}) "
                          f"(the matrix has {cols} columns)")
  try:
    m.check_format(full_check=True)
  except ValueError as e:
    raise DataFormatError(path, None, f"malformed sparse matrix ({e})") from None
  with np.errstate(over="ignore"):
    data = m.data.astype(np.float32)
  if not np.isfinite(data).all():
    entry = int(np.flatnonzero(~np.isfinite(data))[0])
    raise DataFormatError(path, None, f"non-finite {what} value (NaN, inf, or beyond float32's "
                          f"range) in row {_row_of(m.indptr, entry)}, column "
                          f"{int(m.indices[entry])} (0-based)")
  return sp.csr_matrix((data, m.indices, m.indptr), shape=(n, cols))


def read_features(path) -> np.ndarray | sp.csr_matrix:
  """The (N, d) feature matrix of `path`: dense float32 from `.npy` / a dense `.npz`,
  CSR float32 from a sparse `.npz` or an XC sparse text file.

  Raises:
    DataFormatError: naming the file and what is wrong.
  """
  path = Path(path).expanduser()
  suffix = path.suffix.lower()
  if suffix == ".npy":
    try:
      x = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
      raise DataFormatError(path, None, f"not a readable .npy array ({e})") from None
  elif suffix == ".npz":
    x = _load_npz(path)
  else:
    x = xc_format.read_sparse_matrix(path)
  if sp.issparse(x):
    x = _check_csr(sp.csr_matrix(x), path, "feature")
  else:
    x = _check_dense(x, path)
  if x.shape[0] < 1 or x.shape[1] < 1:
    raise DataFormatError(path, None, f"features of shape {x.shape}: need N >= 1 rows and "
                          "d >= 1 columns")
  return x


def read_labels(path) -> sp.csr_matrix:
  """The (N, K) label matrix of `path` (a sparse `.npz`, or XC label text), as CSR
  float32 with 1.0 at each positive, each row's ids in stored order.

  Raises:
    DataFormatError: naming the file and what is wrong (a dense array, an id outside
      [0, K), a label repeated in a row, ...).
  """
  path = Path(path).expanduser()
  if path.suffix.lower() == ".npz":
    y = _load_npz(path)
    if not sp.issparse(y):
      raise DataFormatError(path, None, f"labels must be a scipy.sparse (N, K) matrix saved with "
                            f"scipy.sparse.save_npz, got a dense array of shape {np.shape(y)}")
    y = _check_csr(y, path, "label")
  else:
    y = xc_format.read_sparse_matrix(path)  # ids checked against K with their line
  y.eliminate_zeros()  # a stored 0 is not a positive
  rows = np.repeat(np.arange(y.shape[0]), np.diff(y.indptr))
  key = rows.astype(np.int64) * y.shape[1] + y.indices
  if np.unique(key).size != key.size:
    keys, counts = np.unique(key, return_counts=True)
    row, label = divmod(int(keys[counts > 1][0]), y.shape[1])
    raise DataFormatError(path, None, f"label {label} appears more than once in row {row} "
                          "(0-based)")
  y.data = np.ones_like(y.data, dtype=np.float32)
  return y


def load_split(features_path, labels_path, split: str) -> XCDataset:
  """One split from its feature and label files.

  Raises:
    DataFormatError: a malformed file, or N differing between the two files.
  """
  features = read_features(features_path)
  labels = read_labels(labels_path)
  if labels.shape[0] != features.shape[0]:
    raise DataFormatError(labels_path, None, f"{labels.shape[0]} label rows but the feature file "
                          f"{features_path} has {features.shape[0]} rows")
  return XCDataset(features=features, labels=labels, name="files", split=split,
                   path=Path(features_path))


def load_files(train_features, train_labels, test_features, test_labels
               ) -> tuple[XCDataset, XCDataset]:
  """(train, test) from four files; the test split must have the training split's d and K.

  Raises:
    DataFormatError: naming the offending file (see the module docstring).
  """
  train = load_split(train_features, train_labels, "train")
  test = load_split(test_features, test_labels, "test")
  if test.num_features != train.num_features:
    raise DataFormatError(test_features, None, f"test features have d={test.num_features} columns "
                          f"but the training features {train_features} have d={train.num_features}")
  if test.num_labels != train.num_labels:
    raise DataFormatError(test_labels, None, f"test labels have K={test.num_labels} columns but "
                          f"the training labels {train_labels} have K={train.num_labels}")
  return train, test
