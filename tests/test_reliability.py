"""No silent corruption, no silent restart (issue "Reliability", items 1-6):
checkpoint digests, resume-config checks, the iterator state inside the
fallback, the run record after a resume, the workdir lock, non-finite steps."""

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snm_jax import sharding
from snm_jax.errors import CheckpointError, ConfigError, NonFiniteLossError, WorkdirInUseError
from snm_jax.train.trainer import classification
from snm_jax.train.trainer.checkpointing import state_digest
from snm_jax.train.runtime.host import workdir_lock
from snm_jax.train.trainer.loop import train_and_evaluate
from step_fixtures import make
from test_train_loop import synthetic_config

REPO = Path(__file__).resolve().parents[1]
RUN = {"train.num_steps": 20, "train.checkpoint_every": 10, "train.keep_checkpoints": 3}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
  """A finished 20-step run with checkpoints at steps 10 and 20 (copied by each test)."""
  wd = tmp_path_factory.mktemp("base") / "run"
  out = train_and_evaluate(synthetic_config(**RUN), wd)
  return wd, out


def _copy(base_run, tmp_path) -> Path:
  wd = tmp_path / "run"
  shutil.copytree(base_run[0], wd)
  (wd / "results.json").unlink()
  return wd


def _data_files(step_dir: Path):
  return sorted((p for p in step_dir.rglob("*") if p.is_file() and "/d/" in str(p)),
                key=lambda p: p.stat().st_size)


# ---- item 1: digest -----------------------------------------------------------------------------

def test_state_digest_depends_on_values_not_on_the_mesh():
  values = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  tree = {"table": values, "step": np.int32(3)}
  sharded = {"table": jax.device_put(values, sharding.named(sharding.make_mesh((2, 4)), sharding.TABLE)),
             "step": jnp.int32(3)}
  assert len(sharded["table"].addressable_shards) == 8
  assert state_digest(sharded) == state_digest(jax.tree.map(jnp.asarray, tree))
  flipped = values.copy()
  flipped.view(np.uint32)[5, 5] ^= 1  # one bit
  assert state_digest({"table": flipped, "step": np.int32(3)}) != state_digest(tree)


