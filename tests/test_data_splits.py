"""Tests of the validation split carved from a training set and of the train/test
compatibility check (sizes d and K)."""
import numpy as np
import pytest
import scipy.sparse as sp

from snm_jax.data import datasets
from snm_jax.data import splits
from snm_jax.data import xc_format
from snm_jax.errors import DataFormatError


def _dataset(n=50, d=7, k=5, seed=0):
  rng = np.random.default_rng(seed)
  features = sp.random(n, d, density=0.4, format="csr", dtype=np.float32, random_state=rng)
  # Label ids stored in a non-sorted order, to check it is kept.
  rows = [rng.choice(k, size=rng.integers(0, 4), replace=False) for _ in range(n)]
  indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
  indices = np.concatenate(rows).astype(np.int32)
  labels = sp.csr_matrix((np.ones(indices.size, np.float32), indices, indptr), shape=(n, k))
  # Row i carries its index as the value of feature 0 (after the random ones), to trace rows.
  features = sp.csr_matrix(sp.hstack([sp.csr_matrix(np.arange(n, dtype=np.float32)[:, None] + 1),
                                      features]))
  return datasets.XCDataset(features, labels, "toy", "train", label_names=list("abcde"))


def _row_ids(ds):
  return ds.features[:, 0].toarray().ravel().astype(int) - 1


def test_split_is_disjoint_ordered_and_covers_the_training_set():
  ds = _dataset()
  train, val = splits.split_validation(ds, 0.2, seed=3)
  assert (train.num_points, val.num_points) == (40, 10)
  assert (train.split, val.split) == ("train", "validation")
  assert train.label_names == val.label_names == list("abcde")
  tr, va = _row_ids(train), _row_ids(val)
  assert np.all(np.diff(tr) > 0) and np.all(np.diff(va) > 0)  # original row order kept
  assert not set(tr) & set(va)
  np.testing.assert_array_equal(np.sort(np.concatenate([tr, va])), np.arange(50))
  for part, ids in ((train, tr), (val, va)):
    assert part.features.shape[1] == ds.num_features and part.num_labels == ds.num_labels
    for j, i in enumerate(ids):  # rows identical, label ids in their stored order
      np.testing.assert_array_equal(part.labels[j].indices, ds.labels[i].indices)
      np.testing.assert_array_equal(part.features[j].toarray(), ds.features[i].toarray())
  np.testing.assert_array_equal(train.label_counts + val.label_counts, ds.label_counts)


def test_split_is_deterministic_per_seed_and_independent_of_the_data():
  ds = _dataset()
  a = _row_ids(splits.split_validation(ds, 0.2, seed=3)[1])
  np.testing.assert_array_equal(a, _row_ids(splits.split_validation(ds, 0.2, seed=3)[1]))
  np.testing.assert_array_equal(a, _row_ids(splits.split_validation(_dataset(seed=9), 0.2, 3)[1]))
  assert not np.array_equal(a, _row_ids(splits.split_validation(ds, 0.2, seed=4)[1]))
  expected = np.sort(np.random.default_rng(3).permutation(50)[:10])
  np.testing.assert_array_equal(a, expected)


@pytest.mark.parametrize("n,fraction,want", [
    (50, 0.0, 0), (50, 0.2, 10), (50, 0.001, 1), (3, 0.1, 1), (7, 0.5, 4), (2, 0.5, 1)])
def test_validation_size(n, fraction, want):
  assert splits.validation_size(n, fraction) == want


def test_zero_fraction_gives_an_empty_validation_part():
  ds = _dataset()
  train, val = splits.split_validation(ds, 0.0, seed=0)
  assert (train.num_points, val.num_points) == (50, 0)
  np.testing.assert_array_equal(_row_ids(train), np.arange(50))


@pytest.mark.parametrize("fraction", [1.0, 1.5, -0.1, float("nan"), "0.2", None])
def test_fraction_outside_zero_one_is_an_error(fraction):
  with pytest.raises(ValueError, match=r"\[0, 1\)"):
    splits.split_validation(_dataset(), fraction, seed=0)


def test_fraction_leaving_no_training_point_is_an_error():
  with pytest.raises(ValueError, match="no training point"):
    splits.split_validation(_dataset(n=1), 0.5, seed=0)
  with pytest.raises(ValueError, match="no training point"):
    splits.validation_size(10, 0.96)


