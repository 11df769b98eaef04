"""Tests of `load_run_data`: the validation split, whole-file label counts, no
synthetic fallback for a missing dataset, and the train/test size check."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from experiments.configs import adversarial, common, default, snm
from snm_jax.data import datasets, xc_format
from snm_jax.errors import ConfigError, DataFormatError
from snm_jax.train.trainer.run_data import load_run_data

REPO = Path(__file__).resolve().parents[1]


def _config(**dataset):
  c = common.base_config()
  c.dataset.synthetic.num_labels = 128
  c.dataset.synthetic.num_train = 400
  c.dataset.synthetic.num_test = 60
  c.dataset.synthetic.dim = 8
  for k, v in dataset.items():
    c.dataset[k] = v
  return c


def _same_csr(a, b):
  assert a.shape == b.shape
  for part in ("indptr", "indices", "data"):
    np.testing.assert_array_equal(getattr(a, part), getattr(b, part))


def test_no_config_has_a_synthetic_fallback_field():
  for c in (common.base_config(), default.get_config(), snm.get_config(""),
            adversarial.get_config()):
    assert "fallback_to_synthetic" not in c.dataset
  c = common.base_config()
  assert (c.dataset.validation_fraction, c.dataset.validation_seed) == (0.0, 0)


def test_without_a_validation_fraction_there_is_no_validation_split():
  out = load_run_data(_config(name="synthetic"))
  assert out.validation is None and out.source == "synthetic"
  assert out.train_file_points == out.train.num_points == 400
  np.testing.assert_array_equal(out.label_counts, out.train.label_counts)


@pytest.mark.parametrize("normalize_rows", [True, False])
def test_synthetic_validation_split(normalize_rows):
  whole = load_run_data(_config(name="synthetic", normalize_rows=normalize_rows))
  out = load_run_data(_config(name="synthetic", normalize_rows=normalize_rows,
                              validation_fraction=0.1, validation_seed=5))
  assert (out.train.num_points, out.validation.num_points) == (360, 40)
  assert (out.train.split, out.validation.split) == ("train", "validation")
  _same_csr(out.test.features, whole.test.features)  # the test split is never touched
  _same_csr(out.test.labels, whole.test.labels)
  # The generator's raw test features (for the Bayes predictor) are still the raw ones.
  raw = out.synthetic.test.features
  assert out.synthetic.test.num_points == 60
  if normalize_rows:
    assert not np.allclose(sp.linalg.norm(raw, axis=1), 1.0)
    np.testing.assert_allclose(sp.linalg.norm(out.validation.features, axis=1), 1.0, rtol=1e-5)
  out.synthetic.bayes_topk(raw, 5)
  # Whole-file label counts and N, whatever the split.
  np.testing.assert_array_equal(out.label_counts, whole.label_counts)
  np.testing.assert_array_equal(out.train.label_counts + out.validation.label_counts,
                                out.label_counts)
  assert out.train_file_points == 400
  held = np.setdiff1d(np.arange(400), np.random.default_rng(5).permutation(400)[40:])
  _same_csr(out.validation.features, whole.train.features[held])


def test_bibtex_validation_split_is_deterministic_and_keeps_whole_file_counts():
  whole = load_run_data(_config(name="bibtex"))
  a = load_run_data(_config(name="bibtex", validation_fraction=0.2, validation_seed=1))
  b = load_run_data(_config(name="bibtex", validation_fraction=0.2, validation_seed=1))
  c = load_run_data(_config(name="bibtex", validation_fraction=0.2, validation_seed=2))
  assert whole.train.num_points == 4880 and a.validation.num_points == 976
  assert a.train.num_points + a.validation.num_points == 4880
  _same_csr(a.validation.features, b.validation.features)
  _same_csr(a.validation.labels, b.validation.labels)
  assert (a.validation.features != c.validation.features).nnz > 0
  _same_csr(a.test.features, whole.test.features)
  _same_csr(a.test.labels, whole.test.labels)
  np.testing.assert_array_equal(a.label_counts, whole.train.label_counts)
  np.testing.assert_array_equal(a.label_counts, c.label_counts)
  assert a.train_file_points == 4880
  assert (a.num_features, a.num_labels) == (1836, 159)


@pytest.mark.parametrize("fraction", [1.0, -0.5, 0.9999])
def test_bad_validation_fraction_is_a_config_error(fraction):
  with pytest.raises(ConfigError, match=r"^config\.dataset\.validation_fraction: "):
    load_run_data(_config(name="synthetic", validation_fraction=fraction))


def test_missing_dataset_is_a_config_error_listing_every_place(tmp_path, monkeypatch):
  monkeypatch.setenv("SNM_JAX_DATA_DIR", str(tmp_path / "env"))
  monkeypatch.setenv("SNM_JAX_CACHE", str(tmp_path / "cache"))
  with pytest.raises(ConfigError) as info:
    load_run_data(_config(name="bibtx"))
  msg = str(info.value)
  assert msg.startswith("config.dataset.name: ") and info.value.field == "dataset.name"
  assert "\n" not in msg
  roots = datasets.data_search_dirs()
  assert roots[-1] == datasets.bundled_data_dir()
  for root in roots:
    assert str(root / "bibtx") in msg
  with pytest.raises(ConfigError, match=str(tmp_path / "only" / "bibtex")):
    load_run_data(_config(name="bibtex", data_dir=str(tmp_path / "only")))


def _write(folder, split, n, d, k):
  folder.mkdir(exist_ok=True)
  features = sp.csr_matrix(np.eye(n, d, k=d - n if d > n else 0, dtype=np.float32))
  labels = sp.csr_matrix((np.ones(n, np.float32), np.arange(n) % k, np.arange(n + 1)), shape=(n, k))
  xc_format.write_xc(folder / f"tiny_{split}.txt", features, labels)
  return folder / f"tiny_{split}.txt"


@pytest.mark.parametrize("test_d,test_k,sizes", [(4, 5, ("K=5", "K=3")), (6, 3, ("d=6", "d=4"))])
def test_test_split_larger_than_the_training_one_is_an_error(tmp_path, test_d, test_k, sizes):
  train_path = _write(tmp_path / "tiny", "train", 3, 4, 3)
  test_path = _write(tmp_path / "tiny", "test", 2, test_d, test_k)
  with pytest.raises(DataFormatError) as info:
    load_run_data(_config(name="tiny", data_dir=str(tmp_path)))
  msg = str(info.value)
  assert str(train_path) in msg and str(test_path) in msg
  assert all(s in msg for s in sizes)


def test_train_py_exits_with_one_line_naming_the_field(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train",
       "--config=experiments/configs/default.py:paper,runlocal", "--config.dataset.name=bibtx",
       f"--workdir={tmp_path / 'run'}"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith("error: config.dataset.name: "), proc.stderr
  assert "bundled/bibtx" in lines[-1] and "Traceback" not in proc.stderr


def test_validation_splits_carve_one_reading_of_the_training_file(monkeypatch):
  """A recipe's validation splits (validation_seed 0, 1, 2) read and normalise the training file once;
  each carve is its own: disjoint validation parts covering the same whole file."""
  from snm_jax.train.trainer import run_data  # pylint: disable=g-import-not-at-top
  reads = []
  real_read = run_data._read  # pylint: disable=protected-access
  monkeypatch.setattr(run_data, "_read", lambda c: reads.append(1) or real_read(c))
  c = _config(name="synthetic", validation_fraction=0.25, normalize_rows=True)
  c.dataset.synthetic.num_train = 404  # a size no other test loads: the first load here reads
  splits = []
  for seed in (0, 1, 2):
    c.dataset.validation_seed = seed
    splits.append(load_run_data(c))
  assert len(reads) == 1
  whole = splits[0].train.num_points + splits[0].validation.num_points
  assert whole == 404 and all(s.train.num_points + s.validation.num_points == whole for s in splits)
  firsts = [s.validation.features.toarray().tobytes() for s in splits]
  assert len(set(firsts)) == 3  # three different carves
  for s in splits:
    np.testing.assert_array_equal(s.label_counts, splits[0].label_counts)  # the whole file's


def test_a_features_file_rewritten_in_place_is_read_again(tmp_path):
  """dataset.name="files": the kept read of the training file (for other validation carves) is
  keyed by the files' identity too, so a file rewritten in place is read again."""
  import os  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  paths = {k: tmp_path / f"{k}.npz" for k in ("train_features", "train_labels", "test_features", "test_labels")}

  def write():  # new random values each time
    for split, n in (("train", 40), ("test", 10)):
      sp.save_npz(paths[f"{split}_features"], sp.csr_matrix(rng.random((n, 6)).astype(np.float32)))
      sp.save_npz(paths[f"{split}_labels"], sp.csr_matrix((rng.random((n, 5)) < 0.4).astype(np.float32)))

  write()
  c = _config(name="files", validation_fraction=0.25)
  for k, p in paths.items():
    c.dataset.files[k] = str(p)
  first = load_run_data(c).train.features.toarray()
  write()  # other values, the same shapes
  for p in paths.values():  # a new mtime even on a coarse clock
    os.utime(p, ns=(os.stat(p).st_atime_ns, os.stat(p).st_mtime_ns + 10 ** 9))
  again = load_run_data(c).train.features.toarray()
  assert first.shape == again.shape and not np.array_equal(first, again)
