"""Input pipeline: fixed-shape batches (padded sparse rows, or dense rows) of this process's
slice of each global batch, built by Grain from rows in memory or in ArrayRecord shards.

Each global batch b of epoch e is the slice [b*G, (b+1)*G) of Grain's index shuffle of the
epoch's examples; process p of P builds only rows [p*G/P, (p+1)*G/P) of it, so the concatenation
over processes does not depend on P, nor on where the rows are read from (`InMemoryRows`,
`ShardedRows`). `make_global_batch` turns the per-process slices into one `jax.Array` sharded
over the mesh's data axis.
"""
from __future__ import annotations

import functools
from typing import Iterator

import grain
import jax
import numpy as np
import scipy.sparse as sp
from absl import flags, logging

from snm_jax.data import conversions, records, shards
from snm_jax.data.index_shuffle import index_shuffle

Examples = tuple[np.ndarray, np.ndarray]
BATCH_KEYS = ("feat_ids", "feat_vals", "label", "label_set", "valid", "example_id")
DENSE_BATCH_KEYS = ("features", "label", "label_set", "valid", "example_id")


def choose_max_nnz_from_histogram(hist, percentile: float = 100.0, multiple_of: int = 8) -> int:
  """Smallest multiple of `multiple_of` >= the `percentile`-th percentile (numpy's "higher"
  method) of the per-row counts that `hist` counts (hist[i]: rows with i entries); >= 1."""
  v = shards.percentile_from_histogram(list(np.asarray(hist, np.int64)), percentile)
  return max(1, -(-v // multiple_of) * multiple_of) if np.sum(hist) else multiple_of


def choose_max_nnz(row_nnz: np.ndarray, percentile: float = 100.0, multiple_of: int = 8) -> int:
  """`choose_max_nnz_from_histogram` of the counts `row_nnz` (N,)."""
  return choose_max_nnz_from_histogram(np.bincount(np.asarray(row_nnz, np.int64)), percentile,
                                       multiple_of)


# ------------------------------------------------------------------ rows

class InMemoryRows:
  """Rows held in host memory: CSR (N, d) or dense (N, d) features and CSR (N, K) label sets."""

  def __init__(self, features, labels, dense: bool = False):
    if dense:
      if sp.issparse(features):
        features = features.toarray()
      self.features = np.ascontiguousarray(features, dtype=np.float32)
      if self.features.ndim != 2:
        raise ValueError(f"features must be a 2-D (N, d) array, got shape {self.features.shape}")
    else:
      self.features = sp.csr_matrix(features, dtype=np.float32)
    self.labels = sp.csr_matrix(labels)
    if self.features.shape[0] != self.labels.shape[0]:
      raise ValueError(f"features have {self.features.shape[0]} rows, labels "
                       f"{self.labels.shape[0]}")
    self.dense = dense
    self.num_rows, self.num_features = self.features.shape

  def row_nnz(self) -> np.ndarray:
    """int64 (N,): stored feature entries per row (d for dense rows)."""
    if self.dense:
      return np.full(self.num_rows, self.num_features, np.int64)
    return np.diff(self.features.indptr).astype(np.int64)

  def histograms(self) -> tuple[np.ndarray, np.ndarray]:
    """(rows with i feature entries, rows with i labels), over every row."""
    return np.bincount(self.row_nnz()), np.bincount(np.diff(self.labels.indptr))

  def labeled_rows(self) -> np.ndarray:
    return np.flatnonzero(np.diff(self.labels.indptr) > 0)

  def read_labels(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(label_indptr int64 (n + 1,), label_ids int32) of `rows`' label sets, CSR-like."""
    lab = self.labels
    l_lens = lab.indptr[rows + 1] - lab.indptr[rows]
    label_ids = lab.indices[records.ranges(lab.indptr[rows], l_lens)].astype(np.int32)
    return np.concatenate([[0], np.cumsum(l_lens)]), label_ids

  def read(self, rows: np.ndarray) -> records.RowBlock:
    rows = np.asarray(rows, np.int64)
    label_indptr, label_ids = self.read_labels(rows)
    if self.dense:
      return records.RowBlock(rows, label_indptr, label_ids, None, None, None, self.features[rows])
    f = self.features
    f_lens = f.indptr[rows + 1] - f.indptr[rows]
    pos = records.ranges(f.indptr[rows], f_lens)
    return records.RowBlock(rows, label_indptr, label_ids, np.concatenate([[0], np.cumsum(f_lens)]),
                            f.indices[pos].astype(np.int32), f.data[pos], None)


class ShardedRows:
  """Rows of one split of a converted dataset (`snm_jax.data.shards`), read by index through
  Grain's ArrayRecord source: nothing but the records asked for is read or kept."""

  def __init__(self, path, split: str, meta: shards.Metadata | None = None):
    """meta: the dataset's metadata.json if already read (else it is read here)."""
    self.path, self.split = str(path), split
    self.meta = meta or shards.read_metadata(path)
    info = self.meta.splits.get(split)
    self.source = grain.sources.ArrayRecordDataSource(shards.split_paths(path, self.meta, split))
    if len(self.source) != info.num_rows:
      raise ValueError(f"{path}: split {split} has {len(self.source)} records, its metadata "
                       f"{info.num_rows}")
    self.dense = self.meta.dense
    self.num_rows, self.num_features = info.num_rows, self.meta.num_features
    self.num_labels, self.name = self.meta.num_labels, self.meta.name
    self._info = info

  @property
  def num_points(self) -> int:
    return self.num_rows

  def histograms(self) -> tuple[np.ndarray, np.ndarray]:
    if self.dense:
      return (np.bincount([self.num_features], minlength=self.num_features + 1) * self.num_rows,
              np.asarray(self._info.labels_histogram, np.int64))
    return (np.asarray(self._info.nnz_histogram, np.int64),
            np.asarray(self._info.labels_histogram, np.int64))

  def labeled_rows(self) -> None:
    """None: every record (the converter drops a training split's unlabeled rows)."""
    if self._info.labels_histogram and self._info.labels_histogram[0]:
      raise ValueError(f"{self.path}: split {self.split} has {self._info.labels_histogram[0]} rows "
                       "without a label; training needs a split written with them dropped")
    return None

  def read(self, rows: np.ndarray) -> records.RowBlock:
    return records.decode(self.source.__getitems__([int(r) for r in rows]))


def _truncated_positions(indptr: np.ndarray, values: np.ndarray | None, width: int):
  """(positions kept (into the CSR block's entries), kept per row): per row at most `width`
  entries, the largest-|value| ones if `values` is given (ties: the earlier stored entry), else
  the first `width`; kept entries stay in stored order."""
  lens = np.diff(indptr)
  if lens.max(initial=0) <= width:
    return np.arange(int(indptr[-1])), lens
  row = np.repeat(np.arange(lens.size), lens)
  order = (np.lexsort((np.arange(row.size), -np.abs(values), row)) if values is not None
           else np.arange(row.size))
  rank = np.empty(row.size, np.int64)
  rank[order] = np.arange(row.size) - indptr[row[order]]
  return np.flatnonzero(rank < width), np.minimum(lens, width)


def _pad(kept_lens: np.ndarray, n: int, width: int, *arrays_and_fills):
  """Scatters each row's kept entries into (n, width) arrays, padded with the given fill."""
  mask = np.arange(width)[None, :] < kept_lens[:, None]
  out = []
  for values, fill, dtype in arrays_and_fills:
    a = np.full((n, width), fill, dtype)
    a[:kept_lens.size][mask] = values
    out.append(a)
  return out


def _gather_padded(table: np.ndarray, rows: np.ndarray, n: int, fill) -> np.ndarray:
  """table[rows] as the first rows of an (n, width) array, the rest `fill`."""
  out = np.empty((n, table.shape[1]), table.dtype)
  np.take(table, rows, axis=0, out=out[:rows.size])
  out[rows.size:] = fill
  return out


def _histogram_stats(hist: np.ndarray, cap: int) -> tuple[int, int, int]:
  """(rows, rows over `cap`, entries over `cap`) of a histogram of per-row counts."""
  hist = np.asarray(hist, np.int64)
  v = np.arange(hist.size)
  over = v > cap
  return int(hist.sum()), int(hist[over].sum()), int(((v - cap) * hist)[over].sum())


# Global steps of an unbounded run: the batch dataset's length (Grain's MapDataset is finite).
_UNBOUNDED_STEPS = 2 ** 40


class SparseBatcher:
  """Deterministic, resumable iterator over fixed-shape padded batches, built on Grain.

  Yields dicts of numpy arrays for THIS process's slice (n = G / P rows):
    feat_ids   int32 (n, max_nnz)    feature ids, padded with 0
    feat_vals  float32 (n, max_nnz)  feature values, padded with 0.0
    label      int32 (n,)            the example's positive (0 for padding,
                                     -1 everywhere if `examples=None`)
    label_set  int32 (n, max_labels) the point's full label set, padded -1
    valid      bool (n,)             False for padding rows of the last batch
    example_id int32 (n,)            feature row (data point) index, -1 padding

  Order: global batch b of epoch e holds positions [b*G, (b+1)*G) of epoch e's permutation of
  the M examples, Grain's index shuffle (`grain.experimental.index_shuffle`, 4 rounds, seed
  `seed + e`: the permutation of `MapDataset.range(M).shuffle(seed).repeat()`), computed for a
  window of positions at a time by `snm_jax.data.index_shuffle`, so no O(M) array is built.
  Process p of P builds only rows [p*G/P, (p+1)*G/P) of it, so the concatenation over processes
  does not depend on P. The batches are a Grain `MapDataset` indexed by the global step, read
  through `to_iter_dataset` with `read_threads` background threads (`prefetch` batches ahead; 0:
  in the caller's thread) and optionally `workers` processes (`mp_prefetch`); the state saved in
  checkpoints is Grain's iterator state, and any state restores onto any process count.

  Rows with more than `max_nnz` features keep their largest-|value| entries;
  label sets longer than `max_labels` keep their first stored ids. Both are
  counted in `stats` and logged once per epoch.
  """

  def __init__(self, features, labels, examples: Examples | str | None, *,
               global_batch_size: int, max_nnz: int | str = "auto",
               max_labels: int | str = "auto", seed: int = 0,
               process_index: int | None = None, process_count: int | None = None,
               shuffle: bool = True, drop_remainder: bool = False,
               num_epochs: int | None = None, nnz_percentile: float = 100.0,
               pad_multiple: int = 8, log_epochs: bool = True, read_threads: int = 0,
               prefetch: int = 2, workers: int = 0, rows_on_device: bool = False):
    """Builds the batcher.

    Args:
      features: CSR (N, d) (dense (N, d) for DenseBatcher) held in memory, or a `ShardedRows`
        (a converted dataset's split, read by index; `labels` None).
      labels: CSR (N, K), full label sets (stored order kept); None with `ShardedRows`.
      examples: `(example_index (M,), label (M,))` from a conversion (fixed for all epochs;
        in-memory rows only), a conversion name from `conversions.CONVERSIONS` (the per-row
        ones, `conversions.PER_ROW`, choose each point's positive in the batch, from (seed,
        epoch, point): "sample_one_positive" is re-drawn every epoch), or None for every row
        once with label -1 (evaluation).
      global_batch_size: G, divisible by process_count.
      max_nnz: int, or "auto": the `nnz_percentile` percentile of row nnz,
        rounded up to `pad_multiple` (100 = never truncate).
      max_labels: int, or "auto" (largest label set, rounded up).
      seed: shuffling (and conversion) seed.
      process_index, process_count: this process's slice (default: jax's;
        see `process_data_slice` for meshes whose data axis is not laid out
        by process).
      shuffle: permute examples every epoch.
      drop_remainder: drop the last partial batch instead of padding it.
      num_epochs: stop after this many epochs (None: forever).
      log_epochs: log each epoch's truncation counts when it ends (the dataset-wide counts are
        logged once, at construction, either way). An evaluation batcher, which replays the
        same single epoch at every evaluation, turns it off.
      read_threads, prefetch: Grain's ReadOptions: threads building batches ahead of the
        consumer and how many batches they keep ready (read_threads=0: built on demand).
      workers: Grain worker processes (`mp_prefetch`), 0 for none.
      rows_on_device: while the rows are padded once in memory (`_padded_rows`), a batch holds
        "row" int32 (n,) (each example's row, padding rows the extra all-padding row N) in place
        of feat_ids, feat_vals and label_set, which `snm_jax.data.device_rows.DeviceRows`
        gathers on the devices from `device_tables()`: the same arrays, without the host's
        gather and transfer of every batch.
    """
    rows_source = features if isinstance(features, ShardedRows) else None
    if rows_source is None:
      rows_source = InMemoryRows(features, labels, dense=self._dense)
    elif labels is not None:
      raise ValueError("labels must be None when features are ShardedRows (the records hold them)")
    if rows_source.dense != self._dense:
      raise ValueError(f"{type(self).__name__} reads {'dense' if self._dense else 'sparse'} rows; "
                       f"the given rows are {'dense' if rows_source.dense else 'sparse'}")
    self.rows = rows_source
    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    if global_batch_size <= 0 or global_batch_size % self.process_count:
      raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple "
                       f"of process_count={self.process_count}")
    if not 0 <= self.process_index < self.process_count:
      raise ValueError(f"process_index={self.process_index} not in [0, {self.process_count})")
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // self.process_count
    self.seed, self.shuffle = seed, shuffle
    self.drop_remainder, self.num_epochs = drop_remainder, num_epochs
    self.log_epochs = log_epochs
    self.read_threads, self.prefetch, self.workers = read_threads, prefetch, workers
    self.rows_on_device = rows_on_device

    self._eval_mode = examples is None
    self._per_row = None        # a per-row conversion's name
    self._example_rows = None   # (M,) rows of the examples, None: every row (record) in order
    self._example_labels = None
    if examples is None:
      self.num_examples = rows_source.num_rows
    elif isinstance(examples, str) and examples in conversions.PER_ROW:
      self._per_row = examples
      self._example_rows = rows_source.labeled_rows()
      self.num_examples = (rows_source.num_rows if self._example_rows is None
                           else self._example_rows.size)
    else:
      if isinstance(rows_source, ShardedRows):
        raise ValueError(f"examples {examples if isinstance(examples, str) else 'arrays'}: sharded "
                         f"rows take the per-row conversions {conversions.PER_ROW} or None")
      if isinstance(examples, str):
        if examples not in conversions.CONVERSIONS:
          raise ValueError(f"unknown conversion {examples!r}; choose from "
                           f"{sorted(conversions.CONVERSIONS)}")
        examples = conversions.CONVERSIONS[examples](rows_source.labels)
      ex_idx, ex_lab = np.asarray(examples[0], np.int64), np.asarray(examples[1], np.int32)
      if ex_idx.shape != ex_lab.shape:
        raise ValueError("example_index and label must have the same shape")
      if ex_idx.size and (ex_idx.min() < 0 or ex_idx.max() >= rows_source.num_rows):
        raise ValueError("example_index out of range of the feature rows")
      self._example_rows, self._example_labels = ex_idx, ex_lab
      self.num_examples = ex_idx.size

    nnz_hist, labels_hist = rows_source.histograms()
    self.max_nnz = self._choose_max_nnz(nnz_hist, max_nnz, nnz_percentile, pad_multiple)
    self.max_labels = (choose_max_nnz_from_histogram(labels_hist, 100.0, pad_multiple)
                       if max_labels == "auto" else int(max_labels))
    if self.max_nnz < 1 or self.max_labels < 1:
      raise ValueError("max_nnz and max_labels must be >= 1")
    rows_n, over_n, dropped_n = _histogram_stats(nnz_hist, self.max_nnz)
    _, over_l, dropped_l = _histogram_stats(labels_hist, self.max_labels)
    self._dataset_stats = {
        "max_nnz": self.max_nnz,
        "max_labels": self.max_labels,
        "dataset_rows": rows_source.num_rows,
        "dataset_rows_truncated": over_n,
        "dataset_nnz_dropped": dropped_n,
        "dataset_nnz": int((np.arange(nnz_hist.size) * nnz_hist).sum()),
        "dataset_label_sets_truncated": over_l,
        "dataset_labels_dropped": dropped_l,
    }
    log = logging.warning if over_n or over_l else logging.info
    log("%s: max_nnz=%d truncates %d of %d rows (%d of %d feature entries "
        "dropped); max_labels=%d truncates %d label sets (%d labels dropped).",
        type(self).__name__, self.max_nnz, over_n, self._dataset_stats["dataset_rows"], dropped_n,
        self._dataset_stats["dataset_nnz"], self.max_labels, over_l, dropped_l)

    self._step = 0          # global batch index of the next batch handed out
    self._iterator = None   # Grain's iterator, positioned at self._step; built on first use
    self._shuffle_window = None  # (epoch, first position, its indices): `_positions`' cache
    self._padded = None     # `_padded_rows`' cache
    self._reset_epoch_stats()

  _dense = False

  @property
  def labels(self) -> sp.csr_matrix:
    """The label sets (N, K) of in-memory rows."""
    return self.rows.labels

  @property
  def features(self):
    """The features (N, d) of in-memory rows."""
    return self.rows.features

  def _choose_max_nnz(self, nnz_hist, max_nnz, nnz_percentile, pad_multiple) -> int:
    return (choose_max_nnz_from_histogram(nnz_hist, nnz_percentile, pad_multiple)
            if max_nnz == "auto" else int(max_nnz))

  # ----------------------------------------------------------------- features
  def _features(self, block: records.RowBlock, n: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """(feature arrays padded to n rows, rows truncated (bool per block row), entries dropped)."""
    pos, kept = _truncated_positions(block.feat_indptr, block.feat_vals, self.max_nnz)
    feat_ids, feat_vals = _pad(kept, n, self.max_nnz, (block.feat_ids[pos], 0, np.int32),
                               (block.feat_vals[pos], 0.0, np.float32))
    lens = np.diff(block.feat_indptr)
    return {"feat_ids": feat_ids, "feat_vals": feat_vals}, lens > kept, lens - kept

  def example_inputs(self) -> tuple[np.ndarray, ...]:
    """Zero tower inputs of one row, shaped and typed as `towers.tower_inputs` of a batch
    (what `tower.init` needs): (feat_ids (1, max_nnz) int32, feat_vals (1, max_nnz) float32)."""
    return (np.zeros((1, self.max_nnz), np.int32), np.zeros((1, self.max_nnz), np.float32))

  # ----------------------------------------------------------------- batches
  def steps_per_epoch(self, epoch: int = 0) -> int:
    del epoch  # every epoch has the same M examples
    m, g = self.num_examples, self.global_batch_size
    return m // g if self.drop_remainder else -(-m // g)

  def _num_steps(self) -> int:
    steps = self.steps_per_epoch()
    return _UNBOUNDED_STEPS if self.num_epochs is None else self.num_epochs * steps

  # Positions of an epoch's order computed at once (and kept) when a batch asks for them: the
  # shuffle's per-call cost (cycle walking) is then paid once per window, not once per batch.
  _SHUFFLE_WINDOW = 1 << 16

  def _positions(self, epoch: int, lo: int, hi: int) -> np.ndarray:
    """Example indices at positions [lo, hi) of epoch `epoch`'s order."""
    if not self.shuffle:
      return np.arange(lo, hi, dtype=np.int64)
    window = self._shuffle_window  # (epoch, start, indices): read once, as threads replace it
    if window is None or window[0] != epoch or not window[1] <= lo <= hi <= window[1] + window[2].size:
      end = min(max(hi, lo + self._SHUFFLE_WINDOW), self.num_examples)
      window = (epoch, lo, index_shuffle(np.arange(lo, end), max_index=self.num_examples - 1,
                                         seed=(self.seed + epoch) % 2 ** 32, rounds=4))
      self._shuffle_window = window
    return window[2][lo - window[1]:hi - window[1]]

  def batch_at(self, epoch: int, position: int) -> dict:
    """This process's slice of global batch `position` of `epoch` (no state change)."""
    return self._build(epoch * self.steps_per_epoch() + position)[0]

  # In-memory sparse rows are padded once, all of them (while that takes at most this many bytes),
  # and a batch is then a gather of its rows: the same arrays as padding each batch's rows, at a
  # fraction of the host time the input thread takes from the train step's 2 cores (Bibtex: the
  # recipe's batches cost ~4.5 s of its ~35 s when built per batch).
  PADDED_ROWS_MAX_BYTES = 512 << 20

  def _padded_rows(self) -> dict | None:
    """Every row padded to (max_nnz, max_labels) with its truncation counts, or None (sharded or
    dense rows, or more than PADDED_ROWS_MAX_BYTES); rebuilt when a width changes."""
    widths = (self.max_nnz, self.max_labels)
    if self._padded is not None and self._padded["widths"] == widths:
      return self._padded
    rows = self.rows
    if (not isinstance(rows, InMemoryRows) or rows.dense
        or rows.num_rows * (8 * self.max_nnz + 4 * self.max_labels) > self.PADDED_ROWS_MAX_BYTES):
      return None
    features, rest = self._pad_block(rows.read(np.arange(rows.num_rows)), rows.num_rows)
    self._padded = {"widths": widths, "features": features, **rest}
    return self._padded

  # What `device_tables` pads each array's extra row with: the batch's padding rows gather it.
  _DEVICE_FILL = {"feat_ids": 0, "feat_vals": 0.0, "label_set": -1}

  def device_tables(self) -> dict | None:
    """{"feat_ids", "feat_vals" (N + 1, max_nnz), "label_set" (N + 1, max_labels)}: every row
    padded (`_padded_rows`) and one all-padding row N, which the batches' "row" arrays index
    (`rows_on_device`); None when the batches carry their arrays (no `rows_on_device`, or rows
    not padded in memory)."""
    padded = self._padded_rows() if self.rows_on_device else None
    if padded is None:
      return None
    arrays = {**padded["features"], "label_set": padded["label_set"]}
    return {name: np.concatenate([a, np.full((1, a.shape[1]), self._DEVICE_FILL[name], a.dtype)])
            for name, a in arrays.items()}

  def _pad_block(self, block: records.RowBlock, n: int) -> tuple[dict, dict]:
    """A block's rows padded to n rows: (the feature arrays (`_features`), {"label_set" (n,
    max_labels), and per row "truncated" (features), "dropped" (feature entries) and
    "labels_truncated" (label set)})."""
    features, truncated, dropped = self._features(block, n)
    pos, kept = _truncated_positions(block.label_indptr, None, self.max_labels)
    label_set, = _pad(kept, n, self.max_labels, (block.label_ids[pos], -1, np.int32))
    return features, {"label_set": label_set, "truncated": truncated, "dropped": dropped,
                      "labels_truncated": np.diff(block.label_indptr) > kept}

  def _build(self, step: int) -> tuple[dict, dict]:
    """(this process's slice of global batch `step`, its truncation counts)."""
    steps = self.steps_per_epoch()
    epoch, position = divmod(step, steps)
    # This process's rows of the global batch, cut here rather than by Grain's ShardByJaxProcess,
    # which gives each process its own shard of the examples: the global batches would then depend
    # on the number of processes, and a checkpoint would not resume bit-identically on another.
    n, m = self.local_batch_size, self.num_examples
    lo = min(position * self.global_batch_size + self.process_index * n, m)
    hi = min(lo + n, (position + 1) * self.global_batch_size, m)
    ex = self._positions(epoch, lo, hi)
    rows = ex if self._example_rows is None else self._example_rows[ex]
    k = rows.size
    padded = self._padded_rows()
    if padded is None:
      block = self.rows.read(rows)
      features, out = self._pad_block(block, n)
      label_indptr, label_ids, example_ids = block.label_indptr, block.label_ids, block.example_id
    else:  # the same arrays, gathered (feature padding 0, label-set padding -1)
      out = {name: padded[name][rows] for name in ("truncated", "dropped", "labels_truncated")}
      if self.rows_on_device:  # gathered there from `device_tables` (padding: its row N)
        features = {"row": np.full(n, self.rows.num_rows, np.int32)}
        features["row"][:k] = rows
      else:
        features = {name: _gather_padded(table, rows, n, 0) for name, table in padded["features"].items()}
        out["label_set"] = _gather_padded(padded["label_set"], rows, n, -1)
      example_ids = rows
      if self._per_row is not None:
        label_indptr, label_ids = self.rows.read_labels(np.asarray(rows, np.int64))
    label = np.zeros(n, np.int32)
    if self._eval_mode:
      label[:] = -1
    elif self._per_row is not None:
      label[:k] = conversions.choose_positive(self._per_row, label_indptr[:-1], np.diff(label_indptr),
                                              label_ids, example_ids, self.seed, epoch)
    else:
      label[:k] = self._example_labels[ex]
    valid = np.zeros(n, bool)
    valid[:k] = True
    example_id = np.full(n, -1, np.int32)
    example_id[:k] = example_ids
    counts = {"epoch_examples": k, "epoch_rows_truncated": int(out["truncated"].sum()),
              "epoch_nnz_dropped": int(out["dropped"].sum()),
              "epoch_label_sets_truncated": int(out["labels_truncated"].sum())}
    label_set = {"label_set": out["label_set"]} if "label_set" in out else {}
    return ({**features, "label": label, **label_set, "valid": valid, "example_id": example_id},
            counts)

  # ----------------------------------------------------------------- iteration
  def _grain_iterator(self):
    """Grain's iterator over the batch dataset (global step -> this process's batch)."""
    ds = grain.MapDataset.range(self._num_steps()).map(self._build)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=self.read_threads,
                                              prefetch_buffer_size=self.prefetch if self.read_threads else 0))
    if self.workers:
      _grain_flags_parsed()
      it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers))
    return iter(it)

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    steps = self.steps_per_epoch()
    if steps == 0:
      raise ValueError(f"the data has {self.num_examples} examples: fewer than one global batch "
                       f"({self.global_batch_size}) with drop_remainder, or none at all")
    if self._step >= self._num_steps():
      self.close()
      raise StopIteration
    if self._iterator is None:
      self._iterator = self._grain_iterator()
      if self._step:
        self._iterator.set_state(self._grain_state(self._step))
    batch, counts = next(self._iterator)
    st = self._epoch_stats
    for key, value in counts.items():
      st[key] += value
    self._step += 1
    if self._step % steps == 0:
      if self.log_epochs:
        # Every epoch at debug verbosity (-v 1), a warning when it truncated something.
        truncated = st["epoch_rows_truncated"] or st["epoch_label_sets_truncated"]
        log = logging.warning if truncated else functools.partial(logging.vlog, 1)
        log("epoch %d (process %d/%d): %d examples; %d truncated to max_nnz=%d "
            "(%d feature entries dropped); %d label sets truncated to max_labels=%d.",
            st["epoch"], self.process_index, self.process_count, st["epoch_examples"],
            st["epoch_rows_truncated"], self.max_nnz, st["epoch_nnz_dropped"],
            st["epoch_label_sets_truncated"], self.max_labels)
      self._reset_epoch_stats()
    return batch

  def close(self) -> None:
    """Stops Grain's prefetch threads / workers (a later `next` starts them again)."""
    if self._iterator is not None:
      close = getattr(self._iterator, "close", None)
      if close is not None:
        close()
      self._iterator = None

  def __getstate__(self) -> dict:
    """What Grain's worker processes receive with `_build`: everything but the live iterator and the
    padded rows (each worker pads them again rather than receive them pickled)."""
    return {**self.__dict__, "_iterator": None, "_padded": None}

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  # interpreter shutdown
      pass

  # ----------------------------------------------------------------- state
  def _grain_state(self, step: int) -> dict:
    """Grain's iterator state at global step `step`: its MapDataset's next index (the iterator
    is rebuilt from a position, so the state restores onto any worker and process count)."""
    return {"next_index": step}

  def get_state(self) -> dict:
    """JSON-able position of the next batch: {"epoch", "position", "seed", "global_batch_size",
    "grain": Grain's iterator state}."""
    epoch, position = divmod(self._step, max(self.steps_per_epoch(), 1))
    return {"epoch": epoch, "position": position, "seed": self.seed,
            "global_batch_size": self.global_batch_size, "grain": self._grain_state(self._step)}

  def set_state(self, state: dict) -> None:
    """Resumes exactly at a state from `get_state` (any process_count)."""
    for key in ("seed", "global_batch_size"):
      if key in state and state[key] != getattr(self, key):
        raise ValueError(f"iterator state has {key}={state[key]}, this batcher "
                         f"{getattr(self, key)}; cannot resume the same sequence")
    epoch, position = int(state["epoch"]), int(state["position"])
    steps = self.steps_per_epoch()
    if not 0 <= position <= steps:
      raise ValueError(f"position {position} outside epoch {epoch} ({steps} batches)")
    step = epoch * steps + position
    if "grain" in state and int(state["grain"]["next_index"]) != step:
      raise ValueError(f"iterator state {state}: Grain's next index is not epoch x {steps} + position")
    self.close()
    self._step = step
    self._reset_epoch_stats()

  @property
  def stats(self) -> dict:
    """Truncation counts: dataset-wide, and this process's current epoch so far."""
    return {**self._dataset_stats, **self._epoch_stats}

  def _reset_epoch_stats(self):
    self._epoch_stats = {"epoch": self._step // max(self.steps_per_epoch(), 1), "epoch_examples": 0,
                         "epoch_rows_truncated": 0, "epoch_nnz_dropped": 0,
                         "epoch_label_sets_truncated": 0}


