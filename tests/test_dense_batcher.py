"""DenseBatcher: dense (n, d) rows with SparseBatcher's examples, order, process slicing and
resumable state."""
import json

import jax
import numpy as np
import pytest
import scipy.sparse as sp

from snm_jax import sharding
from snm_jax.data import pipeline

N, D, K = 53, 12, 9


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, D)).astype(np.float32)
  lab_lens = rng.integers(0, 4, N)
  lab_lens[5] = 6  # one label set longer than max_labels=4
  idx = np.concatenate([rng.permutation(K)[:m] for m in lab_lens]).astype(np.int32)
  labels = sp.csr_matrix((np.ones(idx.size, np.float32), idx, np.concatenate([[0], np.cumsum(lab_lens)])),
                         shape=(N, K))
  return x, labels


def _make(cls, x, labels, **kw):
  args = dict(examples="sample_one_positive", global_batch_size=8, max_labels=4, seed=3,
              process_index=0, process_count=1)
  args.update(kw)
  return cls(x, labels, args.pop("examples"), **args)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _concat(parts):
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.parametrize("as_csr", [False, True])
def test_rows_are_the_feature_rows_and_the_rest_is_sparse_batchers(as_csr):
  x, labels = _data()
  dense = _make(pipeline.DenseBatcher, sp.csr_matrix(x) if as_csr else x, labels)
  ref = _make(pipeline.SparseBatcher, sp.csr_matrix(x), labels, max_nnz=D)
  steps = dense.steps_per_epoch(0)
  assert steps == ref.steps_per_epoch(0) == -(-np.count_nonzero(np.diff(labels.indptr)) // 8)
  for got, want in zip(_take(dense, 2 * steps + 1), _take(ref, 2 * steps + 1)):  # two epochs and a bit
    assert set(got) == set(pipeline.DENSE_BATCH_KEYS)
    assert got["features"].shape == (8, D) and got["features"].dtype == np.float32
    for key in ("label", "label_set", "valid", "example_id"):
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    rows = got["example_id"][got["valid"]]
    np.testing.assert_array_equal(got["features"][got["valid"]], x[rows])
    assert (got["features"][~got["valid"]] == 0).all()
    # The sparse batch's padded row, scattered back, is the same dense row.
    back = np.zeros((8, D), np.float32)
    np.add.at(back, (np.arange(8)[:, None], want["feat_ids"]), want["feat_vals"])
    np.testing.assert_array_equal(back, got["features"])
  assert dense.max_nnz == D and dense.max_labels == 4
  st = dense.stats
  assert st["dataset_rows_truncated"] == 0 and st["dataset_nnz"] == N * D
  assert st["dataset_label_sets_truncated"] == 1 and st["dataset_labels_dropped"] == 2
  inputs = dense.example_inputs()
  assert len(inputs) == 1 and inputs[0].shape == (1, D) and inputs[0].dtype == np.float32


def test_a_float32_array_is_kept_without_a_copy():
  x, labels = _data()
  assert _make(pipeline.DenseBatcher, x, labels).features is x
  with pytest.raises(ValueError, match="2-D"):
    _make(pipeline.DenseBatcher, x[:, :, None], labels)


def test_two_processes_concatenate_to_the_single_process_batches():
  x, labels = _data()
  for examples in ("sample_one_positive", "expand_all_positives", None):
    one = _make(pipeline.DenseBatcher, x, labels, examples=examples)
    two = [_make(pipeline.DenseBatcher, x, labels, examples=examples, process_index=p, process_count=2)
           for p in range(2)]
    n = 2 * one.steps_per_epoch(0) + 1
    for full, *halves in zip(_take(one, n), *(_take(t, n) for t in two)):
      assert halves[0]["features"].shape == (4, D)
      cat = _concat(halves)
      for key in pipeline.DENSE_BATCH_KEYS:
        np.testing.assert_array_equal(cat[key], full[key], err_msg=key)


def test_state_round_trip_resumes_exactly_and_survives_process_count_change():
  x, labels = _data()
  ref = _make(pipeline.DenseBatcher, x, labels)
  _take(ref, 9)
  state = json.loads(json.dumps(ref.get_state()))
  assert state["epoch"] == 1 and state["position"] == 9 - ref.steps_per_epoch(0)
  expected = _take(ref, 6)
  resumed = _make(pipeline.DenseBatcher, x, labels)
  resumed.set_state(state)
  for a, b in zip(expected, _take(resumed, 6)):
    for key in pipeline.DENSE_BATCH_KEYS:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)
  halves = [_make(pipeline.DenseBatcher, x, labels, process_index=p, process_count=2) for p in range(2)]
  for h in halves:
    h.set_state(state)
  np.testing.assert_array_equal(_concat([next(h) for h in halves])["features"], expected[0]["features"])
  with pytest.raises(ValueError, match="seed"):
    _make(pipeline.DenseBatcher, x, labels, seed=99).set_state(state)


def test_global_batch_is_sharded_over_the_data_axis_on_8_devices():
  x, labels = _data()
  mesh = sharding.make_mesh((2, 4))
  batch = next(_make(pipeline.DenseBatcher, x, labels))
  global_batch = pipeline.make_global_batch(batch, mesh)
  feats = global_batch["features"]
  assert feats.shape == (8, D) and len(jax.devices()) == 8
  for shard in feats.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), batch["features"][shard.index[0]])
    assert shard.data.shape == (4, D)
