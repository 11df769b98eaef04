"""Named datasets: find them on disk and load a split.

Search order for `<root>/<name>/`:
  1. every folder in the `SNM_JAX_DATA_DIR` environment variable (os.pathsep-separated),
  2. `shared/data` next to the repository checkout (`<checkout>/../shared/data`),
  3. the download cache (`SNM_JAX_CACHE`, default `~/.cache/snm_jax`),
  4. the copies shipped inside the package (`snm_jax/data/bundled/`: Bibtex only),
     last, so that a real shared folder wins when present.

Recognised layouts inside a dataset folder (first match wins), for split in
{train, test} (`.gz` variants accepted everywhere):
  * `<name>_<split>.txt`                       (bundled Mulan conversions, downloads)
  * `<split>.txt`                              (XC repository BoW archives)
  * `trn_X_Xf.txt` + `trn_X_Y.txt` / `tst_...` (XC repository X/Y pairs)
  * `<Name>_data.txt` + `<name>_trSplit.txt` / `<name>_tstSplit.txt` (split column 0)
Label names are read from `<name>_labels.txt` when present.
"""
from __future__ import annotations

import dataclasses
import functools
import gzip
import os
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from snm_jax.errors import DatasetNotFoundError
from snm_jax.data import xc_format

SPLITS = ("train", "test")
_PAIR_PREFIX = {"train": "trn", "test": "tst"}
_SPLIT_FILE = {"train": "trSplit", "test": "tstSplit"}


@dataclasses.dataclass(eq=False)
class XCDataset:
  """One split of a multi-label dataset.

  Attributes:
    features: CSR float32 (N, d), or a dense float32 ndarray (N, d) (dense
      feature files, `snm_jax.data.array_files`).
    labels: CSR float32 (N, K), value 1 at each positive; a row's stored ids
      are its label set in file order.
    name: dataset name, e.g. "bibtex".
    split: "train" or "test" (or a free-form tag for synthetic data).
    label_names: optional list of K names.
    path: file the split was read from, if any.
  """
  features: sp.csr_matrix | np.ndarray
  labels: sp.csr_matrix
  name: str
  split: str
  label_names: list[str] | None = None
  path: Path | None = None

  def __post_init__(self):
    if self.features.shape[0] != self.labels.shape[0]:
      raise ValueError(f"features have {self.features.shape[0]} rows but labels "
                       f"{self.labels.shape[0]}")

  @property
  def num_points(self) -> int:
    return self.features.shape[0]

  @property
  def num_features(self) -> int:
    return self.features.shape[1]

  @property
  def num_labels(self) -> int:
    return self.labels.shape[1]

  @functools.cached_property
  def label_counts(self) -> np.ndarray:
    """int64 (K,): number of points of this split carrying each label (computed once)."""
    return np.bincount(self.labels.indices, minlength=self.num_labels).astype(np.int64)

  def __repr__(self):
    return (f"XCDataset({self.name}/{self.split}: N={self.num_points}, "
            f"d={self.num_features}, K={self.num_labels}, "
            f"nnz/pt={num_nonzero(self.features) / max(self.num_points, 1):.2f}, "
            f"labels/pt={self.labels.nnz / max(self.num_points, 1):.3f})")


def num_nonzero(features) -> int:
  """Stored entries of a CSR matrix, or nonzeros of a dense array."""
  return int(features.nnz) if sp.issparse(features) else int(np.count_nonzero(features))


def cache_dir() -> Path:
  """The download cache: `$SNM_JAX_CACHE` or `~/.cache/snm_jax`."""
  env = os.environ.get("SNM_JAX_CACHE")
  return Path(env).expanduser() if env else Path.home() / ".cache" / "snm_jax"


def shared_data_dir() -> Path:
  """`shared/data` next to the checkout: <checkout>/../shared/data."""
  # This file is <checkout>/snm_jax/data/datasets.py. (Not snm_jax.__file__:
  # it is None when an old editable install maps snm_jax as a namespace.)
  return Path(__file__).resolve().parents[3] / "shared" / "data"


def bundled_data_dir() -> Path:
  """The datasets shipped as package data: `snm_jax/data/bundled/` (gzip-compressed Bibtex)."""
  return Path(__file__).resolve().parent / "bundled"


def data_search_dirs() -> list[Path]:
  """The roots searched for `<root>/<name>/`, in order (the bundled copies last)."""
  roots = [Path(p).expanduser() for p in
           os.environ.get("SNM_JAX_DATA_DIR", "").split(os.pathsep) if p]
  return roots + [shared_data_dir(), cache_dir(), bundled_data_dir()]


