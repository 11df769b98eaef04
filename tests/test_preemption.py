"""Preemption and kills on the sharded input path: `python -m experiments.train` sent SIGTERM at a
random moment finishes its step, checkpoints, exits with status 75, and the same command resumes
it to the state of an uninterrupted run (sha256 fingerprint); the same for SIGKILL (resumed from
the last periodic checkpoint), and for two `jax.distributed` processes on loopback, of which
only one receives SIGTERM: both stop at the same step, and the same command resumes them to the
uninterrupted run's state. The uninterrupted runs are trained in process, each while the last CLI
run of its test runs (the two overlap).
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

from snm_jax.data import convert
from snm_jax.train.runtime.preemption import PREEMPTED_EXIT_STATUS
from snm_jax.train.trainer.checkpointing import saved_steps
from snm_jax.train.trainer.loop import train_and_evaluate
import interrupts
import run_configs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 240, 40
STEPS_2P = 160  # the 2-process runs (~4x slower per step than one process: their checkpoints sync)
# One device, compiled as this process compiles (conftest.FAST_COMPILE_FLAGS): the bits compared are alike.
ENV = {**os.environ, "XLA_FLAGS": os.environ["SNM_JAX_TEST_XLA_FLAGS"], "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("preempt_shards")
  convert.convert_synthetic(out, num_rows=3000, num_test_rows=200, num_features=2000, num_labels=200,
                            nnz=16, num_shards=3, chunk_rows=1000)
  return out


def _overrides(shards: Path, mesh=(1, 1), steps=STEPS) -> dict:
  return {"dataset.name": "synthetic_sparse", "dataset.format": "sharded", "dataset.shards": str(shards),
          "mesh.shape": mesh, "train.num_steps": steps, "train.checkpoint_every": EVERY,
          "train.eval_every": 0, "train.log_every": EVERY, "train.keep_checkpoints": 3,
          "eval.max_examples": 0}


def _cmd(workdir, overrides):
  flag = lambda v: f"({v[0]},{v[1]})" if isinstance(v, tuple) else str(v)  # noqa: E731
  return [sys.executable, "-m", "experiments.train", "--config=experiments/configs/default.py:paper,runlocal",
          f"--workdir={workdir}", *[f"--config.{k}={flag(v)}" for k, v in overrides.items()]]


def _checkpoints(workdir: Path) -> list[int]:
  return saved_steps(workdir / "checkpoints")


def _stopped_at(err: str) -> int:
  """The step a SIGTERM'd run says it checkpointed before exiting 75."""
  return int(err.split("checkpoint of step ")[1].split()[0])


@pytest.fixture(scope="module")
def reference(shards_dir, tmp_path_factory):
  """The uninterrupted run's fingerprint, in process (the CLI runs are checked against it): a
  function that trains at its first call (the test calls it once its last CLI run is under way)."""
  return cache(lambda: train_and_evaluate(run_configs.runlocal(_overrides(shards_dir)),
                                          tmp_path_factory.mktemp("ref") / "run")["state_fingerprint"])


