"""Tests of the input pipeline: padded batches, process slicing, resumption, device assembly."""
import json
import logging

import jax
import numpy as np
import pytest
import scipy.sparse as sp

from snm_jax.data import conversions
from snm_jax.data import device_rows
from snm_jax.data import pipeline
from snm_jax import sharding


def _toy(n=53, d=40, k=9, seed=0):
  rng = np.random.default_rng(seed)
  lens = rng.integers(0, 14, n)
  lens[[2, 7]] = [20, 25]  # two rows longer than max_nnz=16
  rows = np.repeat(np.arange(n), lens)
  cols = np.concatenate([rng.permutation(d)[:m] for m in lens])
  feats = sp.csr_matrix((rng.standard_normal(rows.size).astype(np.float32), (rows, cols)),
                        shape=(n, d))
  lab_lens = rng.integers(0, 4, n)
  lab_lens[5] = 6  # one label set longer than max_labels=4
  lab_idx = np.concatenate([rng.permutation(k)[:m] for m in lab_lens]).astype(np.int32)
  labels = sp.csr_matrix((np.ones(lab_idx.size, np.float32), lab_idx,
                          np.concatenate([[0], np.cumsum(lab_lens)])), shape=(n, k))
  return feats, labels


def _batcher(feats, labels, **kw):
  args = dict(examples="sample_one_positive", global_batch_size=8, max_nnz=16, max_labels=4,
              seed=3, process_index=0, process_count=1)
  args.update(kw)
  return pipeline.SparseBatcher(feats, labels, args.pop("examples"), **args)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _concat(parts):
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def test_batch_contents_match_the_csr_rows():
  feats, labels = _toy()
  b = _batcher(feats, labels)
  steps = b.steps_per_epoch(0)
  seen = []
  for batch in _take(b, steps):
    assert batch["feat_ids"].shape == (8, 16) and batch["feat_ids"].dtype == np.int32
    assert batch["feat_vals"].dtype == np.float32 and batch["label_set"].shape == (8, 4)
    assert batch["label"].dtype == np.int32 and batch["valid"].dtype == bool
    for r in range(8):
      if not batch["valid"][r]:
        assert batch["example_id"][r] == -1 and np.all(batch["feat_vals"][r] == 0)
        assert np.all(batch["feat_ids"][r] == 0) and np.all(batch["label_set"][r] == -1)
        continue
      i = batch["example_id"][r]
      seen.append(i)
      row = feats.getrow(i)
      # Reference truncation: the 16 largest |values|.
      keep = np.argsort(-np.abs(row.data), kind="stable")[:16]
      want = dict(zip(row.indices[keep].tolist(), row.data[keep].tolist()))
      m = batch["feat_vals"][r] != 0
      got = dict(zip(batch["feat_ids"][r][m].tolist(), batch["feat_vals"][r][m].tolist()))
      assert got == want
      lab = labels.indices[labels.indptr[i]:labels.indptr[i + 1]].tolist()
      ls = batch["label_set"][r]
      assert ls[ls >= 0].tolist() == lab[:4]
      assert batch["label"][r] in lab
  # Every point with a label appears exactly once per epoch.
  assert sorted(seen) == np.flatnonzero(np.diff(labels.indptr) > 0).tolist()
  st = b.stats
  assert st["epoch"] == 1 and st["epoch_examples"] == 0  # stats reset after the epoch
  assert st["dataset_rows_truncated"] == 2 and st["dataset_nnz_dropped"] == (20 - 16) + (25 - 16)
  assert st["dataset_label_sets_truncated"] == 1 and st["dataset_labels_dropped"] == 2


