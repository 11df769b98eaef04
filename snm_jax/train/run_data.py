"""The data of a run, from `config.dataset`: a bundled/cached real dataset, the
synthetic generator (with its Bayes-optimal predictor), or the head/tail
downsampled digits of the S2M paper."""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp
from absl import logging

from snm_jax import data as snm_data
from snm_jax.errors import ConfigError, DatasetNotFoundError


@dataclasses.dataclass
class RunData:
  train: snm_data.XCDataset
  test: snm_data.XCDataset
  source: str                      # what was actually loaded (e.g. "bibtex", "synthetic (fallback)")
  synthetic: snm_data.SyntheticData | None = None

  @property
  def num_features(self) -> int:
    return self.train.features.shape[1]

  @property
  def num_labels(self) -> int:
    return self.train.labels.shape[1]

  @property
  def label_counts(self) -> np.ndarray:
    return np.asarray(self.train.labels.getnnz(axis=0), np.int64)


def _synthetic(config, note: str) -> RunData:
  s = config.dataset.synthetic
  cfg = snm_data.SyntheticConfig(num_labels=s.num_labels, dim=s.dim,
                                 num_coarse=max(2, min(64, s.num_labels // 64)),
                                 num_fine_per_coarse=8)
  syn = snm_data.make_synthetic(cfg, s.num_train, s.num_test, seed=s.seed)
  return RunData(syn.train, syn.test, note, synthetic=syn)


def _digits(config) -> RunData:
  d = snm_data.digits_head_tail(seed=config.dataset.synthetic.seed)

  def as_ds(x, y, split):
    n = len(y)
    labels = sp.csr_matrix((np.ones(n, np.float32), y.astype(np.int32), np.arange(n + 1)),
                           shape=(n, 10))
    return snm_data.XCDataset(sp.csr_matrix(x), labels, "digits_head_tail", split)

  return RunData(as_ds(d.x_train, d.y_train, "train"), as_ds(d.x_test, d.y_test, "test"),
                 "digits_head_tail")


def load_run_data(config) -> RunData:
  name = config.dataset.name
  if name == "synthetic":
    out = _synthetic(config, "synthetic")
  elif name == "digits_head_tail":
    out = _digits(config)
  else:
    data_dir = config.dataset.data_dir or None
    try:
      train = snm_data.load_dataset(name, "train", data_dir=data_dir)
      test = snm_data.load_dataset(name, "test", data_dir=data_dir)
      out = RunData(train, test, name)
    except DatasetNotFoundError as e:
      if not config.dataset.fallback_to_synthetic:
        raise ConfigError("dataset.name", str(e)) from None
      logging.warning("NOTICE: dataset %r not found (%s); training on SYNTHETIC data instead", name, e)
      print(f"NOTICE: dataset {name!r} not found; falling back to synthetic data.", flush=True)
      out = _synthetic(config, "synthetic (fallback)")
  if config.dataset.normalize_rows:
    # New dataset objects: the synthetic generator's Bayes predictor needs the raw features.
    out.train = dataclasses.replace(out.train, features=snm_data.l2_normalize_rows(out.train.features))
    out.test = dataclasses.replace(out.test, features=snm_data.l2_normalize_rows(out.test.features))
  return out