def test_a_sigterm_then_a_sigkill_at_random_moments_then_rerun_is_bitwise_identical(shards_dir, reference,
                                                                                   tmp_path):
  """SIGTERM at a random moment after the first checkpoint: exit 75 after checkpointing the step
  it stopped at, no results.json. The same command resumes it; SIGKILL at a random moment after
  that run's first new checkpoint: it dies wherever it is. The same command again ends on the
  uninterrupted run's state. (One sequence, each interruption resumed by the next run: 3 process
  start-ups instead of the 4 of a test per signal, each resume still checked: each rerun says it
  resumed from the newest checkpoint, and the last one's state is the uninterrupted run's.)"""
  rng = random.Random(31)
  overrides = _overrides(shards_dir)
  start = lambda workdir: subprocess.Popen(_cmd(workdir, overrides), cwd=REPO, env=ENV,  # noqa: E731
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  for trial in range(4):  # a run may finish before its signal arrives: start again
    workdir = tmp_path / f"trial{trial}"
    proc = start(workdir)
    err = interrupts.signal_when(proc, interrupts.checkpoint_after(workdir, 0), signal.SIGTERM,
                                 rng.uniform(0.0, 1.0))
    if proc.returncode == 0:
      continue
    assert proc.returncode == PREEMPTED_EXIT_STATUS, err[-3000:]
    step = _stopped_at(err)
    assert step in _checkpoints(workdir) and 0 < step < STEPS  # the step it stopped at, saved
    assert not (workdir / "results.json").exists()

    proc = start(workdir)  # resumes from `step`
    err = interrupts.signal_when(proc, interrupts.checkpoint_after(workdir, step), signal.SIGKILL,
                                 rng.uniform(0.0, 1.0))
    assert interrupts.resumed_from(err) == step, err[-3000:]
    if proc.returncode == 0:  # the resumed run finished first: its end is checked, then again
      assert json.loads((workdir / "results.json").read_text())["state_fingerprint"] == reference()
      continue
    assert proc.returncode == -signal.SIGKILL, err[-3000:]

    newest = max(_checkpoints(workdir))  # > step: the killed run's (its kill waited for it)
    proc = start(workdir)
    try:
      fingerprint = reference()  # trained while the rerun runs
    finally:
      err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 0, err[-3000:]
    assert interrupts.resumed_from(err) == newest, err[-3000:]
    result = json.loads((workdir / "results.json").read_text())
    assert result["steps"] == STEPS and result["state_fingerprint"] == fingerprint
    return
  pytest.fail("every run finished before its signal")


def _reference_2x1(shards_dir, workdir) -> str:
  """The uninterrupted 1-process run on the 2-process runs' mesh (2, 1): its fingerprint."""
  config = run_configs.runlocal(_overrides(shards_dir, mesh=(2, 1), steps=STEPS_2P))
  return train_and_evaluate(config, workdir)["state_fingerprint"]


@pytest.mark.multiprocess
def test_two_processes_resume_bitwise_after_a_sigterm_to_one(shards_dir, tmp_path):
  """2 processes x 1 CPU device, mesh (2, 1) (each process reads its half of every batch from the
  shards). SIGTERM to process 1 only, at a random moment after their first checkpoint: both exit
  75 after the same checkpoint. Rerun: both resume there and end on the state of the
  uninterrupted 1-process run on the same mesh (trained here while the pair runs). Two launches
  of the pair: a SIGKILL to both (a lost job) is not tried here; SIGKILL at random moments and
  its resume are the test above's (sharded input) and test_fault_injection.py's, on one process."""
  overrides = _overrides(shards_dir, mesh=(2, 1), steps=STEPS_2P)
  workdir = tmp_path / "mp"
  rng = random.Random(7)

  def launch():
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    env = lambda i: {**ENV, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",  # noqa: E731
                     "JAX_PROCESS_ID": str(i)}
    return [subprocess.Popen(_cmd(workdir, overrides), cwd=REPO, env=env(i), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]

  procs = launch()
  interrupts.wait_until(procs, interrupts.checkpoint_after(workdir, 0))
  time.sleep(rng.uniform(0.2, 0.6))
  assert all(p.poll() is None for p in procs), "the run ended before the SIGTERM"
  procs[1].send_signal(signal.SIGTERM)
  errs = [p.communicate(timeout=300)[1] for p in procs]
  assert [p.returncode for p in procs] == [PREEMPTED_EXIT_STATUS] * 2, [e[-2000:] for e in errs]
  steps = {_stopped_at(e) for e in errs}
  assert len(steps) == 1
  step = steps.pop()
  assert step in _checkpoints(workdir) and 0 < step < STEPS_2P
  assert not (workdir / "results.json").exists()

  procs = launch()  # resumes from `step`
  try:
    reference = _reference_2x1(shards_dir, tmp_path / "ref")  # trained while the pair runs
  finally:
    errs = [p.communicate(timeout=300)[1] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
  assert [interrupts.resumed_from(e) for e in errs] == [step, step], [e[-2000:] for e in errs]
  result = json.loads((workdir / "results.json").read_text())
  assert result["steps"] == STEPS_2P and result["state_fingerprint"] == reference