@pytest.mark.parametrize("examples,kw", [
    ("sample_one_positive", {}),                         # the per-row conversion, drawn per epoch
    ("expand_all_positives", {"process_index": 1, "process_count": 2}),  # fixed examples, a slice
    (None, {"global_batch_size": 12}),                   # evaluation: every row, a partial last batch
])
def test_rows_padded_once_give_the_batches_padded_per_batch(monkeypatch, examples, kw):
  """The in-memory rows padded once and gathered per batch (`_padded_rows`) against every batch
  padded from its CSR rows (PADDED_ROWS_MAX_BYTES = 0): the same arrays and truncation counts,
  two epochs, with truncated rows and label sets, and after the widths change (as a candidate
  group widens its members' batches)."""
  feats, labels = _toy()
  kw = {"examples": examples, **kw}

  def batches(batcher, steps):
    out = []
    for step in range(steps):
      batch, counts = batcher._build(step)  # pylint: disable=protected-access
      out.append((batch, counts))
    return out

  fast = _batcher(feats, labels, **kw)
  steps = 2 * fast.steps_per_epoch()
  got = batches(fast, steps)
  assert fast._padded is not None  # pylint: disable=protected-access
  fast.max_nnz, fast.max_labels = 24, 8
  got_wider = batches(fast, steps)
  monkeypatch.setattr(pipeline.SparseBatcher, "PADDED_ROWS_MAX_BYTES", 0)
  slow = _batcher(feats, labels, **kw)
  want = batches(slow, steps)
  assert slow._padded is None  # pylint: disable=protected-access
  slow.max_nnz, slow.max_labels = 24, 8
  want_wider = batches(slow, steps)
  assert any(c["epoch_rows_truncated"] for _, c in want) and any(c["epoch_label_sets_truncated"] for _, c in want)
  for (g, gc), (w, wc) in zip(got + got_wider, want + want_wider, strict=True):
    assert gc == wc and g.keys() == w.keys()
    for name in w:
      assert g[name].dtype == w[name].dtype, name
      np.testing.assert_array_equal(g[name], w[name], err_msg=name)


def test_two_processes_concatenate_to_the_single_process_batches():
  feats, labels = _toy()
  for examples in ("sample_one_positive", "expand_all_positives", None):
    one = _batcher(feats, labels, examples=examples)
    two = [_batcher(feats, labels, examples=examples, process_index=p, process_count=2)
           for p in range(2)]
    n = 3 * one.steps_per_epoch(0) + 1  # three epochs and a bit
    for full, *halves in zip(_take(one, n), *(_take(t, n) for t in two)):
      assert halves[0]["label"].shape == (4,)
      cat = _concat(halves)
      for key in pipeline.BATCH_KEYS:
        np.testing.assert_array_equal(cat[key], full[key], err_msg=key)


def test_epochs_reshuffle_and_resample_deterministically():
  feats, labels = _toy()
  b1, b2 = _batcher(feats, labels), _batcher(feats, labels)
  steps = b1.steps_per_epoch(0)
  e0, e1 = _concat(_take(b1, steps)), _concat(_take(b1, steps))
  same = _concat(_take(b2, steps))
  np.testing.assert_array_equal(e0["example_id"], same["example_id"])
  np.testing.assert_array_equal(e0["label"], same["label"])
  assert not np.array_equal(e0["example_id"], e1["example_id"])
  # Conversion 1 is re-drawn per epoch: compare labels of the same points.
  lab0 = dict(zip(e0["example_id"].tolist(), e0["label"].tolist()))
  lab1 = dict(zip(e1["example_id"].tolist(), e1["label"].tolist()))
  assert any(lab0[i] != lab1[i] for i in lab0 if i >= 0)
  expect = conversions.sample_one_positive(labels, 3, 1)
  for i, y in lab1.items():
    if i >= 0:
      assert y == expect[1][expect[0] == i][0]
  other_seed = _concat(_take(_batcher(feats, labels, seed=4), steps))
  assert not np.array_equal(e0["example_id"], other_seed["example_id"])


def test_state_round_trip_resumes_exactly_and_survives_process_count_change():
  feats, labels = _toy()
  ref = _batcher(feats, labels)
  _take(ref, 9)
  state = json.loads(json.dumps(ref.get_state()))
  assert state["epoch"] == 1 and state["position"] == 9 - ref.steps_per_epoch(0)
  expected = _take(ref, 6)
  resumed = _batcher(feats, labels)
  resumed.set_state(state)
  for a, b in zip(expected, _take(resumed, 6)):
    for key in pipeline.BATCH_KEYS:
      np.testing.assert_array_equal(a[key], b[key])
  halves = [_batcher(feats, labels, process_index=p, process_count=2) for p in range(2)]
  for h in halves:
    h.set_state(state)
  np.testing.assert_array_equal(_concat([next(h) for h in halves])["example_id"],
                                expected[0]["example_id"])
  with pytest.raises(ValueError, match="seed"):
    _batcher(feats, labels, seed=99).set_state(state)


