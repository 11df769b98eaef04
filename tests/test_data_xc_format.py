"""Tests of the Extreme Classification text format reader/writer (snm_jax.data.xc_format)."""
import gzip
import zlib

import numpy as np
import pytest
import scipy.sparse as sp

from snm_jax.data import xc_format
from snm_jax.errors import DataFormatError


def _random_xc(rng, n=40, d=30, k=12):
  """Random features (mixed integral/fractional float32) and unsorted label lists."""
  feats = sp.random(n, d, density=0.2, format="csr", random_state=rng, dtype=np.float32)
  feats.data = np.where(rng.random(feats.nnz) < 0.5, rng.integers(1, 5, feats.nnz),
                        rng.standard_normal(feats.nnz) * 1e3).astype(np.float32)
  keep = np.ones(n, np.float32)
  keep[3] = 0  # a point without features
  feats = sp.csr_matrix(sp.diags(keep) @ feats)
  feats.eliminate_zeros()
  rows, cols = [], []
  for i in range(n):
    if i in (3, 5):  # 3: no features and no labels; 5: no labels
      continue
    labs = rng.permutation(k)[:rng.integers(1, 4)]
    rows += [i] * labs.size
    cols += labs.tolist()
  indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))])
  labels = sp.csr_matrix((np.ones(len(cols), np.float32), np.array(cols, np.int32), indptr),
                         shape=(n, k))
  return feats, labels


@pytest.mark.parametrize("suffix", [".txt", ".txt.gz"])
def test_round_trip_exact_values_and_label_order(tmp_path, suffix):
  feats, labels = _random_xc(np.random.default_rng(0))
  path = tmp_path / f"data{suffix}"
  xc_format.write_xc(path, feats, labels)
  f2, l2 = xc_format.read_xc(path)
  assert f2.shape == feats.shape and l2.shape == labels.shape
  assert f2.dtype == np.float32 and l2.dtype == np.float32
  np.testing.assert_array_equal(f2.indptr, feats.indptr)
  np.testing.assert_array_equal(f2.indices, feats.indices)
  np.testing.assert_array_equal(f2.data, feats.data)  # bit-exact float32
  np.testing.assert_array_equal(l2.indptr, labels.indptr)
  np.testing.assert_array_equal(l2.indices, labels.indices)  # file order kept, unsorted
  assert any(np.any(np.diff(labels.indices[lo:hi]) < 0)  # the data has unsorted lists
             for lo, hi in zip(labels.indptr[:-1], labels.indptr[1:]))
  # Writing what was read reproduces the file byte for byte.
  path2 = tmp_path / f"again{suffix}"
  xc_format.write_xc(path2, f2, l2)
  opener = gzip.open if suffix.endswith(".gz") else open
  with opener(path, "rb") as a, opener(path2, "rb") as b:
    assert a.read() == b.read()


def test_exact_text_of_hand_written_file(tmp_path):
  text = b"4 5 3\n2,0 0:1 3:0.5\n 1:2\n1\n\n"
  path = tmp_path / "x.txt"
  path.write_bytes(text)
  feats, labels = xc_format.read_xc(path)
  np.testing.assert_array_equal(feats.toarray(), [[1, 0, 0, 0.5, 0], [0, 2, 0, 0, 0],
                                                  [0] * 5, [0] * 5])
  assert labels.indices.tolist() == [2, 0, 1]  # row 0 keeps the order "2,0"
  assert np.diff(labels.indptr).tolist() == [2, 0, 1, 0]
  out = tmp_path / "y.txt"
  xc_format.write_xc(out, feats, labels)
  assert out.read_bytes() == text


def test_crlf_tabs_and_missing_leading_space_are_accepted(tmp_path):
  path = tmp_path / "x.txt"
  path.write_bytes(b"3 4 2\r\n0,1\t2:1.5\r\n3:2\r\n1 0:1  1:1\r\n")
  feats, labels = xc_format.read_xc(path)
  np.testing.assert_array_equal(feats.toarray(), [[0, 0, 1.5, 0], [0, 0, 0, 2], [1, 1, 0, 0]])
  np.testing.assert_array_equal(labels.toarray(), [[1, 1], [0, 0], [0, 1]])


def test_xy_pair_and_split_file_round_trip(tmp_path):
  feats, labels = _random_xc(np.random.default_rng(1), n=10)
  xc_format.write_sparse_matrix(tmp_path / "X.txt", feats)
  xc_format.write_sparse_matrix(tmp_path / "Y.txt.gz", labels)
  f2, l2 = xc_format.read_xc_pair(tmp_path / "X.txt", tmp_path / "Y.txt.gz")
  np.testing.assert_array_equal(f2.toarray(), feats.toarray())
  np.testing.assert_array_equal(l2.toarray(), labels.toarray())
  (tmp_path / "split.txt").write_text("3 1\n1 2\n10 4\n")
  np.testing.assert_array_equal(xc_format.read_split_indices(tmp_path / "split.txt", 10),
                                [2, 0, 9])
  np.testing.assert_array_equal(
      xc_format.read_split_indices(tmp_path / "split.txt", 10, column=1), [0, 1, 3])


def _truncated_gzip(lines_ok: bytes) -> bytes:
  """Gzip stream whose first part (`lines_ok`) is decodable and then stops mid-stream."""
  comp = zlib.compressobj(9, zlib.DEFLATED, 31)
  return comp.compress(lines_ok) + comp.flush(zlib.Z_SYNC_FLUSH)


