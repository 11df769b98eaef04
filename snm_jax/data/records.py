"""One example as the bytes of one ArrayRecord record, and a batch of them back as CSR blocks.

A record is little-endian:
  int64   example_id          the row's index in its split (the in-memory path's `example_id`)
  int32   n_labels, n_feats   label-set size; stored feature entries (sparse) or d (dense)
  int32   is_dense            0: sparse row; 1: dense row
  int32   labels[n_labels]    the label set, in file order
  sparse: int32 ids[n_feats], float32 values[n_feats]
  dense:  float32 values[n_feats]

Hand-written because ArrayRecord stores opaque bytes and no dependency of the library encodes a
sparse row (tf.train.Example would need TensorFlow); fixed-width arrays decode with one
`np.frombuffer` each, which keeps the per-example cost of the input path at a few microseconds.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

_HEADER = np.dtype([("example_id", "<i8"), ("n_labels", "<i4"), ("n_feats", "<i4"), ("is_dense", "<i4")])


def encode(example_id: int, labels: np.ndarray, feat_ids: np.ndarray | None,
           feat_vals: np.ndarray) -> bytes:
  """The record of one row: `feat_ids` None for a dense row (`feat_vals` its d values)."""
  labels, feat_vals = np.asarray(labels), np.asarray(feat_vals)
  dense = feat_ids is None
  return encode_rows(np.array([example_id]), np.array([0, labels.size]), labels,
                     None if dense else np.array([0, feat_vals.size]),
                     None if dense else np.asarray(feat_ids),
                     feat_vals.reshape(1, -1) if dense else feat_vals)[0]


def encode_rows(example_id: np.ndarray, label_indptr: np.ndarray, label_ids: np.ndarray,
                feat_indptr: np.ndarray | None, feat_ids: np.ndarray | None,
                feat_vals: np.ndarray) -> list[bytes]:
  """The records of n rows given CSR-like (as `RowBlock`; `feat_indptr` None and `feat_vals`
  (n, d) for dense rows), built in one word buffer: a chunk costs a few array operations and one
  bytes slice per row."""
  n = example_id.size
  n_labels = np.diff(label_indptr).astype(np.int64)
  dense = feat_indptr is None
  n_feats = (np.full(n, feat_vals.shape[1] if n else 0, np.int64) if dense
             else np.diff(feat_indptr).astype(np.int64))
  size = 5 + n_labels + (1 if dense else 2) * n_feats
  start = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
  words = np.zeros(int(size.sum()), "<i4")
  eid = np.asarray(example_id, np.int64)
  words[start] = (eid & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
  words[start + 1] = (eid >> 32).astype(np.int32)
  words[start + 2], words[start + 3], words[start + 4] = n_labels, n_feats, int(dense)
  words[ranges(start + 5, n_labels)] = np.asarray(label_ids, "<i4")
  feat_start = start + 5 + n_labels
  values = np.asarray(feat_vals, "<f4").reshape(-1).view("<i4")
  if dense:
    words[ranges(feat_start, n_feats)] = values
  else:
    words[ranges(feat_start, n_feats)] = np.asarray(feat_ids, "<i4")
    words[ranges(feat_start + n_feats, n_feats)] = values
  buf = words.tobytes()
  return [buf[4 * a:4 * (a + b)] for a, b in zip(start.tolist(), size.tolist())]


@dataclasses.dataclass
class RowBlock:
  """Decoded rows, CSR-like (n rows).

  Attributes:
    example_id: int64 (n,).
    label_indptr: int64 (n + 1,); label_ids: int32 (sum of set sizes,), each set in file order.
    feat_indptr, feat_ids, feat_vals: the sparse rows (feat_ids None for dense rows);
    dense: float32 (n, d) for dense rows, else None.
  """
  example_id: np.ndarray
  label_indptr: np.ndarray
  label_ids: np.ndarray
  feat_indptr: np.ndarray | None
  feat_ids: np.ndarray | None
  feat_vals: np.ndarray | None
  dense: np.ndarray | None


def ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
  """Concatenated [starts[i], starts[i] + lens[i]) for every i (int64)."""
  total = int(lens.sum())
  if not total:
    return np.zeros(0, np.int64)
  offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
  return offsets + np.arange(total)


def decode(records: Sequence[bytes]) -> RowBlock:
  """Decodes records written by `encode` (all sparse or all dense), vectorised over the batch: the
  records are joined into one buffer (every record is a whole number of 4-byte words) and every
  field is one gather from its word view."""
  n = len(records)
  words = np.frombuffer(b"".join(records), "<i4")
  sizes = np.fromiter((len(r) for r in records), np.int64, n) // 4
  start = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
  example_id = words[start].astype(np.int64) & 0xFFFFFFFF | words[start + 1].astype(np.int64) << 32
  n_labels, n_feats = words[start + 2].astype(np.int64), words[start + 3].astype(np.int64)
  is_dense = words[start + 4] if n else np.zeros(0, np.int32)
  if n and (is_dense != is_dense[0]).any():
    raise ValueError("records mix sparse and dense rows")
  label_indptr = np.concatenate([[0], np.cumsum(n_labels)])
  label_ids = words[ranges(start + 5, n_labels)]
  feat_start = start + 5 + n_labels
  if n and is_dense[0]:
    d = int(n_feats[0])
    if (n_feats != d).any():
      raise ValueError("dense records of different widths")
    dense = words[ranges(feat_start, n_feats)].view("<f4").reshape(n, d)
    return RowBlock(example_id, label_indptr, label_ids, None, None, None, dense)
  return RowBlock(example_id, label_indptr, label_ids, np.concatenate([[0], np.cumsum(n_feats)]),
                  words[ranges(feat_start, n_feats)],
                  words[ranges(feat_start + n_feats, n_feats)].view("<f4"), None)
