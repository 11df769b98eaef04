"""Writes a dataset the library reads into ArrayRecord shards (`snm_jax.data.shards`), in chunks.

Two sources:
  * `convert_named`: a dataset the loader finds by name (XC text, the bundled Bibtex), loaded
    in memory as a run would load it (row normalisation, the validation carve of
    `dataset.validation_fraction` / `validation_seed`), then written chunk by chunk. Its
    shards give a run the same rows, in the same order, as the in-memory path.
  * `convert_synthetic`: `synthetic.sparse_row_chunks` of any size, generated and written one
    chunk at a time (memory: one chunk, plus the K label counts).
The statistics a run needs from the whole training set (label counts, row nnz and label-set
histograms) are accumulated while writing, never by re-reading.
"""
from __future__ import annotations

import dataclasses

from absl import logging
import numpy as np

from snm_jax.data import datasets, preprocess, shards, splits, synthetic


def _write(out_dir, name, parts: dict, num_features: int, num_labels: int, *, dense: bool,
           normalize_rows: bool, validation_fraction: float, validation_seed: int,
           train_file_points: int, num_shards: int) -> shards.Metadata:
  """parts: split -> (chunks iterable, num_rows). Training-side splits drop unlabeled rows."""
  counts = np.zeros(num_labels, np.int64)
  infos = {}
  for split, (chunks, num_rows) in parts.items():
    training = split in ("train", "validation")
    infos[split] = shards.write_split(out_dir, split, chunks, num_rows, num_shards,
                                      drop_unlabeled=training,
                                      label_counts=counts if training else None)
    logging.info("converted %s/%s: %d rows into %d shards (%d unlabeled dropped)", name, split,
                 infos[split].num_rows, len(infos[split].files), infos[split].unlabeled_rows_dropped)
  meta = shards.Metadata(name=name, num_features=num_features, num_labels=num_labels, dense=dense,
                         normalize_rows=normalize_rows, validation_fraction=validation_fraction,
                         validation_seed=validation_seed, train_file_points=train_file_points,
                         splits=infos)
  shards.write_metadata(out_dir, meta, counts)
  return meta


def convert_named(name: str, out_dir, *, data_dir=None, normalize_rows: bool = True,
                  validation_fraction: float = 0.0, validation_seed: int = 0, num_shards: int = 4,
                  chunk_rows: int = 65_536) -> shards.Metadata:
  """Writes dataset `name`'s train (and its validation carve) and test splits to `out_dir`.

  The label counts stored for the training file are those of every labeled row of the whole
  training file (train + validation), as `RunData.label_counts` counts them in memory.
  """
  train = datasets.load_dataset(name, "train", data_dir=data_dir)
  test = splits.check_split_compatible(train, datasets.load_dataset(name, "test", data_dir=data_dir))
  if normalize_rows:
    train = dataclasses.replace(train, features=preprocess.l2_normalize_rows(train.features))
    test = dataclasses.replace(test, features=preprocess.l2_normalize_rows(test.features))
  train_file_points = train.num_points
  parts_data = {"train": train}
  if validation_fraction:
    parts_data["train"], parts_data["validation"] = splits.split_validation(
        train, validation_fraction, validation_seed)
  parts_data["test"] = test
  parts = {s: (shards.chunks_of(ds.features, ds.labels, chunk_rows), ds.num_points)
           for s, ds in parts_data.items()}
  return _write(out_dir, name, parts, train.features.shape[1], train.labels.shape[1],
                dense=not hasattr(train.features, "indptr"), normalize_rows=normalize_rows,
                validation_fraction=validation_fraction, validation_seed=validation_seed,
                train_file_points=train_file_points, num_shards=num_shards)


def convert_synthetic(out_dir, *, num_rows: int, num_test_rows: int, num_features: int,
                      num_labels: int, nnz: int = 64, labels_per_row: int = 3, seed: int = 0,
                      num_shards: int = 8, chunk_rows: int = 65_536) -> shards.Metadata:
  """Writes `synthetic.sparse_row_chunks` train and test splits (name "synthetic_sparse"; the
  rows are written L2-normalised, as `dataset.normalize_rows` would make them)."""
  gen = dict(num_features=num_features, num_labels=num_labels, nnz=nnz,
             labels_per_row=labels_per_row, chunk_rows=chunk_rows)

  def normalized(chunks):
    for features, labels in chunks:
      yield preprocess.l2_normalize_rows(features), labels

  parts = {"train": (normalized(synthetic.sparse_row_chunks(num_rows, seed=2 * seed, **gen)), num_rows),
           "test": (normalized(synthetic.sparse_row_chunks(num_test_rows, seed=2 * seed + 1, **gen)),
                    num_test_rows)}
  return _write(out_dir, "synthetic_sparse", parts, num_features, num_labels, dense=False,
                normalize_rows=True, validation_fraction=0.0, validation_seed=0,
                train_file_points=num_rows, num_shards=num_shards)