def _existing(folder: Path, stem: str) -> Path | None:
  for cand in (folder / stem, folder / (stem + ".gz")):
    if cand.is_file():
      return cand
  return None


def _find_ci(folder: Path, filename: str) -> Path | None:
  """Case-insensitive lookup of `filename` (or `filename.gz`) in `folder`."""
  hit = _existing(folder, filename)
  if hit:
    return hit
  low = {p.name.lower(): p for p in folder.iterdir() if p.is_file()}
  return low.get(filename.lower()) or low.get(filename.lower() + ".gz")


def _split_source(folder: Path, name: str, split: str):
  """Returns a callable reading (features, labels, path) for the split, or None."""
  for stem in (f"{name}_{split}.txt", f"{split}.txt"):
    p = _find_ci(folder, stem)
    if p:
      return lambda: (*xc_format.read_xc(p), p)
  pre = _PAIR_PREFIX[split]
  x, y = _find_ci(folder, f"{pre}_X_Xf.txt"), _find_ci(folder, f"{pre}_X_Y.txt")
  if x and y:
    return lambda: (*xc_format.read_xc_pair(x, y), x)
  full = _find_ci(folder, f"{name}_data.txt")
  split_file = _find_ci(folder, f"{name}_{_SPLIT_FILE[split]}.txt")
  if full and split_file:
    def read():
      features, labels = xc_format.read_xc(full)
      rows = xc_format.read_split_indices(split_file, features.shape[0])
      return features[rows], labels[rows], full
    return read
  return None


def _dataset_folder(root: Path, name: str) -> Path | None:
  if not root.is_dir():
    return None
  direct = root / name
  if direct.is_dir():
    return direct
  for p in root.iterdir():
    if p.is_dir() and p.name.lower() == name.lower():
      return p
  return None


def find_dataset(name: str, split: str = "train", data_dir=None) -> Path | None:
  """Returns the folder holding `split` of dataset `name`, or None.

  Args:
    name: dataset name (folder name, case-insensitive), e.g. "bibtex".
    split: "train" or "test".
    data_dir: if given, search only this root instead of the default roots.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  roots = [Path(data_dir)] if data_dir is not None else data_search_dirs()
  for root in roots:
    folder = _dataset_folder(root, name)
    if folder is not None and _split_source(folder, folder.name, split) is not None:
      return folder
  return None


def available_datasets(data_dir=None) -> list[str]:
  """Sorted names of the datasets with a readable train split in the search roots."""
  roots = [Path(data_dir)] if data_dir is not None else data_search_dirs()
  names = set()
  for root in roots:
    if root.is_dir():
      names.update(p.name for p in root.iterdir()
                   if p.is_dir() and _split_source(p, p.name, "train") is not None)
  return sorted(names)


def _label_names(folder: Path, name: str, num_labels: int) -> list[str] | None:
  p = _find_ci(folder, f"{name}_labels.txt")
  if p is None:
    return None
  opener = gzip.open if xc_format.is_gzip(p) else open
  with opener(p, "rt", encoding="utf-8") as f:
    names = f.read().splitlines()
  return names if len(names) == num_labels else None


def load_dataset(name: str, split: str = "train", data_dir=None) -> XCDataset:
  """Loads one split of a named dataset from the first root that has it.

  Args:
    name: e.g. "bibtex", "delicious" (folder name, case-insensitive).
    split: "train" or "test".
    data_dir: search only this root (default: `data_search_dirs()`).

  Raises:
    DatasetNotFoundError: listing every place searched (on one line).
    DataFormatError: if the file is malformed.
  """
  folder = find_dataset(name, split, data_dir)
  if folder is None:
    roots = [Path(data_dir)] if data_dir is not None else data_search_dirs()
    where = ", ".join(str(r / name) for r in roots)
    raise DatasetNotFoundError(
        f"dataset {name!r} split {split!r} not found; looked in: {where} "
        f"(set SNM_JAX_DATA_DIR, or call snm_jax.data.download_dataset({name!r}) "
        "on a machine with internet access)")
  features, labels, path = _split_source(folder, folder.name, split)()
  return XCDataset(features=features, labels=labels, name=name, split=split,
                   label_names=_label_names(folder, folder.name, labels.shape[1]),
                   path=Path(path))
