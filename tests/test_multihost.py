"""Multi-host correctness without a cluster: `python -m experiments.train` run as
2 processes x 2 CPU devices through launch/local_multiprocess.sh agrees with the
1-process run of the same config on 4 devices.

Two layouts of the 4 global devices are checked (make_mesh puts a process's
devices along the model axis first):
  * mesh (2, 2): the data axis spans the processes (each feeds half of every
    batch; the tower gradients are all-reduced across processes);
  * mesh (1, 4): the model axis spans the processes (the class table is split
    between the processes; the mined top-k candidates and the loss psums cross
    processes; both processes feed the same rows).
Same mesh, same arithmetic order: every reduction has the same operands in the
same order, so the comparison is bitwise (loss curve, final metrics, and the
checkpointed state restored here from the multi-process run's orbax checkpoint).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from snm_jax.train.trainer.checkpointing import Checkpointer, abstract_like
from snm_jax.train.trainer.loop import train_and_evaluate
import run_configs

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch" / "local_multiprocess.sh"
MESHES = ((2, 2), (1, 4))
OVERRIDES = {"train.num_steps": 6, "train.log_every": 2, "train.eval_every": 0,
             "train.checkpoint_every": 0}


def _config(mesh_shape):
  return run_configs.runlocal({"mesh.shape": mesh_shape, **OVERRIDES})


def _launch(mesh_shape, workdir: Path) -> subprocess.Popen:
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  cmd = ["bash", str(LAUNCH), "2", "--devices-per-process", "2", "--timeout", "240",
         "--log-dir", str(workdir.parent / f"{workdir.name}_logs"), "--",
         "experiments.train", "--config=experiments/configs/default.py:paper,runlocal",
         f"--config.mesh.shape=({mesh_shape[0]},{mesh_shape[1]})", *flags, f"--workdir={workdir}"]
  env = {**os.environ, "PYTHON": sys.executable}
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def _losses(workdir: Path) -> list:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Both 2-process runs (started first, in the background) and their 1-process references."""
  root = tmp_path_factory.mktemp("multihost")
  procs = {m: _launch(m, root / f"mp_{m[0]}x{m[1]}") for m in MESHES}
  refs = {}
  for m in MESHES:
    results, state = train_and_evaluate(_config(m), root / f"ref_{m[0]}x{m[1]}", return_state=True)
    refs[m] = {**results, "state": state}
  out = {}
  for m, p in procs.items():
    try:
      log, _ = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
      p.terminate()  # the launcher's trap stops its own children
      log, _ = p.communicate()
    out[m] = (p.returncode, log, root / f"mp_{m[0]}x{m[1]}", refs[m], root / f"ref_{m[0]}x{m[1]}")
  return out


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: f"mesh{m[0]}x{m[1]}")
def test_two_processes_match_one_process_bitwise(runs, mesh_shape):
  rc, log, mp_dir, ref, ref_dir = runs[mesh_shape]
  assert rc == 0, log
  assert "all 2 processes finished successfully" in log
  mp = json.loads((mp_dir / "results.json").read_text())
  assert mp["num_processes"] == 2 and ref["num_processes"] == 1
  assert mp["mesh"] == ref["mesh"] == {"data": mesh_shape[0], "model": mesh_shape[1]}
  assert mp["steps"] == ref["steps"] == OVERRIDES["train.num_steps"]

  # Loss curve and final metrics: bitwise (floats survive the JSON round trip exactly).
  assert _losses(mp_dir) == _losses(ref_dir) and len(_losses(mp_dir)) == 3
  for name in ("P@1", "P@3", "P@5", "nDCG@5", "PSP@5", "recall@r"):
    assert mp["final"][name] == ref["final"][name], name
  if "state_fingerprint" in mp and "state_fingerprint" in ref:
    assert mp["state_fingerprint"] == ref["state_fingerprint"]

  # The checkpoint written by both processes together restores here, onto the
  # reference's shardings, to exactly the reference's final state.
  ckpt = Checkpointer(mp_dir / "checkpoints", async_save=False)
  step, restored, data_state = ckpt.restore_latest(abstract_like(ref["state"]))
  ckpt.close()
  assert step == OVERRIDES["train.num_steps"]
  assert data_state["iterator"]["position"] == OVERRIDES["train.num_steps"]
  leaves_mp, leaves_ref = jax.tree.leaves(restored), jax.tree.leaves(ref["state"])
  assert len(leaves_mp) == len(leaves_ref)
  for a, b in zip(leaves_mp, leaves_ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Training really moved the table away from its initialisation (seed 0, scale 1).
  init_table = jax.random.normal(jax.random.split(jax.random.key(0))[1], ref["state"].table.shape)
  moved = np.abs(np.asarray(restored.table) - np.asarray(init_table)).max(axis=1) > 1e-4
  assert moved.sum() >= 20, moved.sum()