def test_fixed_examples_drop_remainder_and_num_epochs():
  feats, labels = _toy()
  idx, lab = conversions.expand_all_positives(labels)
  b = _batcher(feats, labels, examples=(idx, lab), drop_remainder=True, num_epochs=2,
               shuffle=False)
  batches = list(b)
  assert len(batches) == 2 * (idx.size // 8)
  assert all(bt["valid"].all() for bt in batches)
  first = _concat(batches[:idx.size // 8])
  np.testing.assert_array_equal(first["example_id"], idx[:first["label"].size])
  np.testing.assert_array_equal(first["label"], lab[:first["label"].size])


def test_auto_max_nnz_and_percentile():
  feats, labels = _toy()
  b = _batcher(feats, labels, max_nnz="auto", max_labels="auto")
  assert b.max_nnz == 32 and b.max_labels == 8  # 25 and 6 rounded up to multiples of 8
  assert b.stats["dataset_rows_truncated"] == 0
  row_nnz = np.diff(feats.indptr)
  p90 = pipeline.choose_max_nnz(row_nnz, 90.0, multiple_of=1)
  assert np.mean(row_nnz <= p90) >= 0.9 and np.mean(row_nnz <= p90 - 1) < 0.9
  b = _batcher(feats, labels, max_nnz="auto", nnz_percentile=90.0, pad_multiple=1)
  assert b.max_nnz == p90 and b.stats["dataset_rows_truncated"] == np.sum(row_nnz > p90)


def test_truncation_is_logged_once_per_epoch(caplog):
  feats, labels = _toy()
  caplog.set_level(logging.INFO)
  b = _batcher(feats, labels)
  assert sum("truncates 2 of 53 rows" in r.getMessage() for r in caplog.records) == 1
  _take(b, 2 * b.steps_per_epoch(0))
  per_epoch = [r for r in caplog.records if r.getMessage().startswith("epoch ")]
  assert len(per_epoch) == 2
  assert all(r.levelno == logging.WARNING and "truncated to max_nnz=16" in r.getMessage()
             for r in per_epoch)


def test_an_evaluation_batcher_logs_its_truncation_once_not_per_pass(caplog):
  feats, labels = _toy()
  caplog.set_level(logging.INFO)
  b = _batcher(feats, labels, log_epochs=False, num_epochs=1, shuffle=False)
  for _ in range(3):  # three evaluations replay the same single epoch
    b.set_state({"epoch": 0, "position": 0})
    n = sum(1 for _ in b)
    assert n == b.steps_per_epoch(0)
  assert sum("truncates 2 of 53 rows" in r.getMessage() for r in caplog.records) == 1
  assert not [r for r in caplog.records if r.getMessage().startswith("epoch ")]


def test_make_global_batch_shards_over_the_data_axis():
  feats, labels = _toy()
  local = next(_batcher(feats, labels))
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  glob = pipeline.make_global_batch(local, mesh, "data")
  for key, arr in glob.items():
    np.testing.assert_array_equal(np.asarray(arr), local[key])
    assert arr.sharding.spec == jax.P(("data",))
    for shard in arr.addressable_shards:  # rows 2i, 2i+1 on data index i, replicated on model
      assert shard.data.shape[0] == 2
      np.testing.assert_array_equal(np.asarray(shard.data), local[key][shard.index[0]])
  assert pipeline.process_data_slice(mesh, "data") == (0, 1)


@pytest.mark.parametrize("shape", [(1, 1), (4, 2)])
def test_rows_on_device_give_the_host_batches_with_their_shardings(shape):
  """`DeviceRows`: the batches whose rows cross as indices and are gathered on the devices
  equal the host-built global batches (values, dtypes, shapes and shardings, so a step compiled
  for one takes the other), over two epochs with a partial last batch and truncated rows, for a
  fixed conversion, and after a width change (a candidate group widening its members' batches)."""
  feats, labels = _toy()
  mesh = sharding.make_mesh(shape)  # the runs' mesh (automatic axes)
  for examples in ("sample_one_positive", "expand_all_positives"):
    host = _batcher(feats, labels, examples=examples, global_batch_size=12)
    dev = _batcher(feats, labels, examples=examples, global_batch_size=12, rows_on_device=True)
    rows = device_rows.DeviceRows(dev, mesh)
    steps, padding_rows = 2 * host.steps_per_epoch(), 0
    for step in range(2 * steps):
      if step == steps:
        for b in (host, dev):
          b.max_nnz, b.max_labels = 24, 8
      local = next(dev)
      padding_rows += int(np.sum(local["row"] == feats.shape[0]))
      assert "row" in local and "feat_ids" not in local and "label_set" not in local
      want, got = pipeline.make_global_batch(next(host), mesh), rows.to_global(local)
      assert got.keys() == want.keys()
      for key, arr in want.items():
        assert got[key].dtype == arr.dtype and got[key].shape == arr.shape, key
        assert got[key].sharding == arr.sharding, key
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(arr), err_msg=key)
    assert padding_rows  # the epochs' last batches were partial
  # Rows not padded in memory (over PADDED_ROWS_MAX_BYTES): the batches carry their arrays.
  big = _batcher(feats, labels, rows_on_device=True)
  big.PADDED_ROWS_MAX_BYTES = 0
  assert big.device_tables() is None and "feat_ids" in next(big)


def test_grain_threads_and_workers_yield_the_same_batches_and_track_state():
  feats, labels = _toy()
  ref = _batcher(feats, labels)
  for kw in (dict(read_threads=2, prefetch=3), dict(read_threads=1, workers=2)):
    src = _batcher(feats, labels, **kw)
    for _ in range(7):
      want, got = next(ref), next(src)
      for key in pipeline.BATCH_KEYS:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
      # The state counts the batches handed out, not the ones built ahead.
      assert src.get_state() == ref.get_state()
    src.close()
    ref = _batcher(feats, labels)
  # A finite iterator ends cleanly.
  assert len(list(_batcher(feats, labels, num_epochs=1, read_threads=2))) == ref.steps_per_epoch(0)


def test_bad_arguments():
  feats, labels = _toy()
  with pytest.raises(ValueError, match="multiple of process_count"):
    _batcher(feats, labels, global_batch_size=9, process_count=2)
  with pytest.raises(ValueError, match="process_index"):
    _batcher(feats, labels, process_index=2, process_count=2)
  with pytest.raises(ValueError, match="fewer than one global batch"):
    next(_batcher(feats, labels, global_batch_size=1000, drop_remainder=True))


_WORKER = r'''
import os, sys
pid, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=60)
import numpy as np
import scipy.sparse as sp
from snm_jax.data import device_rows, pipeline

feats = sp.random(61, 30, density=0.2, format="csr", random_state=0, dtype=np.float32)
labels = sp.random(61, 7, density=0.3, format="csr", random_state=1, dtype=np.float32)
for shape, axes in (((8,), ("data",)), ((4, 2), ("data", "model"))):
  mesh = jax.make_mesh(shape, axes)
  index, count = pipeline.process_data_slice(mesh, "data")
  assert (index, count) == (pid, 2), (index, count)
  kw = dict(global_batch_size=16, max_nnz=8, max_labels=4, seed=5)
  mine = pipeline.SparseBatcher(feats, labels, "sample_one_positive", process_index=index,
                                process_count=count, **kw)
  ref = pipeline.SparseBatcher(feats, labels, "sample_one_positive", process_index=0,
                               process_count=1, **kw)
  auto = jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  on_device = pipeline.SparseBatcher(feats, labels, "sample_one_positive", process_index=index,
                                     process_count=count, rows_on_device=True, **kw)
  rows = device_rows.DeviceRows(on_device, auto)  # each process's rows gathered on its devices
  for step in range(6):  # crosses an epoch boundary (4 batches per epoch)
    want = next(ref)
    for got in (pipeline.make_global_batch(next(mine), mesh), rows.to_global(next(on_device))):
      assert got.keys() == want.keys()
      for key, arr in got.items():
        assert arr.shape == want[key].shape, (key, arr.shape)
        for shard in arr.addressable_shards:
          np.testing.assert_array_equal(np.asarray(shard.data), want[key][shard.index[0]])
print("OK", pid)
'''


@pytest.mark.multiprocess
def test_two_real_jax_processes_assemble_the_single_process_global_batch(tmp_path):
  """Two `jax.distributed` CPU processes (4 devices each) each read their slice."""
  import os
  import socket
  import subprocess
  import sys

  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=120)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0 and f"OK {i}" in out, out[-3000:]
