"""Reader leniencies that used to return wrong data or blame the wrong line
(issue "Reliability"): digit separators in values, a blank line in the middle
of a file, and header dimensions beyond int32 ids."""

import pytest

from snm_jax.data import xc_format
from snm_jax.errors import DataFormatError


@pytest.mark.parametrize("name,content,line,words", [
    # float("1_5") == 15.0 in Python; the format has no digit separators.
    ("underscore_value", b"2 4 2\n0 0:1\n1 1:1_5\n", 3, "malformed value '1_5'"),
    ("underscore_value_first_pair", b"1 4 2\n0 0:2_0 1:1\n", 2, "malformed value '2_0'"),
    ("underscore_id", b"1 40 2\n0 1_5:1\n", 2, "malformed feature pair '1_5:1'"),
    ("underscore_label", b"1 4 20\n1_5 0:1\n", 2, "malformed label id '1_5'"),
    # A blank line in the middle is read as an empty point; the count then overflows at the end,
    # and the error names the blank line, not the last one.
    ("blank_line_mid_file", b"3 4 2\n0 0:1\n\n1 1:1\n1 2:1\n", 3, "blank line"),
    ("whitespace_line_mid_file", b"2 4 2\n0 0:1\n  \n1 1:1\n", 3, "blank line"),
    # Ids are int32: a header dimension above 2^31 is refused at the header.
    ("header_d_overflow", b"1 3000000000 5\n0 2999999999:1\n", 1, "num_features=3000000000 exceeds 2^31"),
    ("header_k_overflow", b"1 3 2147483649\n0 0:1\n", 1, "num_labels=2147483649 exceeds 2^31"),
])
def test_strict_reader_errors_name_the_line(tmp_path, name, content, line, words):
  path = tmp_path / f"{name}.txt"
  path.write_bytes(content)
  with pytest.raises(DataFormatError) as info:
    xc_format.read_xc(path)
  assert info.value.line == line, str(info.value)
  assert words in str(info.value), str(info.value)
  assert str(info.value).startswith(f"{path}:{line}: ")


def test_pair_file_blank_line_and_underscore(tmp_path):
  path = tmp_path / "X.txt"
  path.write_bytes(b"2 3\n0:1\n\n1:1\n")
  with pytest.raises(DataFormatError, match="blank line") as info:
    xc_format.read_sparse_matrix(path)
  assert info.value.line == 3
  path.write_bytes(b"1 3\n0:1_0\n")
  with pytest.raises(DataFormatError, match="malformed value '1_0'"):
    xc_format.read_sparse_matrix(path)
  path.write_bytes(b"1 4294967296\n0:1\n")
  with pytest.raises(DataFormatError, match="num_cols=4294967296 exceeds"):
    xc_format.read_sparse_matrix(path)


def test_still_accepted_empty_points_and_largest_int32_dimension(tmp_path):
  # A blank line is an empty point when the count matches the header (write_xc writes them so),
  # and blank lines after the last point are ignored.
  path = tmp_path / "x.txt"
  path.write_bytes(b"3 4 2\n0 0:1\n\n1 1:1.5e0\n\n\n")
  feats, labels = xc_format.read_xc(path)
  assert feats.shape == (3, 4) and feats.nnz == 2 and labels.getnnz(axis=1).tolist() == [1, 0, 1]
  path.write_bytes(b"1 2147483648 3\n0 2147483647:1\n")
  feats, _ = xc_format.read_xc(path)
  assert feats.shape == (1, 2**31) and feats.indices.tolist() == [2**31 - 1]