# (case name, file bytes, gzip it?, expected 1-based line, words expected in the message)
_MALFORMED = [
    ("empty_file", b"", False, 1, "empty file"),
    ("empty_gzip", b"", True, 1, "empty file"),
    ("header_missing", b"0,1 0:1 2:1\n1 1:1\n", False, 1, "header line missing"),
    ("header_non_numeric", b"two 3 2\n0 0:1\n", False, 1, "header must be 3"),
    ("header_two_numbers", b"2 3\n0 0:1\n1 1:1\n", False, 1, "header must be 3"),
    ("header_negative", b"-1 3 2\n", False, 1, "header must be 3"),
    ("fewer_points_than_header", b"3 4 2\n0 0:1\n1 1:1\n", False, 4, "ends after 2 rows"),
    ("more_points_than_header", b"1 4 2\n0 0:1\n1 1:1\n", False, 3, "more points"),
    ("feature_id_out_of_range", b"2 4 2\n0 0:1\n1 4:1\n", False, 3, "feature id 4 out of range"),
    ("label_id_out_of_range", b"2 4 2\n0 0:1\n2 1:1\n", False, 3, "label id 2 out of range"),
    ("pair_without_colon", b"2 4 2\n0 0:1 3\n1 1:1\n", False, 2, "malformed feature pair '3'"),
    ("pair_two_colons", b"2 4 2\n0 0:1\n1 1:2:3\n", False, 3, "malformed feature pair"),
    ("pair_empty_value", b"2 4 2\n0 0:\n1 1:1\n", False, 2, "malformed value ''"),
    ("value_not_a_number", b"2 4 2\n0 0:1\n1 1:abc\n", False, 3, "malformed value 'abc'"),
    ("value_nan", b"3 4 2\n0 0:1\n1 1:1\n0 2:nan\n", False, 4, "non-finite value nan"),
    ("value_inf", b"2 4 2\n0 0:-inf\n1 1:1\n", False, 2, "non-finite value -inf"),
    ("value_overflows_float32", b"2 4 2\n0 0:1\n1 1:1e39\n", False, 3, "overflows float32"),
    ("negative_feature_id", b"2 4 2\n0 -1:1\n1 1:1\n", False, 2, "malformed feature pair"),
    ("label_not_integer", b"2 4 2\n0,x 0:1\n1 1:1\n", False, 2, "malformed label id 'x'"),
    ("empty_label_in_list", b"2 4 2\n0,,1 0:1\n1 1:1\n", False, 2, "malformed label id ''"),
    ("duplicate_feature_id", b"2 4 2\n0 0:1\n1 1:1 1:2\n", False, 3, "duplicate feature id"),
    ("duplicate_label_id", b"2 4 2\n1,1 0:1\n1 1:1\n", False, 2, "duplicate label id"),
    ("bad_line_inside_gzip", b"2 4 2\n0 0:1\n1 9:1\n", True, 3, "feature id 9 out of range"),
    ("truncated_gzip", _truncated_gzip(b"5 4 2\n0 0:1\n1 1:1\n"), False, 4, "truncated"),
    ("corrupt_gzip", b"\x1f\x8b\x08\x00garbage-not-deflate-data", False, 1, "gzip"),
]


@pytest.mark.parametrize("name,content,compress,line,words", _MALFORMED,
                         ids=[c[0] for c in _MALFORMED])
def test_malformed_file_raises_typed_error_with_line(tmp_path, name, content, compress, line,
                                                     words):
  path = tmp_path / (name + (".txt.gz" if compress else ".txt"))
  path.write_bytes(gzip.compress(content) if compress else content)
  with pytest.raises(DataFormatError) as info:
    xc_format.read_xc(path)
  err = info.value
  assert type(err) is DataFormatError
  assert err.line == line, str(err)
  assert err.path == str(path)
  assert words in str(err), str(err)
  assert str(err).startswith(f"{path}:{line}: ")


@pytest.mark.parametrize("reader,content,line,words", [
    ("matrix", b"2 3 1\n0:1\n", 1, "header must be 2"),
    ("matrix", b"2 3\n0:1\n3:1\n", 3, "column id 3 out of range"),
    ("matrix", b"2 3\n0:1\n", 3, "ends after 1 rows"),
    ("split", b"1\n0\n", 2, "point index 0 out of range"),
    ("split", b"1\n11\n", 2, "point index 11 out of range"),
    ("split", b"", 1, "empty split file"),
])
def test_malformed_pair_and_split_files(tmp_path, reader, content, line, words):
  path = tmp_path / "f.txt"
  path.write_bytes(content)
  with pytest.raises(DataFormatError) as info:
    if reader == "matrix":
      xc_format.read_sparse_matrix(path)
    else:
      xc_format.read_split_indices(path, num_points=10)
  assert info.value.line == line and words in str(info.value), str(info.value)


def test_pair_rows_mismatch_names_label_file(tmp_path):
  (tmp_path / "X.txt").write_bytes(b"2 3\n0:1\n1:1\n")
  (tmp_path / "Y.txt").write_bytes(b"1 2\n0:1\n")
  with pytest.raises(DataFormatError, match="1 rows but the feature file"):
    xc_format.read_xc_pair(tmp_path / "X.txt", tmp_path / "Y.txt")
