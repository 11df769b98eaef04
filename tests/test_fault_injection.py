"""Fault injection (issue "Reliability"): runs killed with SIGKILL at random moments,
and the latest checkpoint corrupted in five ways, end on the state of an
uninterrupted run (sha256 fingerprint) or stop with a clear error.

  * kills: `python -m experiments.train` is killed at a uniformly random moment
    between its first checkpoint and its end (often while a checkpoint is being
    written), then rerun on the same workdir; repeated until 5 runs were killed;
  * corruptions of the newest checkpoint of a finished run whose results.json
    is then deleted (as if it crashed after that checkpoint): a truncated data
    file, a data file of random bytes, one flipped bit (orbax reads it back:
    only the digest sees it), the OCDBT manifest missing, and an iterator
    position outside its epoch. Each rerun must move the checkpoint aside, fall
    back to the previous one, and end bitwise equal to the uninterrupted run.
The uninterrupted reference is one in-process run (each resumed CLI run must end on its bits).
About 70 s on 2 busy CPU cores.
"""

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snm_jax.train.trainer.loop import train_and_evaluate
import run_configs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 400, 20
OVERRIDES = {"dataset.name": "synthetic", "mesh.shape": (1, 1), "train.num_steps": STEPS,
             "train.checkpoint_every": EVERY, "train.eval_every": 0, "train.log_every": EVERY,
             "train.keep_checkpoints": 3}
KILLS = 2  # each kill + resume is two process start-ups (~18 s under load); more kills at random
# moments: test_preemption.py (SIGKILL, SIGTERM, two processes on the sharded input path)


def _flag(value) -> str:
  return f"({value[0]},{value[1]})" if isinstance(value, tuple) else str(value)


def _cmd(workdir):
  return [sys.executable, "-m", "experiments.train", "--config=experiments/configs/default.py:paper,runlocal",
          f"--workdir={workdir}", *[f"--config.{k}={_flag(v)}" for k, v in OVERRIDES.items()]]


# One device, compiled as this process compiles (conftest.FAST_COMPILE_FLAGS): the bits compared are alike.
ENV = {**os.environ, "XLA_FLAGS": os.environ["SNM_JAX_TEST_XLA_FLAGS"], "JAX_PLATFORMS": "cpu"}


def _has_checkpoint(workdir: Path) -> bool:
  ckpts = workdir / "checkpoints"
  return ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())


def _start(workdir):
  return subprocess.Popen(_cmd(workdir), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def _wait_for_first_checkpoint(proc, workdir, timeout=120) -> float:
  deadline = time.time() + timeout
  while proc.poll() is None and not _has_checkpoint(workdir) and time.time() < deadline:
    time.sleep(0.01)
  return time.perf_counter()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """The uninterrupted run, in process (every CLI run below must end on its bits, so the CLI and
  train_and_evaluate agree): its workdir (checkpoints at 360, 380, 400), results, and how long it
  trained after its first checkpoint (the kills' window; one process of the same config)."""
  workdir = tmp_path_factory.mktemp("fi") / "finished"
  out = train_and_evaluate(_config(), workdir)
  window = (STEPS - EVERY) / out["steady_steps_per_second"]
  return workdir, out, window


def test_sigkill_at_random_moments_then_resume_is_bitwise_identical(finished_run, tmp_path):
  _, full, window = finished_run
  rng = random.Random(18)
  killed, outcomes = 0, []
  for trial in range(3 * KILLS):
    if killed == KILLS:
      break
    workdir = tmp_path / f"trial{trial}"
    proc = _start(workdir)
    _wait_for_first_checkpoint(proc, workdir)
    time.sleep(rng.uniform(0.0, 0.9 * window))
    if proc.poll() is None:
      proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode in (0, -signal.SIGKILL), err[-3000:]
    was_killed = proc.returncode == -signal.SIGKILL
    killed += was_killed
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    partial = [p.name for p in (workdir / "checkpoints").iterdir() if not p.name.isdigit()]
    resumed = subprocess.run(_cmd(workdir), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads((workdir / "results.json").read_text())
    outcomes.append((was_killed, steps[-1] if steps else None, partial))
    assert result["steps"] == STEPS
    assert result["state_fingerprint"] == full["state_fingerprint"], outcomes
    assert result["final"] == {**full["final"], "eval_seconds": result["final"]["eval_seconds"]}
  assert killed == KILLS, f"only {killed} runs were killed mid-run: {outcomes}"
  print(f"\n{killed} SIGKILLs, (killed, newest checkpoint, partial files) per trial: {outcomes}")


def _config():
  return run_configs.runlocal(OVERRIDES)


def _largest_data_file(step_dir: Path) -> Path:
  return max((p for p in step_dir.rglob("*") if p.is_file() and "/d/" in str(p)),
             key=lambda p: p.stat().st_size)


def _truncate(step_dir: Path):
  f = _largest_data_file(step_dir)
  f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])


def _random_bytes(step_dir: Path):
  f = _largest_data_file(step_dir)
  f.write_bytes(random.Random(1).randbytes(f.stat().st_size))


def _bit_flip(step_dir: Path):
  f = _largest_data_file(step_dir)
  data = bytearray(f.read_bytes())
  data[len(data) // 2] ^= 0x04
  f.write_bytes(bytes(data))


def _missing_manifest(step_dir: Path):
  (step_dir / "state" / "manifest.ocdbt").unlink()


def _bad_iterator_position(step_dir: Path):
  meta = step_dir / "data" / "metadata"
  data = json.loads(meta.read_text())
  data["iterator"]["position"] = -3
  meta.write_text(json.dumps(data))


CORRUPTIONS = {"truncate": _truncate, "random_bytes": _random_bytes, "bit_flip": _bit_flip,
               "missing_manifest": _missing_manifest, "bad_iterator_position": _bad_iterator_position}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(finished_run, tmp_path, name, caplog):
  finished, reference, _ = finished_run
  workdir = tmp_path / "run"
  shutil.copytree(finished, workdir)
  (workdir / "results.json").unlink()
  CORRUPTIONS[name](workdir / "checkpoints" / str(STEPS))
  with caplog.at_level(logging.WARNING):
    out = train_and_evaluate(_config(), workdir)  # or a clear error: none expected for these five
  assert (workdir / "checkpoints.corrupt" / str(STEPS)).is_dir()
  assert any(f"checkpoint at step {STEPS}" in r.getMessage() and "unreadable" in r.getMessage()
             for r in caplog.records)
  assert out["steps"] == STEPS and out["state_fingerprint"] == reference["state_fingerprint"]