def test_flipped_bit_in_the_latest_checkpoint_is_caught_and_the_previous_one_used(base_run, tmp_path,
                                                                                  caplog):
  wd = _copy(base_run, tmp_path)
  target = _data_files(wd / "checkpoints" / "20")[-1]  # the class table's chunk
  data = bytearray(target.read_bytes())
  data[len(data) // 2] ^= 0x10  # orbax reads it back without complaint: only the digest sees it
  target.write_bytes(bytes(data))
  with caplog.at_level(logging.WARNING):
    again = train_and_evaluate(synthetic_config(**RUN), wd)
  assert any("sha256" in r.getMessage() and "step 20" in r.getMessage() for r in caplog.records)
  assert (wd / "checkpoints.corrupt" / "20").is_dir()  # quarantined for inspection
  assert again["state_fingerprint"] == base_run[1]["state_fingerprint"]  # steps 10-20 redone


# ---- item 3: iterator state inside the fallback --------------------------------------------------

def test_invalid_iterator_position_makes_the_checkpoint_unreadable(base_run, tmp_path, caplog):
  wd = _copy(base_run, tmp_path)
  meta = wd / "checkpoints" / "20" / "data" / "metadata"
  data = json.loads(meta.read_text())
  data["iterator"]["position"] = 10**6
  meta.write_text(json.dumps(data))
  with caplog.at_level(logging.WARNING):
    again = train_and_evaluate(synthetic_config(**RUN), wd)
  assert any("position 1000000 outside epoch" in r.getMessage() for r in caplog.records)
  assert again["state_fingerprint"] == base_run[1]["state_fingerprint"]


# ---- item 4: the run record of a resumed run -----------------------------------------------------

def test_resumed_finished_run_reports_the_cumulative_seconds_per_step(base_run, tmp_path):
  wd = _copy(base_run, tmp_path)  # results.json lost after the last checkpoint: the rerun trains 0 steps
  again = train_and_evaluate(synthetic_config(**RUN), wd)
  assert again["steps"] == 20
  # Before: this segment's ~0 s over 20 steps (1e-7 s/step); now the checkpointed time carries over.
  assert 0.5 < again["seconds_per_step"] / base_run[1]["seconds_per_step"] < 2


# ---- item 2: a changed config on resume, every checkpoint unreadable ------------------------------

def test_resume_with_a_shape_changing_config_names_the_fields_and_touches_nothing(base_run, tmp_path):
  wd = _copy(base_run, tmp_path)
  with pytest.raises(ConfigError) as info:
    train_and_evaluate(synthetic_config(**RUN, **{"model.out": 64, "mining.k": 2}), wd)
  msg = str(info.value)
  assert info.value.field == "mining.k" and msg.startswith("config.mining.k: saved 1, now 2")
  assert "model.out: saved 32, now 64" in msg and "new --workdir" in msg
  assert sorted(p.name for p in (wd / "checkpoints").iterdir()) == ["10", "20"]
  assert not (wd / "checkpoints.corrupt").exists()


def test_resume_may_change_the_run_length_and_cadences(base_run, tmp_path):
  wd = _copy(base_run, tmp_path)
  more = train_and_evaluate(synthetic_config(**{**RUN, "train.num_steps": 25, "train.log_every": 5,
                                                "eval.max_examples": 100}), wd)
  assert more["steps"] == 25


def _garble_every_checkpoint(wd: Path):
  for f in (wd / "checkpoints").rglob("*"):
    if f.is_file() and "state" in str(f):
      f.write_bytes(b"garbage")


def test_every_checkpoint_unreadable_fails_or_restarts_loudly(base_run, tmp_path, capsys):
  wd = _copy(base_run, tmp_path)
  _garble_every_checkpoint(wd)
  with pytest.raises(CheckpointError, match=r"every checkpoint in .* is unreadable .*step 20: .*step 10: "):
    train_and_evaluate(synthetic_config(**RUN, **{"train.on_unreadable_checkpoints": "fail"}), wd)
  assert sorted(p.name for p in (wd / "checkpoints").iterdir()) == ["10", "20"]  # nothing moved
  capsys.readouterr()
  again = train_and_evaluate(synthetic_config(**RUN), wd)
  assert "STARTS OVER from step 0" in capsys.readouterr().err
  assert sorted(p.name for p in (wd / "checkpoints.corrupt").iterdir()) == ["10", "20"]
  assert again["state_fingerprint"] == base_run[1]["state_fingerprint"]
  rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
  keys = [(r["step"], "loss" in r) for r in rows]
  assert keys == [(20, True), (20, False)]  # the old run's rows were dropped, not doubled


# ---- item 5: one run per workdir ----------------------------------------------------------------

def test_a_locked_workdir_is_refused_naming_the_holder_and_released_after_errors(tmp_path):
  wd = tmp_path / "run"
  with workdir_lock(wd):
    with pytest.raises(WorkdirInUseError, match=rf"pid {os.getpid()} on host {socket.gethostname()}"):
      train_and_evaluate(synthetic_config(**{"train.num_steps": 2}), wd)
  # A run that fails releases the lock: the next one (here a second failure) can take it.
  bad = synthetic_config(**{"loss.phi": "exponential", "loss.logit_scale": 1e5, "train.num_steps": 2})
  for _ in range(2):
    with pytest.raises(NonFiniteLossError):
      train_and_evaluate(bad, wd)
  with workdir_lock(wd):
    pass


def test_cli_on_a_workdir_in_use_exits_with_one_line(tmp_path):
  wd = tmp_path / "run"
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from snm_jax.train.runtime.host import workdir_lock\n"
       f"with workdir_lock({str(wd)!r}):\n  print('locked', flush=True); time.sleep(120)"],
      cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    proc = subprocess.run([sys.executable, "-m", "experiments.train",
                           "--config=experiments/configs/default.py:paper,runlocal", f"--workdir={wd}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
  finally:
    holder.kill()
    holder.wait()
  assert proc.returncode == 1, proc.stderr
  assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.startswith(f"error: workdir {wd} is in use by pid {holder.pid} on host "), proc.stderr


# ---- item 6: non-finite steps -------------------------------------------------------------------

def _poison_batches_from(monkeypatch, first_bad_step: int):
  """Feeds NaN feature values from the `first_bad_step`-th batch (1-based) on."""
  real = classification.GlobalBatches.to_global
  calls = {"n": 0}

  def poisoned(self, local_batch):
    calls["n"] += 1
    batch = real(self, local_batch)
    if calls["n"] >= first_bad_step:  # (an elementwise product keeps the array's sharding)
      batch = {**batch, "feat_vals": batch["feat_vals"] * np.float32(np.nan)}
    return batch
  monkeypatch.setattr(classification.GlobalBatches, "to_global", poisoned)


def test_stop_names_the_logged_step_and_the_committed_checkpoint(tmp_path, monkeypatch):
  _poison_batches_from(monkeypatch, 8)
  c = synthetic_config(**{"train.num_steps": 20, "train.checkpoint_every": 5, "train.log_every": 5})
  with pytest.raises(NonFiniteLossError, match=r"at step 8 of 20 .*the last good checkpoint \(step 5\)"):
    train_and_evaluate(c, tmp_path)
  ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
  assert ckpts == ["5"], ckpts  # committed, no *.orbax-checkpoint-tmp left behind


def test_skip_stops_once_its_budget_is_spent(tmp_path, monkeypatch):
  _poison_batches_from(monkeypatch, 4)
  c = synthetic_config(**{"train.num_steps": 20, "train.log_every": 2, "train.on_nonfinite": "skip",
                          "train.max_skipped_steps": 2})
  with pytest.raises(NonFiniteLossError, match=r"at step 4 of 20 .*3 steps skipped so far, more than "
                     r"train.max_skipped_steps=2"):
    train_and_evaluate(c, tmp_path)


def test_a_nonfinite_gradient_with_a_finite_loss_drops_the_step():
  s = make((1, 1))
  from snm_jax.train.core.step import make_train_step  # pylint: disable=g-import-not-at-top
  from step_fixtures import loss_spec  # pylint: disable=g-import-not-at-top

  def apply(params, ids, vals):  # d/dx sqrt(|x|) at 0 is inf: NaN gradients, finite output
    leaf = jax.tree.leaves(params)[0]
    return s["model"].apply(params, ids, vals) + 0.0 * jnp.sum(jnp.sqrt(jnp.abs(leaf - leaf)))

  step = make_train_step(tower_apply=apply, tx=s["tx"], row_opt=s["ropt"], table_lr=lambda _: 0.5,
                         sampler=s["sampler"], loss=loss_spec(), mesh=s["mesh"],
                         normalize_classes=True, donate=False)
  st, m = step(s["state"], s["batch"], jax.random.key(0))
  assert np.isfinite(float(m["loss"]))
  assert int(st.nonfinite_steps) == 1 and int(st.first_nonfinite_step) == 1
  for a, b in zip(jax.tree.leaves((st.params, st.opt_state, st.table)),
                  jax.tree.leaves((s["state"].params, s["state"].opt_state, s["state"].table))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_finished_run_is_not_reused_for_another_config(tmp_path):
  """reuse.run_or_load reads results.json back only for the config that wrote it (fields that
  change no result, e.g. train.log_every or the mesh, may differ); otherwise a ConfigError
  names the field, and nothing trains."""
  from snm_jax.train.recipes import reuse  # pylint: disable=g-import-not-at-top
  from run_configs import runlocal  # pylint: disable=g-import-not-at-top
  config = runlocal()
  (tmp_path / "config.json").write_text(config.to_json_best_effort())
  (tmp_path / "results.json").write_text(json.dumps({"final": {"P@1": 0.5}}))
  never = lambda: pytest.fail("trained instead of reusing")  # noqa: E731
  assert reuse.run_or_load(tmp_path, never, config=config)["final"] == {"P@1": 0.5}
  cosmetic = runlocal({"train.log_every": 7, "mesh.shape": (1, 1)})
  assert reuse.run_or_load(tmp_path, never, config=cosmetic)["final"] == {"P@1": 0.5}
  with pytest.raises(ConfigError, match=r"mining\.k: saved 1, now 4.*finished run") as e:
    reuse.run_or_load(tmp_path, never, config=runlocal({"mining.k": 4, "train.num_steps": 3}))
  assert "train.num_steps" in str(e.value)  # every differing field is named
