"""Input pipeline: fixed-shape batches (padded sparse rows, or dense rows), per-process
slices, device prefetch.

Each global batch b of epoch e is the slice [b*G, (b+1)*G) of a permutation of
the epoch's examples, drawn from `default_rng([seed, epoch])`; process p of P
builds only rows [p*G/P, (p+1)*G/P) of it, so the concatenation over processes
does not depend on P. `make_global_batch` turns the per-process slices into
one `jax.Array` sharded over the mesh's data axis.
"""
from __future__ import annotations

import functools
import math
import queue
import threading
from typing import Callable, Iterator

import jax
import numpy as np
import scipy.sparse as sp
from absl import logging

from snm_jax.data import conversions

Examples = tuple[np.ndarray, np.ndarray]
BATCH_KEYS = ("feat_ids", "feat_vals", "label", "label_set", "valid", "example_id")
DENSE_BATCH_KEYS = ("features", "label", "label_set", "valid", "example_id")


def choose_max_nnz(row_nnz: np.ndarray, percentile: float = 100.0, multiple_of: int = 8) -> int:
  """Smallest multiple of `multiple_of` >= the `percentile`-th percentile of row nnz (>= 1)."""
  if row_nnz.size == 0:
    return multiple_of
  v = math.ceil(float(np.percentile(row_nnz, percentile, method="higher")))
  return max(1, -(-v // multiple_of) * multiple_of)


def truncate_rows(m: sp.csr_matrix, max_nnz: int, by_magnitude: bool = True) -> sp.csr_matrix:
  """Keeps at most `max_nnz` entries per row, in their stored order.

  Keeps the largest-|value| entries (ties: earlier stored entry) if
  `by_magnitude`, else the first `max_nnz` stored entries. Returns `m`
  itself if no row is too long.
  """
  lens = np.diff(m.indptr)
  if lens.max(initial=0) <= max_nnz:
    return m
  row = np.repeat(np.arange(m.shape[0]), lens)
  if by_magnitude:
    # Rank within row by decreasing |value|, stable on position.
    order = np.lexsort((np.arange(m.nnz), -np.abs(m.data), row))
  else:
    order = np.arange(m.nnz)
  rank = np.empty(m.nnz, np.int64)
  rank[order] = np.arange(m.nnz) - m.indptr[row[order]]
  keep = rank < max_nnz
  new_indptr = np.concatenate([[0], np.cumsum(np.minimum(lens, max_nnz))])
  return sp.csr_matrix((m.data[keep], m.indices[keep], new_indptr), shape=m.shape)


def _gather_padded(m: sp.csr_matrix, rows: np.ndarray, n: int, width: int, pad_id: int,
                   with_values: bool):
  """Rows of CSR `m` (<= width entries each) as (n, width) id / value arrays."""
  ids = np.full((n, width), pad_id, np.int32)
  vals = np.zeros((n, width), np.float32) if with_values else None
  starts = m.indptr[rows]
  lens = m.indptr[rows + 1] - starts
  mask = np.arange(width)[None, :] < lens[:, None]
  pos = (starts[:, None] + np.arange(width)[None, :])[mask]
  ids[:rows.size][mask] = m.indices[pos]
  if with_values:
    vals[:rows.size][mask] = m.data[pos]
  return ids, vals


class SparseBatcher:
  """Deterministic, resumable iterator over fixed-shape padded batches.

  Yields dicts of numpy arrays for THIS process's slice (n = G / P rows):
    feat_ids   int32 (n, max_nnz)    feature ids, padded with 0
    feat_vals  float32 (n, max_nnz)  feature values, padded with 0.0
    label      int32 (n,)            the example's positive (0 for padding,
                                     -1 everywhere if `examples=None`)
    label_set  int32 (n, max_labels) the point's full label set, padded -1
    valid      bool (n,)             False for padding rows of the last batch
    example_id int32 (n,)            feature row (data point) index, -1 padding

  Rows with more than `max_nnz` features keep their largest-|value| entries;
  label sets longer than `max_labels` keep their first stored ids. Both are
  counted in `stats` and logged once per epoch.
  """

  def __init__(self, features: sp.spmatrix, labels: sp.spmatrix,
               examples: Examples | Callable[[int], Examples] | str | None, *,
               global_batch_size: int, max_nnz: int | str = "auto",
               max_labels: int | str = "auto", seed: int = 0,
               process_index: int | None = None, process_count: int | None = None,
               shuffle: bool = True, drop_remainder: bool = False,
               num_epochs: int | None = None, nnz_percentile: float = 100.0,
               pad_multiple: int = 8, log_epochs: bool = True):
    """Builds the batcher (the data is held in memory; each process keeps it all).

    Args:
      features: CSR (N, d).
      labels: CSR (N, K), full label sets (stored order kept).
      examples: `(example_index (M,), label (M,))` from a conversion (fixed
        for all epochs), a callable `epoch -> (example_index, label)`, a
        conversion name from `conversions.CONVERSIONS` (seeded with `seed`;
        "sample_one_positive" is re-drawn every epoch), or None for every
        row once with label -1 (evaluation).
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
    """
    self._set_features(features)
    self.labels = sp.csr_matrix(labels)
    if self.features.shape[0] != self.labels.shape[0]:
      raise ValueError(f"features have {self.features.shape[0]} rows, labels "
                       f"{self.labels.shape[0]}")
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

    self._eval_mode = examples is None
    if examples is None:
      n = self.features.shape[0]
      fixed = (np.arange(n, dtype=np.int32), np.full(n, -1, np.int32))
      self._examples_fn = lambda epoch: fixed
    elif isinstance(examples, str):
      self._examples_fn = conversions.conversion_fn(examples, self.labels, seed)
    elif callable(examples):
      self._examples_fn = examples
    else:
      fixed = (np.asarray(examples[0], np.int32), np.asarray(examples[1], np.int32))
      if fixed[0].shape != fixed[1].shape:
        raise ValueError("example_index and label must have the same shape")
      self._examples_fn = lambda epoch: fixed

    self._row_labels = np.diff(self.labels.indptr)
    self._set_max_nnz(max_nnz, nnz_percentile, pad_multiple)
    self.max_labels = (choose_max_nnz(self._row_labels, 100.0, pad_multiple)
                       if max_labels == "auto" else int(max_labels))
    if self.max_nnz < 1 or self.max_labels < 1:
      raise ValueError("max_nnz and max_labels must be >= 1")
    self._labs = truncate_rows(self.labels, self.max_labels, by_magnitude=False)

    over = self._row_nnz > self.max_nnz
    over_l = self._row_labels > self.max_labels
    self._dataset_stats = {
        "max_nnz": self.max_nnz,
        "max_labels": self.max_labels,
        "dataset_rows": int(self.features.shape[0]),
        "dataset_rows_truncated": int(over.sum()),
        "dataset_nnz_dropped": int((self._row_nnz - self.max_nnz)[over].sum()),
        "dataset_nnz": int(self._row_nnz.sum()),
        "dataset_label_sets_truncated": int(over_l.sum()),
        "dataset_labels_dropped": int((self._row_labels - self.max_labels)[over_l].sum()),
    }
    log = logging.warning if over.any() or over_l.any() else logging.info
    log("%s: max_nnz=%d truncates %d of %d rows (%d of %d feature entries "
        "dropped); max_labels=%d truncates %d label sets (%d labels dropped).",
        type(self).__name__, self.max_nnz, self._dataset_stats["dataset_rows_truncated"],
        self._dataset_stats["dataset_rows"], self._dataset_stats["dataset_nnz_dropped"],
        self._dataset_stats["dataset_nnz"], self.max_labels,
        self._dataset_stats["dataset_label_sets_truncated"],
        self._dataset_stats["dataset_labels_dropped"])

    self._epoch, self._position = 0, 0
    self._cache_epoch, self._cache = None, None
    self._reset_epoch_stats()

  # ----------------------------------------------------------------- features
  # The feature layout's three hooks (DenseBatcher overrides them).
  def _set_features(self, features) -> None:
    """Sets self.features, (N, d)."""
    self.features = sp.csr_matrix(features, dtype=np.float32)

  def _set_max_nnz(self, max_nnz, nnz_percentile: float, pad_multiple: int) -> None:
    """Sets self._row_nnz (N,), self.max_nnz and the rows truncated to it."""
    self._row_nnz = np.diff(self.features.indptr)
    self.max_nnz = (choose_max_nnz(self._row_nnz, nnz_percentile, pad_multiple)
                    if max_nnz == "auto" else int(max_nnz))
    if self.max_nnz < 1:
      raise ValueError("max_nnz and max_labels must be >= 1")
    self._feat = truncate_rows(self.features, self.max_nnz, by_magnitude=True)

  def _gather_features(self, rows: np.ndarray, n: int) -> dict:
    """The feature arrays of `rows`, padded to n rows."""
    feat_ids, feat_vals = _gather_padded(self._feat, rows, n, self.max_nnz, 0, True)
    return {"feat_ids": feat_ids, "feat_vals": feat_vals}

  def example_inputs(self) -> tuple[np.ndarray, ...]:
    """Zero tower inputs of one row, shaped and typed as `towers.tower_inputs` of a batch
    (what `tower.init` needs): (feat_ids (1, max_nnz) int32, feat_vals (1, max_nnz) float32)."""
    return (np.zeros((1, self.max_nnz), np.int32), np.zeros((1, self.max_nnz), np.float32))

  # ----------------------------------------------------------------- state
  def get_state(self) -> dict:
    """JSON-able position of the next batch: {"epoch", "position", "seed", "global_batch_size"}."""
    return {"epoch": self._epoch, "position": self._position, "seed": self.seed,
            "global_batch_size": self.global_batch_size}

  def set_state(self, state: dict) -> None:
    """Resumes exactly at a state from `get_state` (any process_count)."""
    for key in ("seed", "global_batch_size"):
      if key in state and state[key] != getattr(self, key):
        raise ValueError(f"iterator state has {key}={state[key]}, this batcher "
                         f"{getattr(self, key)}; cannot resume the same sequence")
    epoch, position = int(state["epoch"]), int(state["position"])
    if not 0 <= position <= self.steps_per_epoch(epoch):
      raise ValueError(f"position {position} outside epoch {epoch} "
                       f"({self.steps_per_epoch(epoch)} batches)")
    self._epoch, self._position = epoch, position
    self._reset_epoch_stats()

  @property
  def stats(self) -> dict:
    """Truncation counts: dataset-wide, and this process's current epoch so far."""
    return {**self._dataset_stats, **self._epoch_stats}

  def _reset_epoch_stats(self):
    self._epoch_stats = {"epoch": self._epoch, "epoch_examples": 0,
                         "epoch_rows_truncated": 0, "epoch_nnz_dropped": 0,
                         "epoch_label_sets_truncated": 0}

  # ----------------------------------------------------------------- epochs
  def _epoch_data(self, epoch: int):
    if self._cache_epoch != epoch:
      ex_idx, ex_lab = self._examples_fn(epoch)
      ex_idx = np.asarray(ex_idx, np.int64)
      if ex_idx.size and (ex_idx.min() < 0 or ex_idx.max() >= self.features.shape[0]):
        raise ValueError("example_index out of range of the feature rows")
      m = ex_idx.size
      perm = (np.random.default_rng([self.seed, epoch]).permutation(m) if self.shuffle
              else np.arange(m))
      self._cache_epoch, self._cache = epoch, (ex_idx, np.asarray(ex_lab, np.int32), perm)
    return self._cache

  def steps_per_epoch(self, epoch: int = 0) -> int:
    m = self._epoch_data(epoch)[0].size
    g = self.global_batch_size
    return m // g if self.drop_remainder else -(-m // g)

  def batch_at(self, epoch: int, position: int) -> dict:
    """This process's slice of global batch `position` of `epoch` (no state change)."""
    ex_idx, ex_lab, perm = self._epoch_data(epoch)
    n = self.local_batch_size
    lo = position * self.global_batch_size + self.process_index * n
    sel = perm[lo:min(lo + n, perm.size)]
    rows = ex_idx[sel]
    k = rows.size
    features = self._gather_features(rows, n)
    label_set, _ = _gather_padded(self._labs, rows, n, self.max_labels, -1, False)
    label = np.zeros(n, np.int32)
    label[:k] = ex_lab[sel]
    if self._eval_mode:
      label[:] = -1
    valid = np.zeros(n, bool)
    valid[:k] = True
    example_id = np.full(n, -1, np.int32)
    example_id[:k] = rows
    return {**features, "label": label, "label_set": label_set, "valid": valid,
            "example_id": example_id}

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    if self.num_epochs is not None and self._epoch >= self.num_epochs:
      raise StopIteration
    steps = self.steps_per_epoch(self._epoch)
    if steps == 0:
      m = self._epoch_data(self._epoch)[0].size
      raise ValueError(f"epoch {self._epoch} has {m} examples: fewer than one global batch "
                       f"({self.global_batch_size}) with drop_remainder, or none at all")
    batch = self.batch_at(self._epoch, self._position)
    rows = batch["example_id"][batch["valid"]]
    over = self._row_nnz[rows] > self.max_nnz
    st = self._epoch_stats
    st["epoch_examples"] += int(rows.size)
    st["epoch_rows_truncated"] += int(over.sum())
    st["epoch_nnz_dropped"] += int((self._row_nnz[rows] - self.max_nnz)[over].sum())
    st["epoch_label_sets_truncated"] += int((self._row_labels[rows] > self.max_labels).sum())
    self._position += 1
    if self._position == steps:
      if self.log_epochs:
        # Every epoch at debug verbosity (-v 1), a warning when it truncated something.
        truncated = st["epoch_rows_truncated"] or st["epoch_label_sets_truncated"]
        log = logging.warning if truncated else functools.partial(logging.vlog, 1)
        log("epoch %d (process %d/%d): %d examples; %d truncated to max_nnz=%d "
            "(%d feature entries dropped); %d label sets truncated to max_labels=%d.",
            self._epoch, self.process_index, self.process_count, st["epoch_examples"],
            st["epoch_rows_truncated"], self.max_nnz, st["epoch_nnz_dropped"],
            st["epoch_label_sets_truncated"], self.max_labels)
      self._epoch, self._position = self._epoch + 1, 0
      self._reset_epoch_stats()
    return batch


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
  or a sparse (N, d) matrix, densified once.
  """

  def _set_features(self, features) -> None:
    if sp.issparse(features):
      features = features.toarray()
    self.features = np.ascontiguousarray(features, dtype=np.float32)
    if self.features.ndim != 2:
      raise ValueError(f"features must be a 2-D (N, d) array, got shape {self.features.shape}")

  def _set_max_nnz(self, max_nnz, nnz_percentile: float, pad_multiple: int) -> None:
    del max_nnz, nnz_percentile, pad_multiple  # every row is d wide: nothing to choose or truncate
    n, d = self.features.shape
    self._row_nnz = np.full(n, d, np.int64)
    self.max_nnz = d

  def _gather_features(self, rows: np.ndarray, n: int) -> dict:
    x = np.zeros((n, self.features.shape[1]), np.float32)
    x[:rows.size] = self.features[rows]
    return {"features": x}

  def example_inputs(self) -> tuple[np.ndarray, ...]:
    """(features (1, d) float32,) of zeros: the tower's inputs of one row."""
    return (np.zeros((1, self.features.shape[1]), np.float32),)


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

class DevicePrefetcher:
  """Iterator moving batches to devices in a background thread, `size` ahead.

  `get_state()` returns the wrapped iterator's state as of the last batch
  handed out (not the prefetched ones), so checkpoints resume exactly.
  """

  _END = object()

  def __init__(self, iterator, size: int = 2, mesh=None, data_axis="data"):
    self._it = iterator
    self._mesh, self._data_axis = mesh, data_axis
    self._has_state = hasattr(iterator, "get_state")
    self._state = iterator.get_state() if self._has_state else None
    self._queue: queue.Queue = queue.Queue(maxsize=max(1, size))
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True, name="DevicePrefetcher")
    self._thread.start()

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _run(self):
    try:
      for batch in self._it:
        if self._mesh is not None:
          batch = make_global_batch(batch, self._mesh, self._data_axis)
        else:
          batch = jax.device_put(batch)
        state = self._it.get_state() if self._has_state else None
        if not self._put((batch, state, None)):
          return
      self._put((self._END, None, None))
    except BaseException as e:  # Re-raised in the consumer thread.
      self._put((None, None, e))

  def __iter__(self):
    return self

  def __next__(self):
    if self._thread is None:
      raise StopIteration
    batch, state, err = self._queue.get()
    if err is not None:
      self.close()
      raise err
    if batch is self._END:
      self.close()
      raise StopIteration
    self._state = state
    return batch

  def get_state(self) -> dict | None:
    return self._state

  def close(self):
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def prefetch_to_device(iterator, size: int = 2, mesh=None, data_axis="data") -> DevicePrefetcher:
  """Wraps `iterator` (e.g. a SparseBatcher) so batches are on device `size` steps ahead.

  With `mesh`, batches are assembled by `make_global_batch`; without, they
  are `jax.device_put` on the default device.
  """
  return DevicePrefetcher(iterator, size=size, mesh=mesh, data_axis=data_axis)
