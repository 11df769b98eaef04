"""Fault injection (issue "Reliability"): runs killed with SIGKILL at random moments,
and the latest checkpoint corrupted in five ways, end on the state of an
uninterrupted run (sha256 fingerprint) or stop with a clear error.

  * kills: `python -m experiments.train` is killed at a uniformly random moment
    between its first checkpoint and its end (often while a checkpoint is being
    written), then rerun on the same workdir; the rerun resumes from the newest
    checkpoint and is killed the same way after its first new checkpoint, and
    the next rerun runs to the end, which must be the uninterrupted run's state:
    2 kills in 3 process start-ups (4 with a checked rerun after each kill),
    each resume checked through the runs after it, which continue from the
    checkpoints it wrote;
  * corruptions of the newest checkpoint of a finished run whose results.json
    is then deleted (as if it crashed after that checkpoint): a truncated data
    file, a data file of random bytes, one flipped bit (orbax reads it back:
    only the digest sees it), the OCDBT manifest missing, and an iterator
    position outside its epoch. Each rerun must move the checkpoint aside, fall
    back to the previous one, and end bitwise equal to the uninterrupted run.
The uninterrupted reference is one in-process run (each CLI run that ends must end on its bits).
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

from snm_jax.train.trainer.checkpointing import saved_steps
from snm_jax.train.trainer.loop import train_and_evaluate
import interrupts
import run_configs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 200, 20  # 9 checkpoint writes between the first checkpoint and the end
OVERRIDES = {"dataset.name": "synthetic", "mesh.shape": (1, 1), "train.num_steps": STEPS,
             "train.checkpoint_every": EVERY, "train.eval_every": 0, "train.log_every": EVERY,
             "train.keep_checkpoints": 3}
KILLS = 2  # one process start-up each, plus the last rerun's (~9 s each under load); more kills
# at random moments: test_preemption.py (SIGKILL and SIGTERM on the sharded input path)


def _flag(value) -> str:
  return f"({value[0]},{value[1]})" if isinstance(value, tuple) else str(value)


def _cmd(workdir):
  return [sys.executable, "-m", "experiments.train", "--config=experiments/configs/default.py:paper,runlocal",
          f"--workdir={workdir}", *[f"--config.{k}={_flag(v)}" for k, v in OVERRIDES.items()]]


# One device, compiled as this process compiles (conftest.FAST_COMPILE_FLAGS): the bits compared are alike.
ENV = {**os.environ, "XLA_FLAGS": os.environ["SNM_JAX_TEST_XLA_FLAGS"], "JAX_PLATFORMS": "cpu"}


def _newest(workdir: Path) -> int:
  """The step of the newest checkpoint in `workdir` (where a run there resumes), 0 if none."""
  return max(saved_steps(workdir / "checkpoints"), default=0)


def _start(workdir):
  return subprocess.Popen(_cmd(workdir), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """The uninterrupted run, in process (every CLI run below must end on its bits, so the CLI and
  train_and_evaluate agree): its workdir (checkpoints at 160, 180, 200), results, and its seconds
  per step after the first (the kills' windows; one process of the same config)."""
  workdir = tmp_path_factory.mktemp("fi") / "finished"
  out = train_and_evaluate(_config(), workdir)
  return workdir, out, 1.0 / out["steady_steps_per_second"]


def test_sigkill_at_random_moments_then_resume_is_bitwise_identical(finished_run, tmp_path):
  """SIGKILL at a uniformly random moment between a run's first new checkpoint and its end; the
  same command on the same workdir resumes it from the newest checkpoint and is killed the same
  way, until KILLS runs were killed; the next run gets no signal and must end on the uninterrupted
  run's bits (state, final metrics). A run that ends before its kill is checked the same way, and
  the kills go on in a new workdir."""
  _, full, seconds_per_step = finished_run
  rng = random.Random(18)
  killed, outcomes = 0, []
  for trial in range(2 * KILLS):
    if killed == KILLS:
      break
    workdir = tmp_path / f"trial{trial}"
    while True:  # runs on `workdir` until one ends by itself
      resumed_from = _newest(workdir)
      proc = _start(workdir)
      if killed < KILLS:
        interrupts.wait_until([proc], interrupts.checkpoint_after(workdir, resumed_from))
        window = max(0.0, STEPS - resumed_from - EVERY) * seconds_per_step  # first new checkpoint -> end
        time.sleep(rng.uniform(0.0, 0.9 * window))
        if proc.poll() is None:
          proc.send_signal(signal.SIGKILL)
      _, err = proc.communicate(timeout=300)
      assert interrupts.resumed_from(err) == resumed_from, err[-3000:]
      if proc.returncode != -signal.SIGKILL:
        break
      killed += 1
      partial = [p.name for p in (workdir / "checkpoints").iterdir() if not p.name.isdigit()]
      outcomes.append((trial, resumed_from, _newest(workdir), partial))
    assert proc.returncode == 0, err[-3000:]
    result = json.loads((workdir / "results.json").read_text())
    assert result["steps"] == STEPS
    assert result["state_fingerprint"] == full["state_fingerprint"], outcomes
    assert result["final"] == {**full["final"], "eval_seconds": result["final"]["eval_seconds"]}
  assert killed == KILLS, f"only {killed} runs were killed mid-run: {outcomes}"
  print(f"\n{killed} SIGKILLs, (trial, resumed from, newest checkpoint, partial files) per kill: {outcomes}")


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