def _grain_flags_parsed() -> None:
  """Grain's worker processes read absl flags; outside an absl app (a notebook, pytest) they are
  not parsed yet, and their defaults are what a library caller wants."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


class DenseBatcher(SparseBatcher):
  """SparseBatcher's examples, order, process slicing and resumable state, with dense rows.

  For towers over dense vectors (`models.towers.MLPTower`: image or text
  embeddings). Yields the same dicts as SparseBatcher with the two padded
  sparse arrays replaced by
    features   float32 (n, d)        the example's feature row, 0.0 for padding rows
  (`DENSE_BATCH_KEYS`). Nothing is truncated (`max_nnz` is d, every row's width;
  the max_nnz / nnz_percentile arguments are ignored); label sets are padded and
  truncated as in SparseBatcher. Batch b of epoch e holds the same examples in the
  same rows as SparseBatcher's on the same labels, seed and conversion.

  features: a dense (N, d) array, kept without a copy if it is C-ordered float32,
  or a sparse (N, d) matrix, densified once; or dense `ShardedRows`.
  """

  _dense = True

  def _choose_max_nnz(self, nnz_hist, max_nnz, nnz_percentile, pad_multiple) -> int:
    del nnz_hist, max_nnz, nnz_percentile, pad_multiple  # every row is d wide
    return self.rows.num_features

  def _features(self, block: records.RowBlock, n: int):
    x = np.zeros((n, self.rows.num_features), np.float32)
    x[:block.dense.shape[0]] = block.dense
    none = np.zeros(block.dense.shape[0], bool)
    return {"features": x}, none, np.zeros(block.dense.shape[0], np.int64)

  def example_inputs(self) -> tuple[np.ndarray, ...]:
    """(features (1, d) float32,) of zeros: the tower's inputs of one row."""
    return (np.zeros((1, self.rows.num_features), np.float32),)


