"""Tests of the four multilabel -> multiclass conversions on a hand-made dataset."""
import numpy as np
import pytest
import scipy.sparse as sp

from snm_jax.data import conversions


def _labels(lists, k=5):
  """CSR with the given per-row label lists, stored in the given (unsorted) order."""
  indptr = np.concatenate([[0], np.cumsum([len(l) for l in lists])])
  idx = np.array([y for l in lists for y in l], np.int32)
  return sp.csr_matrix((np.ones(idx.size, np.float32), idx, indptr), shape=(len(lists), k))


# Row 0: [3, 1]; row 1: no label; row 2: [2]; row 3: [0, 4, 2] (stored in this order).
LISTS = [[3, 1], [], [2], [4, 0, 2]]


def test_expand_all_positives():
  idx, lab = conversions.expand_all_positives(_labels(LISTS))
  assert idx.tolist() == [0, 0, 2, 3, 3, 3]
  assert lab.tolist() == [3, 1, 2, 4, 0, 2]
  assert idx.dtype == np.int32 and lab.dtype == np.int32


def test_first_label():
  idx, lab = conversions.first_label(_labels(LISTS))
  assert idx.tolist() == [0, 2, 3]
  assert lab.tolist() == [3, 2, 4]


def test_smallest_label_drop_empty():
  idx, lab = conversions.smallest_label_drop_empty(_labels(LISTS))
  assert idx.tolist() == [0, 2, 3]
  assert lab.tolist() == [1, 2, 0]


def test_first_and_smallest_agree_on_sorted_lists():
  sorted_lists = [sorted(l) for l in LISTS]
  a = conversions.first_label(_labels(sorted_lists))
  b = conversions.smallest_label_drop_empty(_labels(sorted_lists))
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])


def test_empty_label_matrix():
  labels = _labels([[], []])
  for name in ("expand_all_positives", "first_label", "smallest_label_drop_empty"):
    idx, lab = conversions.CONVERSIONS[name](labels)
    assert idx.size == 0 and lab.size == 0
  assert conversions.sample_one_positive(labels, 0, 0)[0].size == 0


def test_sample_one_positive_membership_determinism_and_resampling():
  labels = _labels(LISTS)
  idx, lab = conversions.sample_one_positive(labels, seed=7, epoch=0)
  assert idx.tolist() == [0, 2, 3]
  for i, y in zip(idx, lab):
    assert y in LISTS[i]
  again = conversions.sample_one_positive(labels, seed=7, epoch=0)
  np.testing.assert_array_equal(lab, again[1])
  # Across epochs the draw for row 3 (three labels) changes at least once.
  draws = {tuple(conversions.sample_one_positive(labels, 7, e)[1]) for e in range(20)}
  assert len(draws) > 1


def test_sample_one_positive_is_uniform():
  n = 30000
  labels = _labels([[4, 0, 2]] * n)
  _, lab = conversions.sample_one_positive(labels, seed=3, epoch=5)
  freq = np.bincount(lab, minlength=5) / n
  # Each of the three labels: 1/3 +- 4 standard errors (sqrt(2/9/n) ~ 0.0027).
  np.testing.assert_allclose(freq[[0, 2, 4]], 1 / 3, atol=0.011)
  assert freq[1] == 0 and freq[3] == 0


def test_conversion_fn():
  labels = _labels(LISTS)
  fn = conversions.conversion_fn("sample_one_positive", labels, seed=7)
  np.testing.assert_array_equal(fn(2)[1], conversions.sample_one_positive(labels, 7, 2)[1])
  fixed = conversions.conversion_fn("first_label", labels)
  assert fixed(0)[1].tolist() == fixed(9)[1].tolist() == [3, 2, 4]
  with pytest.raises(ValueError, match="unknown conversion"):
    conversions.conversion_fn("nope", labels)
