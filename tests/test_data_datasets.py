"""Tests of named-dataset lookup and loading, including the real bibtex/delicious files."""
import gzip
import hashlib
import time

import numpy as np
import pytest
import scipy.sparse as sp

from snm_jax.data import datasets
from snm_jax.data import xc_format
from snm_jax.errors import DatasetNotFoundError

# From shared/data/*/SOURCE.txt: points, features, labels, labels/point, nnz/point,
# points without label.
REAL = {
    ("bibtex", "train"): (4880, 1836, 159, 2.380, 68.49, 0),
    ("bibtex", "test"): (2515, 1836, 159, 2.444, 68.98, 0),
    ("delicious", "train"): (12920, 500, 983, 19.047, 18.54, 10),
    ("delicious", "test"): (3185, 500, 983, 18.910, 17.29, 4),
}


@pytest.mark.parametrize("name,split", sorted(REAL))
def test_real_datasets_match_source_counts(shared_data_dir, monkeypatch, name, split):
  monkeypatch.delenv("SNM_JAX_DATA_DIR", raising=False)
  start = time.perf_counter()
  ds = datasets.load_dataset(name, split)
  seconds = time.perf_counter() - start
  print(f"load_dataset({name!r}, {split!r}): {seconds:.2f} s")
  n, d, k, lpp, npp, unlabeled = REAL[name, split]
  assert (ds.num_points, ds.num_features, ds.num_labels) == (n, d, k)
  assert ds.path.parent.parent == shared_data_dir
  assert round(ds.labels.nnz / n, 3) == lpp
  assert round(ds.features.nnz / n, 2) == npp
  assert np.sum(np.diff(ds.labels.indptr) == 0) == unlabeled
  assert np.all(ds.features.data == 1.0)  # binary features
  assert ds.label_counts.sum() == ds.labels.nnz and ds.label_counts.shape == (k,)
  assert ds.label_counts is ds.label_counts  # computed once
  assert ds.label_names is not None and len(ds.label_names) == k
  if (name, split) == ("delicious", "test"):
    assert np.count_nonzero(ds.label_counts) == 982  # "982 of 983 labels occur in test"


def test_real_datasets_are_listed(shared_data_dir, monkeypatch):
  monkeypatch.delenv("SNM_JAX_DATA_DIR", raising=False)
  assert {"bibtex", "delicious"} <= set(datasets.available_datasets())
  assert datasets.find_dataset("bibtex", "test") == shared_data_dir / "bibtex"
  assert datasets.find_dataset("BibTeX") == shared_data_dir / "bibtex"


def _tiny(folder, n=3, shift=0):
  feats = sp.csr_matrix(np.arange(n * 4, dtype=np.float32).reshape(n, 4) + shift)
  labels = sp.csr_matrix(np.eye(n, 2, dtype=np.float32))
  folder.mkdir(parents=True, exist_ok=True)
  return feats, labels


def test_search_order_env_then_shared_then_cache(tmp_path, monkeypatch):
  env_root, cache_root = tmp_path / "env", tmp_path / "cache"
  feats, labels = _tiny(env_root / "bibtex", shift=100)
  xc_format.write_xc(env_root / "bibtex" / "bibtex_train.txt", feats, labels)
  feats_c, labels_c = _tiny(cache_root / "only_in_cache")
  xc_format.write_xc(cache_root / "only_in_cache" / "only_in_cache_train.txt.gz", feats_c,
                     labels_c)
  monkeypatch.setenv("SNM_JAX_DATA_DIR", str(env_root))
  monkeypatch.setenv("SNM_JAX_CACHE", str(cache_root))
  assert datasets.data_search_dirs() == [env_root, datasets.shared_data_dir(), cache_root,
                                       datasets.bundled_data_dir()]
  ds = datasets.load_dataset("bibtex")  # the env folder shadows shared/data
  np.testing.assert_array_equal(ds.features.toarray(), feats.toarray())
  ds = datasets.load_dataset("only_in_cache")
  np.testing.assert_array_equal(ds.features.toarray(), feats_c.toarray())
  assert datasets.find_dataset("only_in_cache", "test") is None
  with pytest.raises(DatasetNotFoundError) as info:
    datasets.load_dataset("only_in_cache", "test")
  msg = str(info.value)
  assert "\n" not in msg  # one line
  for root in (env_root, datasets.shared_data_dir(), cache_root, datasets.bundled_data_dir()):
    assert str(root / "only_in_cache") in msg
  assert "download_dataset" in msg
  with pytest.raises(ValueError, match="split"):
    datasets.find_dataset("bibtex", "validation")


