"""Splits of one dataset: a held-out validation part carved from a training set,
and the train/test compatibility check run when the splits are loaded."""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np
import scipy.sparse as sp

from snm_jax.data.datasets import XCDataset
from snm_jax.errors import DataFormatError


def validation_size(num_points: int, fraction: float) -> int:
  """round(fraction * num_points), at least 1 when fraction > 0.

  Raises:
    ValueError: if fraction is not in [0, 1) or the training part would be empty.
  """
  real = isinstance(fraction, numbers.Real) and not isinstance(fraction, bool)
  if not (real and 0.0 <= fraction < 1.0):  # False for NaN.
    raise ValueError(f"validation fraction must be in [0, 1), got {fraction!r}")
  if fraction == 0:
    return 0
  m = max(1, int(round(fraction * num_points)))
  if m >= num_points:
    raise ValueError(f"validation fraction {fraction} of {num_points} points leaves no "
                     f"training point ({m} would be held out)")
  return m


def _rows(ds: XCDataset, rows: np.ndarray, split: str) -> XCDataset:
  return dataclasses.replace(ds, features=ds.features[rows], labels=ds.labels[rows], split=split)


def split_validation(dataset: XCDataset, fraction: float,
                     seed: int) -> tuple[XCDataset, XCDataset]:
  """Carves a deterministic validation subset out of a training set.

  The held-out rows are the first `validation_size(N, fraction)` entries of
  `np.random.default_rng(seed).permutation(N)`; they depend only on (N,
  fraction, seed), not on the data. Both parts keep the original row order
  and the stored order of each row's label ids.

  Args:
    dataset: the training set, features (N, d) and labels (N, K).
    fraction: share of the N points held out, in [0, 1). 0 gives an empty
      validation part (0 rows).
    seed: seed of the permutation (independent of the run's seed, so every
      run of a sweep sees the same validation set).

  Returns:
    (train, validation): features (N - M, d) / (M, d) and labels (N - M, K) /
    (M, K), with split tags "train" and "validation"; name, label_names and
    path are kept.

  Raises:
    ValueError: if fraction is not in [0, 1) or the training part would be empty.
  """
  n = dataset.num_points
  m = validation_size(n, fraction)
  held_out = np.zeros(n, bool)
  held_out[np.random.default_rng(seed).permutation(n)[:m]] = True
  return (_rows(dataset, np.flatnonzero(~held_out), "train"),
          _rows(dataset, np.flatnonzero(held_out), "validation"))


def _describe(ds: XCDataset) -> str:
  return str(ds.path) if ds.path is not None else f"{ds.name}/{ds.split}"


def check_split_compatible(train: XCDataset, other: XCDataset) -> XCDataset:
  """Checks that `other` (a test or validation split) lives in `train`'s spaces.

  A different number of labels K (the header's) is an error: label ids would
  mean different labels. A feature id >= the training d is an error; a header
  d that merely differs from the training d while every id fits (unused
  trailing columns) is not, and the returned split has features (N, d_train).

  Args:
    train: the training split, features (N_tr, d) and labels (N_tr, K).
    other: features (N, d') and labels (N, K').

  Returns:
    `other`, with features reshaped to (N, d) if d' != d.

  Raises:
    DataFormatError: naming both files and both sizes.
  """
  where, train_where = _describe(other), _describe(train)
  if other.num_labels != train.num_labels:
    raise DataFormatError(
        where, None, f"{other.split} split has K={other.num_labels} labels but the training "
        f"split {train_where} has K={train.num_labels}")
  d = train.num_features
  if other.num_features == d:
    return other
  f = other.features
  top = int(f.indices.max()) if f.nnz else -1
  if top >= d:
    row = int(np.searchsorted(f.indptr, np.flatnonzero(f.indices >= d)[0], side="right")) - 1
    raise DataFormatError(
        where, None, f"{other.split} split (d={other.num_features}) has feature ids up to {top} "
        f"(the first one >= {d} in row {row}, 0-based) but the training split {train_where} "
        f"has d={d}")
  features = sp.csr_matrix((f.data, f.indices, f.indptr), shape=(f.shape[0], d))
  return dataclasses.replace(other, features=features)