def _write(path, features, k):
  n = features.shape[0]
  labels = sp.csr_matrix((np.ones(n, np.float32), np.arange(n) % k, np.arange(n + 1)), shape=(n, k))
  xc_format.write_xc(path, features, labels)


def _pair(tmp_path, d_train, k_train, test_features, k_test):
  folder = tmp_path / "tiny"
  folder.mkdir()
  _write(folder / "tiny_train.txt", sp.csr_matrix(np.eye(3, d_train, dtype=np.float32)), k_train)
  _write(folder / "tiny_test.txt", sp.csr_matrix(test_features), k_test)
  return (datasets.load_dataset("tiny", "train", data_dir=tmp_path),
          datasets.load_dataset("tiny", "test", data_dir=tmp_path))


def test_compatible_splits_pass_unchanged(tmp_path):
  train, test = _pair(tmp_path, 4, 3, np.eye(2, 4, dtype=np.float32), 3)
  assert splits.check_split_compatible(train, test) is test


def test_more_labels_in_the_test_file_is_an_error_naming_both_files(tmp_path):
  train, test = _pair(tmp_path, 4, 3, np.eye(2, 4, dtype=np.float32), 5)
  with pytest.raises(DataFormatError) as info:
    splits.check_split_compatible(train, test)
  msg = str(info.value)
  assert msg.startswith(str(test.path))
  assert str(train.path) in msg and "K=5" in msg and "K=3" in msg


def test_fewer_labels_in_the_test_file_is_an_error_too(tmp_path):
  train, test = _pair(tmp_path, 4, 3, np.eye(2, 4, dtype=np.float32), 2)
  with pytest.raises(DataFormatError, match="K=2.*K=3"):
    splits.check_split_compatible(train, test)


def test_test_feature_id_beyond_the_training_d_is_an_error(tmp_path):
  x = np.zeros((3, 6), np.float32)
  x[0, 1] = x[2, 5] = 1.0
  train, test = _pair(tmp_path, 4, 3, x, 3)
  with pytest.raises(DataFormatError) as info:
    splits.check_split_compatible(train, test)
  msg = str(info.value)
  assert msg.startswith(str(test.path)) and str(train.path) in msg
  assert "d=6" in msg and "d=4" in msg and "feature ids up to 5" in msg and "row 2" in msg


def test_a_wider_or_narrower_test_header_whose_ids_fit_is_resized(tmp_path):
  x = np.zeros((2, 6), np.float32)
  x[1, 3] = 2.0
  train, test = _pair(tmp_path, 4, 3, x, 3)
  out = splits.check_split_compatible(train, test)
  assert out.features.shape == (2, 4) and out.path == test.path and out.split == "test"
  np.testing.assert_array_equal(out.features.toarray(), x[:, :4])
  np.testing.assert_array_equal(out.labels.toarray(), test.labels.toarray())
  narrow = datasets.XCDataset(sp.csr_matrix(x[:, :2]), test.labels, "tiny", "test")
  assert splits.check_split_compatible(train, narrow).features.shape == (2, 4)


def test_carve_writes_the_validation_rows_as_its_test_split(tmp_path):
  """experiments.carve: the carve's test file is exactly split_validation's held-out part of the
  (bundled) Bibtex training file, its train file the rest, both read back by the loader."""
  from experiments import carve  # pylint: disable=g-import-not-at-top
  bundled = datasets.bundled_data_dir()
  folder = carve.carve("bibtex", tmp_path, 0.1, seed=3, data_dir=bundled)
  assert folder == tmp_path / "bibtex"
  train = datasets.load_dataset("bibtex", "train", data_dir=bundled)
  kept, held_out = splits.split_validation(train, 0.1, 3)
  got_train = datasets.load_dataset("bibtex", "train", data_dir=tmp_path)
  got_test = datasets.load_dataset("bibtex", "test", data_dir=tmp_path)
  assert (got_train.num_points, got_test.num_points) == (4392, 488)
  for got, want in ((got_train, kept), (got_test, held_out)):
    assert got.features.shape == want.features.shape and got.labels.shape == want.labels.shape
    assert (got.features != want.features).nnz == 0 and (got.labels != want.labels).nnz == 0
