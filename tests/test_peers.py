"""benchmarks/peers.py: the PyTorch step computes the snm-jax step (same loss, same updated
parameters on the same batch and negatives), and the input sweep's sparse step keeps its
compiled temporaries flat in d. Skips the torch part when torch (the `peers` extra) is absent."""

import dataclasses

import jax
import numpy as np
import pytest

from benchmarks import common, peers, step_scaling
from snm_jax import sharding

TINY = peers.Workload(n=16, nnz=4, num_features=500, hidden=16, h=8, b=64, k=4)


@pytest.mark.parametrize("num_labels", [256, 250])  # 250: padded strata, draws >= K are masked
def test_torch_step_equals_the_snm_jax_step(num_labels):
  pytest.importorskip("torch")
  params = peers.initial_params(TINY, num_labels)
  batch = common.random_batch(TINY, num_labels)
  batch["valid"][-1] = False
  out = peers.check_same_step(TINY, num_labels, params, batch)  # raises above the tolerances
  assert out["loss_abs_diff"] <= 1e-5 and out["loss_snm_jax"] > 0
  for name in ("input_table", "proj_kernel", "class_table"):
    assert out[f"{name}_max_abs_update"] > 100 * max(out[f"{name}_max_abs_diff"], 1e-9), name


def test_torch_step_disagreeing_is_caught(monkeypatch):
  torch = pytest.importorskip("torch")
  params = peers.initial_params(TINY, 256)
  batch = common.random_batch(TINY, 256)
  monkeypatch.setattr(peers.TorchStep, "_l2", staticmethod(lambda x: x / torch.linalg.norm(x, dim=-1,
                                                                                           keepdim=True) * 1.01))
  with pytest.raises(AssertionError, match="disagree"):
    peers.check_same_step(TINY, 256, params, batch)


def test_sparse_input_step_temporaries_do_not_grow_with_d():
  """Compiled from abstract shapes only (nothing allocated): XLA's temporaries of the sparse-input
  step (lazy momentum) are the same at d = 10^5 and 10^6, and smaller at d = 10^4 < N nnz, where
  the merge of duplicate ids needs only d + 1 rows (the dense-input step's grow by its d x h
  gradient: the benchmark's input_dense rows)."""
  mesh = sharding.make_mesh((1, 1), devices=jax.devices()[:1])
  s = dataclasses.replace(step_scaling.INPUT_SHAPE, b=512)
  assert 10**4 < s.n * s.nnz < 10**5
  mem = {d: step_scaling.input_bench(s, d, mesh, sparse=True, compile_only=True)
         for d in (10**4, 10**5, 10**6)}
  assert mem[10**6]["temp_bytes"] == mem[10**5]["temp_bytes"] < 3 * s.n * s.nnz * s.h * 4  # O(N nnz h)
  assert mem[10**4]["temp_bytes"] < mem[10**5]["temp_bytes"]
  # The donated tables (input table and its momentum, class table) are updated in place.
  assert mem[10**6]["alias_bytes"] - mem[10**5]["alias_bytes"] == 2 * (10**6 - 10**5) * s.h * 4
  summary = step_scaling.input_summary(
      [{"variant": "input_sparse", "d": d, "time_ms": 1.0, **m} for d, m in mem.items()], s)
  assert summary["target_input_sparse_temps_flat_in_d"]["met"]


def test_input_sweep_times_every_contestant_at_every_d():
  """`run_input_sweep` on a tiny workload: a row per (contestant, d), and each contestant's ratio is
  its own t(max d) / t(min d) from those rows."""
  rows, summary = peers.run_input_sweep(TINY, (300, 3000), num_labels=256, reps=2)
  names = {"snm_jax_sparse_input"} | ({f"torch_threads{t}" for t in peers.TORCH_THREADS}
                                      if peers.torch is not None else set())
  assert {(r["contestant"], r["d"]) for r in rows} == {(n, d) for n in names for d in (300, 3000)}
  at = {(r["contestant"], r["d"]): r["time_ms"] for r in rows}
  assert summary["d"] == (3000, 300)
  assert summary["time_ratio"] == {n: at[(n, 3000)] / at[(n, 300)] for n in names}
  assert all(r["time_ms"] > 0 and r["reps"] == 2 for r in rows)