def test_other_repository_layouts(tmp_path):
  feats, labels = _tiny(tmp_path / "a", n=5)
  # <split>.txt
  xc_format.write_xc(tmp_path / "a" / "train.txt", feats, labels)
  # X/Y pair
  (tmp_path / "b").mkdir()
  xc_format.write_sparse_matrix(tmp_path / "b" / "tst_X_Xf.txt", feats)
  xc_format.write_sparse_matrix(tmp_path / "b" / "tst_X_Y.txt", labels)
  # full data file + split file (1-based indices, several columns)
  (tmp_path / "Cset").mkdir()
  xc_format.write_xc(tmp_path / "Cset" / "Cset_data.txt", feats, labels)
  (tmp_path / "Cset" / "cset_trSplit.txt").write_text("5 1\n2 3\n")
  np.testing.assert_array_equal(
      datasets.load_dataset("a", "train", data_dir=tmp_path).features.toarray(), feats.toarray())
  got = datasets.load_dataset("b", "test", data_dir=tmp_path)
  np.testing.assert_array_equal(got.labels.toarray(), labels.toarray())
  got = datasets.load_dataset("cset", "train", data_dir=tmp_path)
  np.testing.assert_array_equal(got.features.toarray(), feats.toarray()[[4, 1]])
  np.testing.assert_array_equal(got.labels.toarray(), labels.toarray()[[4, 1]])
  assert datasets.available_datasets(tmp_path) == ["Cset", "a"]
  with pytest.raises(DatasetNotFoundError):
    datasets.load_dataset("b", "train", data_dir=tmp_path)


BUNDLED_SPLITS = ("train", "test")


@pytest.mark.parametrize("split", BUNDLED_SPLITS)
def test_bundled_bibtex_reads_identically_to_the_shared_folder(shared_data_dir, split):
  if not (shared_data_dir / "bibtex").is_dir():
    pytest.skip(f"{shared_data_dir / 'bibtex'} absent: nothing to compare the bundled copy to")
  bundled = datasets.load_dataset("bibtex", split, data_dir=datasets.bundled_data_dir())
  shared = datasets.load_dataset("bibtex", split, data_dir=shared_data_dir)
  assert bundled.path.name == f"bibtex_{split}.txt.gz"
  assert bundled.path.parent == datasets.bundled_data_dir() / "bibtex"
  for attr in ("features", "labels"):
    a, b = getattr(bundled, attr), getattr(shared, attr)
    assert a.shape == b.shape and a.dtype == b.dtype
    for part in ("indptr", "indices", "data"):
      np.testing.assert_array_equal(getattr(a, part), getattr(b, part), err_msg=f"{attr}.{part}")
  assert bundled.label_names == shared.label_names and len(bundled.label_names) == 159


def test_bundled_bibtex_is_found_when_every_other_root_is_empty(tmp_path, monkeypatch):
  empty = tmp_path / "empty"
  empty.mkdir()
  monkeypatch.setenv("SNM_JAX_DATA_DIR", str(empty))
  monkeypatch.setenv("SNM_JAX_CACHE", str(empty))
  monkeypatch.setattr(datasets, "shared_data_dir", lambda: tmp_path / "no_shared")
  assert datasets.data_search_dirs()[-1] == datasets.bundled_data_dir()
  assert datasets.find_dataset("bibtex", "test") == datasets.bundled_data_dir() / "bibtex"
  assert datasets.available_datasets() == ["bibtex"]  # Delicious is not bundled.
  for split, (n, d, k, *_) in (("train", REAL["bibtex", "train"]),
                               ("test", REAL["bibtex", "test"])):
    ds = datasets.load_dataset("BibTeX", split)
    assert (ds.num_points, ds.num_features, ds.num_labels) == (n, d, k)
    assert ds.path.parent == datasets.bundled_data_dir() / "bibtex"
  with pytest.raises(DatasetNotFoundError, match="delicious"):
    datasets.load_dataset("delicious")


def test_bundled_folder_holds_only_the_converted_bibtex():
  folder = datasets.bundled_data_dir()
  assert sorted(p.name for p in folder.iterdir()) == ["bibtex"]
  assert sorted(p.name for p in (folder / "bibtex").iterdir()) == [
      "SOURCE.txt", "bibtex_labels.txt.gz", "bibtex_test.txt.gz", "bibtex_train.txt.gz"]
  source = (folder / "bibtex" / "SOURCE.txt").read_text()
  assert "sha256 of the uncompressed content" in source
  for gz in sorted((folder / "bibtex").glob("*.txt.gz")):
    digest = hashlib.sha256(gzip.decompress(gz.read_bytes())).hexdigest()
    assert f"{digest}  bibtex/{gz.name[:-3]}" in source, gz.name