# ------------------------------------------------------------------ devices

def _data_axes(data_axis) -> tuple[str, ...]:
  return (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)


def process_data_slice(mesh: jax.sharding.Mesh, data_axis="data") -> tuple[int, int]:
  """(index, count) of this process's block of the global batch under `mesh`.

  Pass them as the batcher's process_index / process_count. They equal
  (jax.process_index(), jax.process_count()) for the usual meshes whose data
  axis is laid out process by process; processes that replicate the same
  rows (model axis across hosts) get the same index.

  Raises:
    ValueError: if this process's rows are not one contiguous aligned block.
  """
  axes = _data_axes(data_axis)
  pos = [mesh.axis_names.index(a) for a in axes]
  sizes = [mesh.devices.shape[i] for i in pos]
  me = jax.process_index()
  mine = sorted({int(np.ravel_multi_index([idx[i] for i in pos], sizes))
                 for idx in np.ndindex(mesh.devices.shape)
                 if mesh.devices[idx].process_index == me})
  block, total = len(mine), int(np.prod(sizes))
  if not mine or mine != list(range(mine[0], mine[0] + block)) or mine[0] % block \
      or total % block:
    raise ValueError(f"process {me} holds data shards {mine} of {total}: not one aligned "
                     "contiguous block; reorder the mesh devices")
  return mine[0] // block, total // block


