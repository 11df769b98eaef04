"""A dataset as ArrayRecord shards on disk (local or any etils.epath URI, e.g. gs://), and its
metadata: what a run needs from the whole training set, computed while the shards are written.

Layout of a converted dataset directory:
  metadata.json                        `Metadata` (below)
  <split>-00000-of-00004.array_record  the split's rows in order, one record per row (`records`)
  train_label_counts.npy               int64 (K,): positives per label of the whole training file

Rows are written in their split's order, shard s holding a contiguous block, so record i of a
split (through `grain.sources.ArrayRecordDataSource` over its files) is row i. Training splits
hold only rows with at least one label (a multiclass example needs a positive), each keeping its
row index in the split as `example_id`, exactly as the in-memory path numbers its examples.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import tempfile
from typing import Iterable, Iterator

import numpy as np
import scipy.sparse as sp
from etils import epath

from snm_jax.data import records
from snm_jax.errors import DataFormatError

FORMAT_VERSION = 1
# One record per chunk (random access reads exactly one row) and no compression: feature values are
# float32 noise to a compressor (brotli saved 4% on synthetic rows and cost 4x the writing time).
WRITER_OPTIONS = "group_size:1,uncompressed"
METADATA = "metadata.json"
TRAIN_LABEL_COUNTS = "train_label_counts.npy"


@dataclasses.dataclass
class SplitInfo:
  """One split's files and row statistics.

  Attributes:
    files: shard file names, in row order.
    num_rows: records in the split.
    unlabeled_rows_dropped: rows of the source split without a label, not written (training splits).
    nnz_histogram: [c_0, c_1, ...]: rows with i stored feature entries (sparse; [] for dense).
    labels_histogram: rows with i labels.
  """
  files: list[str]
  num_rows: int
  unlabeled_rows_dropped: int
  nnz_histogram: list[int]
  labels_histogram: list[int]


@dataclasses.dataclass
class Metadata:
  """metadata.json of a converted dataset.

  Attributes:
    name: the source dataset's name (`dataset.name` of the runs that read it).
    num_features, num_labels: d and K.
    dense: rows are dense float32 vectors (else sparse id/value rows).
    normalize_rows: rows were L2-normalised before writing (`dataset.normalize_rows`).
    validation_fraction, validation_seed: the validation carve written as split "validation"
      (`snm_jax.data.splits.split_validation`, as `dataset.validation_*` carves in memory).
    train_file_points: points of the whole training file (train + validation).
    splits: SplitInfo per split name.
  """
  name: str
  num_features: int
  num_labels: int
  dense: bool
  normalize_rows: bool
  validation_fraction: float
  validation_seed: int
  train_file_points: int
  splits: dict[str, SplitInfo]
  format_version: int = FORMAT_VERSION

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)

  @classmethod
  def from_json(cls, text: str, where: str) -> "Metadata":
    try:
      raw = json.loads(text)
      if raw.get("format_version") != FORMAT_VERSION:
        raise DataFormatError(where, None, f"format_version {raw.get('format_version')}, this "
                              f"library reads {FORMAT_VERSION}; convert the dataset again")
      raw["splits"] = {k: SplitInfo(**v) for k, v in raw["splits"].items()}
      return cls(**raw)
    except (ValueError, TypeError, KeyError) as e:
      raise DataFormatError(where, None, f"not a converted dataset's metadata ({e})") from None


def read_metadata(path) -> Metadata:
  """The Metadata of the converted dataset in directory `path` (DataFormatError if absent/bad)."""
  file = epath.Path(path) / METADATA
  if not file.exists():
    raise DataFormatError(file, None, "no such file; write the dataset with `python -m experiments.convert`")
  return Metadata.from_json(file.read_text(), str(file))


def split_paths(path, meta: Metadata, split: str) -> list[str]:
  if split not in meta.splits:
    raise DataFormatError(epath.Path(path) / METADATA, None,
                          f"no split {split!r} (it has {sorted(meta.splits)})")
  return [str(epath.Path(path) / f) for f in meta.splits[split].files]


def read_label_counts(path) -> np.ndarray:
  with (epath.Path(path) / TRAIN_LABEL_COUNTS).open("rb") as f:
    return np.load(f)


def _histogram_add(hist: list[int], values: np.ndarray) -> list[int]:
  counts = np.bincount(values) if values.size else np.zeros(0, np.int64)
  out = np.zeros(max(len(hist), counts.size), np.int64)
  out[:len(hist)] += np.asarray(hist, np.int64)
  out[:counts.size] += counts
  return out.tolist()


def write_split(out_dir, split: str, chunks: Iterable[tuple[sp.csr_matrix | np.ndarray, sp.csr_matrix]],
                num_rows: int, num_shards: int, *, drop_unlabeled: bool,
                label_counts: np.ndarray | None = None) -> SplitInfo:
  """Writes a split given as chunks of rows `(features (n, d) CSR or dense, labels (n, K) CSR)`,
  in order, into `num_shards` ArrayRecord files of contiguous row blocks; memory is one chunk.

  num_rows: the rows the chunks will hold (before dropping unlabeled ones; shard boundaries are
    cut from it, so the shards of a training split with dropped rows are slightly uneven).
  drop_unlabeled: skip rows without a label (training splits); the rest keep their row index.
  label_counts: int64 (K,) accumulated in place with the written rows' positives, if given.
  """
  out_dir = epath.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  num_shards = max(1, min(num_shards, num_rows)) if num_rows else 1
  files = [f"{split}-{s:05d}-of-{num_shards:05d}.array_record" for s in range(num_shards)]
  bounds = [num_rows * (s + 1) // num_shards for s in range(num_shards)]
  shard, writer = 0, _ShardWriter(out_dir / files[0])
  row, written, dropped = 0, 0, 0
  nnz_hist, lab_hist = [], []
  for features, labels in chunks:
    labels = sp.csr_matrix(labels)
    dense = not sp.issparse(features)
    feats = np.asarray(features, np.float32) if dense else sp.csr_matrix(features, dtype=np.float32)
    lens = np.diff(labels.indptr)
    keep = lens > 0 if drop_unlabeled else np.ones(lens.size, bool)
    dropped += int((~keep).sum())
    lab_hist = _histogram_add(lab_hist, lens[keep])
    if not dense:
      nnz_hist = _histogram_add(nnz_hist, np.diff(feats.indptr)[keep])
    if label_counts is not None:
      kept = labels[np.flatnonzero(keep)]
      np.add.at(label_counts, kept.indices, 1)
    rows = np.flatnonzero(keep)
    if dense:
      blob = records.encode_rows(row + rows, np.concatenate([[0], np.cumsum(lens[rows])]),
                                 labels[rows].indices, None, None, feats[rows])
    else:
      sub, sub_labels = feats[rows], labels[rows]
      blob = records.encode_rows(row + rows, sub_labels.indptr, sub_labels.indices, sub.indptr,
                                 sub.indices, sub.data)
    for i, record in zip(rows.tolist(), blob):
      while shard + 1 < num_shards and row + i >= bounds[shard]:
        writer.close()
        shard += 1
        writer = _ShardWriter(out_dir / files[shard])
      writer.write(record)
    written += rows.size
    row += lens.size
  writer.close()
  for s in range(shard + 1, num_shards):  # every named file exists, even if empty
    _ShardWriter(out_dir / files[s]).close()
  if row != num_rows:
    raise ValueError(f"split {split}: the chunks held {row} rows, {num_rows} were announced")
  return SplitInfo(files=files, num_rows=written, unlabeled_rows_dropped=dropped,
                   nnz_histogram=nnz_hist, labels_histogram=lab_hist)


class _ShardWriter:
  """An ArrayRecord file at `path`, local or remote. ArrayRecord's writer opens local files only
  (its reader opens gs:// itself): a remote shard is written to a local temporary file, then copied
  with etils.epath on `close` -- local disk for one shard at a time."""

  def __init__(self, path: epath.Path):
    from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
    self.path = path
    self._local = None if _is_local(path) else tempfile.mkdtemp(prefix="snm_jax_shard_")
    target = path if self._local is None else pathlib.Path(self._local) / path.name
    self._writer = ArrayRecordWriter(str(target), WRITER_OPTIONS)

  def write(self, record: bytes) -> None:
    self._writer.write(record)

  def close(self) -> None:
    self._writer.close()
    if self._local is not None:
      try:
        epath.Path(self._local, self.path.name).copy(self.path, overwrite=True)
      finally:
        shutil.rmtree(self._local, ignore_errors=True)


def _is_local(path) -> bool:
  return "://" not in str(path)


def write_metadata(out_dir, meta: Metadata, train_label_counts: np.ndarray) -> None:
  out_dir = epath.Path(out_dir)
  with (out_dir / TRAIN_LABEL_COUNTS).open("wb") as f:
    np.save(f, np.asarray(train_label_counts, np.int64))
  (out_dir / METADATA).write_text(meta.to_json())  # last: a directory with it is complete


def chunks_of(features, labels: sp.csr_matrix, chunk_rows: int) -> Iterator[tuple]:
  """In-memory rows as `write_split` chunks of `chunk_rows`."""
  n = labels.shape[0]
  for lo in range(0, n, chunk_rows):
    yield features[lo:lo + chunk_rows], labels[lo:lo + chunk_rows]


def percentile_from_histogram(hist: list[int], percentile: float) -> int:
  """The `percentile`-th percentile (method "higher") of the values a histogram counts."""
  counts = np.asarray(hist, np.int64)
  total = int(counts.sum())
  if not total:
    return 0
  # method="higher": the value at sorted position ceil(q * (n - 1)).
  rank = int(np.ceil(percentile / 100.0 * (total - 1)))
  return int(np.searchsorted(np.cumsum(counts), rank + 1))


def read_split(path, split: str, chunk_rows: int = 65_536, meta: Metadata | None = None,
               rows: np.ndarray | None = None):
  """Split `split` of the converted dataset at `path` in host memory, as the in-memory path holds
  a split: (features CSR (N, d) float32, or dense (N, d), labels CSR (N, K) float32). For the
  evaluation splits, and a bounded sample of a training split (the tree sampler's fit); a training
  split is read by index while training (`pipeline.ShardedRows`). `meta`: the dataset's metadata if
  already read; `rows`: only these records (int (n,), in that order), None for all."""
  import grain  # pylint: disable=g-import-not-at-top
  meta = meta or read_metadata(path)
  source = grain.sources.ArrayRecordDataSource(split_paths(path, meta, split))
  rows = np.arange(len(source)) if rows is None else np.asarray(rows, np.int64)
  feats, labs = [], []
  for lo in range(0, rows.size, chunk_rows):
    block = records.decode(source.__getitems__([int(r) for r in rows[lo:lo + chunk_rows]]))
    n = block.example_id.size
    labs.append(sp.csr_matrix((np.ones(block.label_ids.size, np.float32), block.label_ids,
                               block.label_indptr), shape=(n, meta.num_labels)))
    if meta.dense:
      feats.append(block.dense)
    else:
      feats.append(sp.csr_matrix((block.feat_vals, block.feat_ids, block.feat_indptr),
                                 shape=(n, meta.num_features)))
  k, d = meta.num_labels, meta.num_features
  labels = sp.vstack(labs, format="csr") if labs else sp.csr_matrix((0, k), dtype=np.float32)
  if meta.dense:
    features = np.concatenate(feats) if feats else np.zeros((0, d), np.float32)
  else:
    features = sp.vstack(feats, format="csr") if feats else sp.csr_matrix((0, d), dtype=np.float32)
  return features, labels
