"""The data of a run, from `config.dataset`: a real dataset found by name (Bibtex
is bundled), the synthetic generator (with its Bayes-optimal predictor), the
head/tail downsampled digits of the S2M paper, or feature and label files named
one by one (`dataset.name="files"`: dense `.npy` / `.npz` embeddings, sparse
`.npz`, XC text); optionally a validation part carved from the training set."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import scipy.sparse as sp

from snm_jax import data as snm_data
from snm_jax.data import array_files, shards
from snm_jax.data.pipeline import ShardedRows
from snm_jax.errors import ConfigError, DataFormatError, DatasetNotFoundError
from snm_jax.train.config.overrides import json_without


@dataclasses.dataclass
class RunData:
  """The splits of a run.

  Attributes:
    train: the training part, features (N_tr, d) and labels (N_tr, K); without
      a validation split, the whole training file. Features are CSR, or a dense
      float32 array for dense files (`dataset.name="files"`), in every split.
      With `dataset.format="sharded"` the training split is not loaded: a
      `ShardedRows` the input pipeline reads by index (the other splits are in memory).
    test: the test split (N_te, d) / (N_te, K), never subsampled or split.
    source: what was loaded (e.g. "bibtex", "synthetic").
    synthetic: the generator's data (raw features, Bayes predictor) for
      `dataset.name=synthetic`, else None.
    validation: the held-out part of the training file, (N_va, d) / (N_va, K),
      when `dataset.validation_fraction > 0`, else None.
    train_file_label_counts: int64 (K,), positives per label in the WHOLE
      training file (train + validation); filled from `train` if not given.
    train_file_points: N_tr + N_va, points of the whole training file.
  """
  train: snm_data.XCDataset
  test: snm_data.XCDataset
  source: str
  synthetic: snm_data.SyntheticData | None = None
  validation: snm_data.XCDataset | None = None
  train_file_label_counts: np.ndarray | None = None
  train_file_points: int | None = None

  def __post_init__(self):
    if self.train_file_label_counts is None:
      self.train_file_label_counts = _label_counts(self.train.labels)
    if self.train_file_points is None:
      self.train_file_points = self.train.num_points

  @property
  def sharded(self) -> bool:
    return isinstance(self.train, ShardedRows)

  @property
  def num_features(self) -> int:
    return self.train.num_features if self.sharded else self.train.features.shape[1]

  @property
  def num_labels(self) -> int:
    return self.train.num_labels if self.sharded else self.train.labels.shape[1]

  @property
  def label_counts(self) -> np.ndarray:
    """int64 (K,): label counts of the WHOLE training file (train + validation).

    Not of `train` alone: propensity-scored metrics (PSP@k, with N =
    `train_file_points`) and the Head/Torso/Tail masks must be identical for
    every method, with or without a validation split, and for external tools
    trained on the full file.
    """
    return self.train_file_label_counts


def _label_counts(labels: sp.csr_matrix) -> np.ndarray:
  return np.asarray(labels.getnnz(axis=0), np.int64)


def _synthetic(config) -> RunData:
  s = config.dataset.synthetic
  cfg = snm_data.SyntheticConfig(num_labels=s.num_labels, dim=s.dim,
                                 num_coarse=max(2, min(64, s.num_labels // 64)),
                                 num_fine_per_coarse=8)
  syn = snm_data.make_synthetic(cfg, s.num_train, s.num_test, seed=s.seed)
  return RunData(syn.train, syn.test, "synthetic", synthetic=syn)


def _digits(config) -> RunData:
  d = snm_data.digits_head_tail(seed=config.dataset.synthetic.seed)

  def as_ds(x, y, split):
    n = len(y)
    labels = sp.csr_matrix((np.ones(n, np.float32), y.astype(np.int32), np.arange(n + 1)),
                           shape=(n, 10))
    return snm_data.XCDataset(sp.csr_matrix(x), labels, "digits_head_tail", split)

  return RunData(as_ds(d.x_train, d.y_train, "train"), as_ds(d.x_test, d.y_test, "test"),
                 "digits_head_tail")


def _files(config) -> RunData:
  f = config.dataset.files
  train, test = array_files.load_files(f.train_features, f.train_labels, f.test_features,
                                       f.test_labels)
  return RunData(train, test, "files")


def _named(config) -> RunData:
  name = config.dataset.name
  data_dir = config.dataset.data_dir or None
  try:
    train = snm_data.load_dataset(name, "train", data_dir=data_dir)
    test = snm_data.load_dataset(name, "test", data_dir=data_dir)
  except DatasetNotFoundError as e:
    raise ConfigError("dataset.name", f"{e} (use dataset.name=synthetic for synthetic "
                      "data)") from None
  return RunData(train, snm_data.check_split_compatible(train, test), name)


def _carve_validation(out: RunData, fraction, seed) -> None:
  """Replaces out.train by its train part and sets out.validation (in place)."""
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
    raise ConfigError("dataset.validation_seed", f"must be an integer, got {seed!r}")
  try:
    snm_data.validation_size(out.train.num_points, fraction)
  except ValueError as e:
    raise ConfigError("dataset.validation_fraction", str(e)) from None
  if fraction == 0:
    return
  out.train, validation = snm_data.split_validation(out.train, fraction, seed)
  out.validation = snm_data.check_split_compatible(out.train, validation)


def _sharded(config) -> RunData:
  """The converted dataset at `dataset.shards` (`experiments.convert`): its training split read by
  index while training, its test and validation splits in memory; checked against the config."""
  d = config.dataset
  try:
    meta = shards.read_metadata(d.shards)
  except DataFormatError as e:
    raise ConfigError("dataset.shards", str(e)) from None
  for field, want in (("name", meta.name), ("normalize_rows", meta.normalize_rows),
                      ("validation_fraction", meta.validation_fraction)):
    if d.get(field) != want:
      raise ConfigError(f"dataset.{field}", f"{d.get(field)!r}, but the shards in {d.shards} were "
                        f"written with {want!r} (`experiments.convert` records the name, the row "
                        "normalisation and the validation carve); convert again or set it to match")
  if meta.validation_fraction and d.validation_seed != meta.validation_seed:
    raise ConfigError("dataset.validation_seed", f"{d.validation_seed}, but the shards' validation "
                      f"split was carved with seed {meta.validation_seed}")

  def in_memory(split):
    features, labels = shards.read_split(d.shards, split, meta=meta)
    return snm_data.XCDataset(features, labels, meta.name, split, path=None)

  return RunData(ShardedRows(d.shards, "train", meta), in_memory("test"), meta.name,
                 validation=in_memory("validation") if meta.validation_fraction else None,
                 train_file_label_counts=shards.read_label_counts(d.shards),
                 train_file_points=meta.train_file_points)


def load_run_data(config) -> RunData:
  """Loads the splits named by `config.dataset` (`_load`), or returns the ones loaded for an equal
  `config.dataset` in this process (a recipe's candidates, splits and ensembles read the same data
  many times; the arrays are never modified after loading)."""
  files = ()
  if config.dataset.name == "files":  # the files' identity too: a file rewritten in place is re-read
    files = tuple((f, os.stat(f).st_mtime_ns, os.stat(f).st_size) if f and os.path.exists(f) else (f,)
                  for f in (config.dataset.files[k] for k in sorted(config.dataset.files.keys())))
  return _kept(_LOADED, (json_without(config.dataset, BATCHING_FIELDS), files), lambda: _load(config, files))


# Fields of `config.dataset` that shape only the batches (`SparseBatcher`), not the data loaded:
# left out of the keys of the data kept (a recipe's members differ in them: conversions, widths).
BATCHING_FIELDS = ("conversion", "max_nnz", "max_labels", "read_threads", "prefetch", "workers")


# The RunData of the last few `config.dataset`s this process loaded, and (`_UNCARVED`) their reads
# before the validation carve (dicts, not functools.lru_cache: the keys are the section's JSON, the
# ConfigDict itself is not hashable).
_LOADED: dict = {}
_UNCARVED: dict = {}
_MAX_LOADED = 8


def _kept(cache: dict, key, make):
  """cache[key], made by `make()` on a miss; the oldest entry goes beyond _MAX_LOADED."""
  if key not in cache:
    if len(cache) >= _MAX_LOADED:
      cache.pop(next(iter(cache)))
    cache[key] = make()
  return cache[key]


def _load(config, files: tuple = ()) -> RunData:
  """Loads the splits named by `config.dataset` (`files`: the identity of the files read, part of
  the key of the read kept for other validation carves).

  Raises:
    ConfigError: `dataset.name` not found (the message lists every place
      searched), or a bad `dataset.validation_fraction` / `validation_seed`.
    DataFormatError: a malformed file, or a test split whose K differs from
      the training K or whose feature ids reach beyond the training d (for
      `dataset.name="files"`: whose d differs), naming the file.
  """
  if config.dataset.get("format", "memory") == "sharded":
    return _sharded(config)  # normalised and carved when it was written
  # The whole training file as read (and normalised) once per dataset section less its validation
  # carve: a recipe's validation splits carve the same rows (Bibtex: 0.35 s of XC parsing a split).
  whole = _kept(_UNCARVED, (json_without(config.dataset, ("validation_fraction", "validation_seed",
                                                         *BATCHING_FIELDS)), files),
                lambda: _read(config))
  out = dataclasses.replace(whole)
  _carve_validation(out, config.dataset.get("validation_fraction", 0.0),
                    config.dataset.get("validation_seed", 0))
  return out


def _read(config) -> RunData:
  """Every split of an in-memory dataset, normalised, before the validation carve."""
  name = config.dataset.name
  if name == "synthetic":
    out = _synthetic(config)
  elif name == "digits_head_tail":
    out = _digits(config)
  elif name == "files":
    out = _files(config)
  else:
    out = _named(config)
  if config.dataset.normalize_rows:
    # New dataset objects: the synthetic generator's Bayes predictor needs the raw features.
    out.train = dataclasses.replace(out.train, features=snm_data.l2_normalize_rows(out.train.features))
    out.test = dataclasses.replace(out.test, features=snm_data.l2_normalize_rows(out.test.features))
  return out  # carved after normalisation (per row: the order does not matter)