def make_global_batch(local_batch: dict, mesh: jax.sharding.Mesh, data_axis="data") -> dict:
  """Assembles per-process slices into global `jax.Array`s sharded as P(data_axis).

  Every array's leading dimension is split over `data_axis` (a mesh axis name
  or a tuple of them); the global leading size is local size * (data shards /
  data shards on this process).
  """
  sharding = jax.NamedSharding(mesh, jax.P(_data_axes(data_axis)))
  if jax.process_count() == 1:  # every row is local: one batched transfer (~0.6 ms less per step)
    return jax.device_put({k: np.asarray(v) for k, v in local_batch.items()}, sharding)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in local_batch.items()}



def make_stacked_global_batch(local_batches: list[dict], mesh: jax.sharding.Mesh, global_batch_size: int,
                              data_axis="data") -> dict:
  """Several runs' per-process batches (a candidate group's members, `snm_jax.train.trainer.group`)
  stacked on a leading member axis: global arrays (M, global_batch_size, ...) sharded as
  P(None, data_axis), each member's rows as `make_global_batch` would place them."""
  sharding = jax.NamedSharding(mesh, jax.P(None, _data_axes(data_axis)))
  stacked = {k: np.stack([np.asarray(b[k]) for b in local_batches]) for k in local_batches[0]}
  if jax.process_count() == 1:  # every row is local: one batched transfer of all the arrays
    return jax.device_put(stacked, sharding)
  return {k: jax.make_array_from_process_local_data(sharding, v, (v.shape[0], global_batch_size, *v.shape[2:]))
          for k, v in stacked.items()}
