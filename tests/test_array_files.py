"""dataset.name="files": features (.npy, dense or sparse .npz, XC text) and labels (sparse .npz,
XC text) read from four files; typed errors naming the file; the validation carve; the config
checks made before anything is read."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from experiments.configs import common
from snm_jax.data import array_files, xc_format
from snm_jax.errors import ConfigError, DataFormatError
from snm_jax.train.config import builders, validation
from snm_jax.train.trainer.run_data import load_run_data

REPO = Path(__file__).resolve().parents[1]
N, D, K = 30, 6, 7


def _x(n=N, d=D, seed=0, dtype=np.float32):
  return np.random.default_rng(seed).normal(size=(n, d)).astype(dtype)


def _y(n=N, k=K, seed=0):
  """Label sets of 1-3 ids per row, in a non-sorted stored order."""
  rng = np.random.default_rng(seed + 100)
  rows = [rng.permutation(k)[:rng.integers(1, 4)] for _ in range(n)]
  indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
  return sp.csr_matrix((np.ones(indptr[-1], np.float32), np.concatenate(rows).astype(np.int32), indptr),
                       shape=(n, k))


def _same_csr(a, b):
  assert a.shape == b.shape
  for part in ("indptr", "indices", "data"):
    np.testing.assert_array_equal(getattr(a, part), getattr(b, part))


def test_dense_npy_and_npz_features_and_sparse_npz_labels(tmp_path):
  x, y = _x(dtype=np.float64), _y()
  np.save(tmp_path / "x.npy", x)
  np.savez(tmp_path / "x1.npz", x)                                   # the file's only array
  np.savez(tmp_path / "x2.npz", features=x, ids=np.arange(N))        # the one named "features"
  sp.save_npz(tmp_path / "y.npz", y)
  for name in ("x.npy", "x1.npz", "x2.npz"):
    got = array_files.read_features(tmp_path / name)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, x.astype(np.float32))
  labels = array_files.read_labels(tmp_path / "y.npz")
  _same_csr(labels, y)  # stored (non-sorted) order kept, values 1


def test_sparse_npz_and_xc_text_features_and_xc_text_labels(tmp_path):
  x = sp.random(N, D, density=0.4, format="csr", random_state=1, dtype=np.float64)
  y = _y()
  y_valued = y.copy()
  y_valued.data[:] = 3.0  # any stored nonzero is a positive
  sp.save_npz(tmp_path / "x.npz", x)
  xc_format.write_sparse_matrix(tmp_path / "x.txt", x)
  xc_format.write_sparse_matrix(tmp_path / "y.txt", y_valued)
  for name in ("x.npz", "x.txt"):
    got = array_files.read_features(tmp_path / name)
    assert sp.issparse(got) and got.dtype == np.float32
    np.testing.assert_allclose(got.toarray(), x.toarray(), rtol=1e-6)
  _same_csr(array_files.read_labels(tmp_path / "y.txt"), y)
  # A stored zero in a label matrix is not a positive.
  y0 = y.copy()
  y0.data[0] = 0.0
  sp.save_npz(tmp_path / "y0.npz", y0)
  got = array_files.read_labels(tmp_path / "y0.npz")
  assert got.nnz == y.nnz - 1 and y.indices[0] not in got.indices[:got.indptr[1]]


def _bad_label_ids():
  y = _y()
  y.indices[y.indptr[4]] = K + 2  # row 4 gets the id K + 2 (the CSR constructor does not check it)
  return y


def _duplicate_labels():
  """Rows [2], [1, 5, 3, 5]: label 5 twice in row 1."""
  return sp.csr_matrix((np.ones(5, np.float32), [2, 1, 5, 3, 5], [0, 1, 5]), shape=(2, K))


def _nan_features():
  x = _x()
  x[3, 2] = np.nan
  return x


def _huge_features():
  x = _x(dtype=np.float64)
  x[7, 1] = 1e39  # beyond float32's range
  return x


@pytest.mark.parametrize("name,write,match", [
    ("x.npy", lambda p: np.save(p, _nan_features()), r"non-finite feature value .* row 3, column 2"),
    ("x.npy", lambda p: np.save(p, _huge_features()), r"beyond float32's range\) at row 7, column 1"),
    ("x.npy", lambda p: np.save(p, np.zeros(N, np.float32)), r"2-D \(N, d\) array, got shape \(30,\)"),
    ("x.npy", lambda p: np.save(p, np.zeros((N, D), np.complex64)), "real numbers, got dtype complex64"),
    ("x.npy", lambda p: np.save(p, np.zeros((N, D), object), allow_pickle=True), "not a readable .npy"),
    ("x.npy", lambda p: p.write_bytes(b"not an array"), "not a readable .npy"),
    ("x.npy", lambda p: np.save(p, np.zeros((0, D), np.float32)), "need N >= 1"),
    ("x.npz", lambda p: np.savez(p, a=_x(), b=_x()), r"holds the arrays \['a', 'b'\]"),
    ("x.npz", lambda p: p.write_bytes(b"PK garbage"), "not a readable .npz"),
    ("x.npz", lambda p: sp.save_npz(p, sp.csr_matrix(_nan_features())), r"non-finite feature value .* row 3, column 2"),
    ("x.txt", lambda p: p.write_text("2 3\n0:1.0\n5:2.0\n"), r"x\.txt:3: "),
])
def test_bad_feature_files_are_typed_errors_naming_the_file(tmp_path, name, write, match):
  path = tmp_path / name
  write(path)
  with pytest.raises(DataFormatError, match=match) as info:
    array_files.read_features(path)
  assert str(info.value).startswith(str(path))


@pytest.mark.parametrize("name,write,match", [
    ("y.npz", lambda p: sp.save_npz(p, _bad_label_ids()), rf"label id {K + 2} in row 4 \(0-based\) is outside \[0, {K}\)"),
    ("y.npz", lambda p: sp.save_npz(p, _duplicate_labels()), r"label 5 appears more than once in row 1 \(0-based\)"),
    ("y.npz", lambda p: np.savez(p, np.ones((N, K))), "must be a scipy.sparse .* dense array of shape"),
    ("y.txt", lambda p: p.write_text(f"2 {K}\n0:1\n{K}:1\n"), rf"y\.txt:3: "),
])
def test_bad_label_files_are_typed_errors_naming_the_file(tmp_path, name, write, match):
  path = tmp_path / name
  write(path)
  with pytest.raises(DataFormatError, match=match) as info:
    array_files.read_labels(path)
  assert str(info.value).startswith(str(path))


def _write_split(folder, split, n=N, d=D, k=K, seed=0):
  np.save(folder / f"{split}_x.npy", _x(n, d, seed))
  sp.save_npz(folder / f"{split}_y.npz", _y(n, k, seed))
  return str(folder / f"{split}_x.npy"), str(folder / f"{split}_y.npz")


def _files_config(folder, **dataset):
  c = common.base_config()
  c.dataset.name = "files"
  for split in ("train", "test"):
    c.dataset.files[f"{split}_features"] = str(folder / f"{split}_x.npy")
    c.dataset.files[f"{split}_labels"] = str(folder / f"{split}_y.npz")
  for key, value in dataset.items():
    c.dataset[key] = value
  return c


@pytest.mark.parametrize("test_shape,bad_file,match", [
    ((N, D + 1, K), "test_x.npy", rf"test features have d={D + 1} columns but the training features .*train_x\.npy have d={D}"),
    ((N, D, K + 1), "test_y.npz", rf"test labels have K={K + 1} columns but the training labels .*train_y\.npz have K={K}"),
])
def test_test_split_must_have_the_training_d_and_k(tmp_path, test_shape, bad_file, match):
  _write_split(tmp_path, "train")
  _write_split(tmp_path, "test", *test_shape, seed=1)
  with pytest.raises(DataFormatError, match=match) as info:
    load_run_data(_files_config(tmp_path))
  assert str(info.value).startswith(str(tmp_path / bad_file))


def test_label_rows_must_match_feature_rows(tmp_path):
  _write_split(tmp_path, "train")
  _write_split(tmp_path, "test", seed=1)
  sp.save_npz(tmp_path / "train_y.npz", _y(N - 2))
  with pytest.raises(DataFormatError, match=rf"train_y\.npz: {N - 2} label rows but the feature file "
                     rf".*train_x\.npy has {N} rows"):
    load_run_data(_files_config(tmp_path))


@pytest.mark.parametrize("normalize_rows", [False, True])
def test_run_data_with_a_validation_carve_keeps_dense_rows_and_whole_file_counts(tmp_path, normalize_rows):
  _write_split(tmp_path, "train")
  _write_split(tmp_path, "test", n=11, seed=1)
  data = load_run_data(_files_config(tmp_path, validation_fraction=0.2, validation_seed=4,
                                     normalize_rows=normalize_rows))
  x, y = _x(), _y()
  if normalize_rows:
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
  held = np.zeros(N, bool)
  held[np.random.default_rng(4).permutation(N)[:6]] = True  # round(0.2 * 30) rows, as splits.split_validation
  assert data.source == "files" and data.num_features == D and data.num_labels == K
  for part, rows in ((data.train, ~held), (data.validation, held)):
    assert isinstance(part.features, np.ndarray) and part.features.dtype == np.float32
    np.testing.assert_allclose(part.features, x[rows], rtol=1e-6)
    _same_csr(part.labels, y[np.flatnonzero(rows)])
  np.testing.assert_array_equal(data.label_counts, np.bincount(y.indices, minlength=K))
  assert data.train_file_points == N and data.test.num_points == 11
  assert "nnz/pt=6.00" in repr(data.test)


@pytest.mark.parametrize("setup,field,match", [
    (lambda c, p: c.dataset.files.update(train_labels=""), "dataset.files.train_labels", "needs the path of a file"),
    (lambda c, p: c.dataset.files.update(test_features=str(p / "nope.npy")), "dataset.files.test_features",
     "no such file: .*nope.npy"),
    (lambda c, p: c.dataset.update(name="bibtex"), "dataset.name",
     "dataset.files.train_features is set but dataset.name is 'bibtex'"),
    (lambda c, p: c.model.update(kind="mlp", num_hidden_layers=-1), "model.num_hidden_layers", "integer >= 0"),
    (lambda c, p: c.model.update(kind="mlp", num_hidden_layers=0, dropout=0.5), "model.dropout", "no hidden layer"),
    (lambda c, p: (c.model.update(kind="mlp"), c.mining.update(sampler="tree"), c.loss.update(kind="adversarial_ns")),
     "mining.sampler", "tree sampler projects sparse batches"),
    (lambda c, p: (c.model.update(kind="mlp"), c.table.update(init_scale=0.0)), "table.init_scale",
     "model.kind=mlp normalises the rows"),
])
def test_config_errors_name_the_field_before_any_file_is_read(tmp_path, setup, field, match):
  _write_split(tmp_path, "train")
  _write_split(tmp_path, "test", seed=1)
  c = _files_config(tmp_path)
  validation.validate(c)  # the good config passes
  setup(c, tmp_path)
  with pytest.raises(ConfigError, match=match) as info:
    validation.validate(c)
  assert info.value.field == field


def test_mlp_scores_are_cosines():
  c = common.base_config()
  c.model.kind = "mlp"
  assert builders.resolve_normalize_classes(c) and builders.table_init_scale(c) == c.table.init_scale
  assert builders.dense_inputs(c)
  c.model.kind = "snm_tower"
  assert not builders.dense_inputs(c)


def test_train_py_stops_on_a_malformed_file_with_one_line_naming_it(tmp_path):
  _write_split(tmp_path, "train")
  _write_split(tmp_path, "test", seed=1)
  np.save(tmp_path / "test_x.npy", _nan_features())
  args = [f"--config.dataset.files.{s}_{w}={tmp_path / f'{s}_{a}'}"
          for s in ("train", "test") for w, a in (("features", "x.npy"), ("labels", "y.npz"))]
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config=experiments/configs/default.py:paper,runlocal",
       "--config.dataset.name=files", "--config.model.kind=mlp", "--config.mesh.shape=(1,1)", *args,
       f"--workdir={tmp_path / 'run'}"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: {tmp_path / 'test_x.npy'}: non-finite feature value"), proc.stderr
  assert "row 3, column 2" in last and "Traceback" not in proc.stderr
