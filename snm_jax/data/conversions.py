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

from snm_jax.data import records

Examples = tuple[np.ndarray, np.ndarray]


def _row_lengths(labels: sp.csr_matrix) -> np.ndarray:
  return np.diff(sp.csr_matrix(labels).indptr)


# The conversions that pick one positive per point from its own label set: what a batch needs is
# the point's label set and id, so they run per batch on any input path (`snm_jax.data.pipeline`),
# with nothing precomputed over the whole training set.
PER_ROW = ("sample_one_positive", "first_label", "smallest_label_drop_empty")
_SAMPLE_SALT = 0x5A4D


def _splitmix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64's finaliser (Steele et al. 2014), uint64 -> uint64.

  Hand-written: the draw of example i must be computable from (seed, epoch, i) alone, in any
  batch and on any process; numpy's generators are sequential streams, and jax.random would put
  the input pipeline on the accelerator."""
  x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def uniform_per_example(seed: int, epoch: int, example_id: np.ndarray) -> np.ndarray:
  """float64 (n,) in [0, 1): a uniform draw per example id, a pure function of (seed, epoch, id)."""
  with np.errstate(over="ignore"):
    key = _splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ np.uint64(_SAMPLE_SALT))
    key = _splitmix64(key ^ np.uint64(epoch & 0xFFFFFFFFFFFFFFFF))
    bits = _splitmix64(key ^ np.asarray(example_id, np.int64).astype(np.uint64))
  return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def choose_positive(name: str, starts: np.ndarray, lens: np.ndarray, label_ids: np.ndarray,
                    example_id: np.ndarray, seed: int, epoch: int) -> np.ndarray:
  """The positive of each point under per-row conversion `name` (one of PER_ROW), int32 (n,).

  Point i's label set is label_ids[starts[i]:starts[i] + lens[i]] (file order, lens >= 1):
    sample_one_positive        the entry at floor(u * lens[i]), u = `uniform_per_example`
                               (SNM paper: one positive drawn uniformly, re-drawn every epoch);
    first_label                the first entry (Bamler & Mandt);
    smallest_label_drop_empty  the smallest id (Bamler & Mandt's EURLex appendix).
  """
  starts, lens = np.asarray(starts, np.int64), np.asarray(lens, np.int64)
  if name == "sample_one_positive":
    offset = np.floor(uniform_per_example(seed, epoch, example_id) * lens).astype(np.int64)
    return label_ids[starts + offset].astype(np.int32)
  if name == "first_label":
    return label_ids[starts].astype(np.int32)
  if name == "smallest_label_drop_empty":
    if not lens.size:
      return np.zeros(0, np.int32)
    flat = label_ids[records.ranges(starts, lens)]
    return np.minimum.reduceat(flat, np.concatenate([[0], np.cumsum(lens)[:-1]])).astype(np.int32)
  raise ValueError(f"{name!r} is not a per-row conversion; those are {PER_ROW}")


def _per_row(name: str, labels: sp.csr_matrix, seed: int = 0, epoch: int = 0) -> Examples:
  """`choose_positive` over every point with a label, in row order."""
  labels = sp.csr_matrix(labels)
  lens = _row_lengths(labels)
  rows = np.flatnonzero(lens > 0)
  return rows.astype(np.int32), choose_positive(name, labels.indptr[rows], lens[rows],
                                                labels.indices, rows, seed, epoch)


def sample_one_positive(labels: sp.csr_matrix, seed: int, epoch: int) -> Examples:
  """SNM paper: one positive drawn uniformly from each point's label set.

  Re-drawn every epoch; deterministic given (seed, epoch) and the point's row, whatever else is
  drawn (`choose_positive`). M = number of points with at least one label, in row order.
  """
  return _per_row("sample_one_positive", labels, seed, epoch)


def expand_all_positives(labels: sp.csr_matrix) -> Examples:
  """S2M paper: every (x_i, y) with y in Y_i becomes its own example.

  M = nnz(labels); examples of one point are consecutive, in stored order.
  """
  labels = sp.csr_matrix(labels)
  rows = np.repeat(np.arange(labels.shape[0], dtype=np.int32), _row_lengths(labels))
  return rows, labels.indices.astype(np.int32)


def first_label(labels: sp.csr_matrix) -> Examples:
  """Bamler & Mandt: keep only the first label of each point (as stored/in the file)."""
  return _per_row("first_label", labels)


def smallest_label_drop_empty(labels: sp.csr_matrix) -> Examples:
  """Bamler & Mandt's EURLex appendix: keep the smallest label id, drop unlabeled points.

  Equals `first_label` when every label list is sorted ascending (true for
  the bundled bibtex/delicious files).
  """
  return _per_row("smallest_label_drop_empty", labels)


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
