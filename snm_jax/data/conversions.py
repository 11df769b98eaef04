"""Multilabel -> multiclass conversions used by the papers (all four, named).

Each takes the label matrix `labels` (CSR (N, K); a row's stored ids are its
label set, in file order) and returns `(example_index (M,), label (M,))`, both
int32: example m uses feature row `example_index[m]` with positive `label[m]`.
Points without labels produce no example under every conversion (a
multiclass example needs a positive). Evaluation keeps the full label sets.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import scipy.sparse as sp

Examples = tuple[np.ndarray, np.ndarray]


def _row_lengths(labels: sp.csr_matrix) -> np.ndarray:
  return np.diff(sp.csr_matrix(labels).indptr)


def sample_one_positive(labels: sp.csr_matrix, seed: int, epoch: int) -> Examples:
  """SNM paper: one positive drawn uniformly from each point's label set.

  Re-drawn every epoch; deterministic given (seed, epoch). M = number of
  points with at least one label, in row order.
  """
  labels = sp.csr_matrix(labels)
  lens = _row_lengths(labels)
  rows = np.flatnonzero(lens > 0)
  rng = np.random.default_rng([seed, epoch, 0x5A4D])
  offset = np.floor(rng.random(rows.size) * lens[rows]).astype(np.int64)
  return rows.astype(np.int32), labels.indices[labels.indptr[rows] + offset].astype(np.int32)


def expand_all_positives(labels: sp.csr_matrix) -> Examples:
  """S2M paper: every (x_i, y) with y in Y_i becomes its own example.

  M = nnz(labels); examples of one point are consecutive, in stored order.
  """
  labels = sp.csr_matrix(labels)
  rows = np.repeat(np.arange(labels.shape[0], dtype=np.int32), _row_lengths(labels))
  return rows, labels.indices.astype(np.int32)


def first_label(labels: sp.csr_matrix) -> Examples:
  """Bamler & Mandt: keep only the first label of each point (as stored/in the file)."""
  labels = sp.csr_matrix(labels)
  rows = np.flatnonzero(_row_lengths(labels) > 0)
  return rows.astype(np.int32), labels.indices[labels.indptr[rows]].astype(np.int32)


def smallest_label_drop_empty(labels: sp.csr_matrix) -> Examples:
  """Bamler & Mandt's EURLex appendix: keep the smallest label id, drop unlabeled points.

  Equals `first_label` when every label list is sorted ascending (true for
  the bundled bibtex/delicious files).
  """
  labels = sp.csr_matrix(labels)
  lens = _row_lengths(labels)
  rows = np.flatnonzero(lens > 0)
  mins = np.minimum.reduceat(labels.indices, labels.indptr[rows]) if rows.size else \
      np.zeros(0, labels.indices.dtype)
  return rows.astype(np.int32), mins.astype(np.int32)


CONVERSIONS = {
    "sample_one_positive": sample_one_positive,
    "expand_all_positives": expand_all_positives,
    "first_label": first_label,
    "smallest_label_drop_empty": smallest_label_drop_empty,
}


def conversion_fn(name: str, labels: sp.csr_matrix, seed: int = 0) -> Callable[[int], Examples]:
  """Returns `epoch -> (example_index, label)` for a named conversion.

  Only `sample_one_positive` depends on the epoch; the others are computed
  once and returned for every epoch.
  """
  if name == "sample_one_positive":
    return lambda epoch: sample_one_positive(labels, seed, epoch)
  if name not in CONVERSIONS:
    raise ValueError(f"unknown conversion {name!r}; choose from {sorted(CONVERSIONS)}")
  fixed = CONVERSIONS[name](labels)
  return lambda epoch: fixed
