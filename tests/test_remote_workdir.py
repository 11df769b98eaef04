"""Remote workdirs (gs://...) without a network: a fake bucket on the local disk.

`fake_gcs` makes every `gs://<bucket>/<key>` path a file under a temporary
folder, at the two places a run reaches storage:
  * etils.epath (everything but orbax's array data): through the public
    `epath.testing.mock_epath`, which swaps epath's backends for one whose
    calls we map. Object-store semantics are kept where our code could rely
    on a file system: opening a gs:// object for append fails, as on GCS.
  * TensorStore (orbax's array data): orbax builds a "gcs" kvstore spec for a
    gs:// path (`gcs_utils.get_kvstore_for_gcs`, an orbax internal); it is
    replaced by a "file" spec on the same folder. orbax's HNS probe (which
    needs google-cloud-storage and credentials) answers False.
Everything else is orbax's real gs:// code path (e.g. a step is committed
with commit_success.txt, not with a rename). gcsfs, ArrayRecord's GCS reader and
TensorStore's GCS driver themselves run against an emulator in test_gcs_emulator.py
(the gcs-test extra); GCS consistency and latency are not covered.
"""

import json
import logging as pylogging
import os
from pathlib import Path

import pytest
from etils import epath
from etils.epath import testing as epath_testing
from orbax.checkpoint._src.path import gcs_utils

from snm_jax.train.runtime import host, workpath, writers
from snm_jax.train.trainer.loop import train_and_evaluate
import run_configs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
  """The folder holding the fake buckets; the test runs in an empty cwd (checked empty after:
  a gs:// path mistaken for a local one, e.g. by `pathlib.Path(...).absolute()`, lands there)."""
  root = tmp_path / "buckets"
  root.mkdir()

  def local(path) -> str:
    path = os.fspath(path)
    return os.path.join(root, path[len("gs://"):]) if path.startswith("gs://") else path

  def remote(path: str) -> str:
    rel = os.path.relpath(path, root)
    return path if rel.startswith("..") else "gs://" + rel

  def mapped(original, path, *args, **kwargs):
    return original(local(path), *args, **kwargs)

  def two_paths(original, path, dst, *args, **kwargs):
    return original(local(path), local(dst), *args, **kwargs)

  def open_(original, path, mode):
    if os.fspath(path).startswith("gs://") and "a" in mode:
      raise OSError(f"object stores cannot append ({path}, mode {mode!r})")
    return original(local(path), mode)

  def glob(original, pattern):
    return [remote(p) for p in original(local(pattern))]

  def walk(original, top, **kwargs):
    for d, dirs, files in original(local(top), **kwargs):
      yield remote(os.fspath(d)), dirs, files

  monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs",
                      lambda path: {"driver": "file", "path": local(path)})
  monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  with epath_testing.mock_epath(
      open=open_, exists=mapped, isdir=mapped, listdir=mapped, makedirs=mapped, mkdir=mapped,
      rmtree=mapped, remove=mapped, stat=mapped, glob=glob, walk=walk, rename=two_paths,
      replace=two_paths, copy=two_paths):
    yield root
  assert not os.listdir(cwd), f"local files written for a gs:// path: {os.listdir(cwd)}"


def synthetic_config(**overrides):
  return run_configs.synthetic(64, 600, 100, 8, {"train.log_every": 5, "train.checkpoint_every": 5,
                                                 "train.batch_size": 32, "mining.num_samples": 16,
                                                 **overrides})


def _rows(text: str) -> list[dict]:
  return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_workdir_path_keeps_uris_and_makes_local_paths_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert str(workpath.workdir_path("gs://bucket/run") / "checkpoints") == "gs://bucket/run/checkpoints"
  assert str(workpath.workdir_path("s3://b/x")) == "s3://b/x"
  assert str(workpath.workdir_path("run")) == str(tmp_path / "run")
  assert workpath.is_local(tmp_path) and not workpath.is_local(epath.Path("gs://b/r"))


def test_local_write_text_replaces_whole_and_leaves_no_temp_file(tmp_path):
  path = tmp_path / "sub" / "results.json"
  workpath.write_text(path, "old")
  workpath.write_text(path, "new")
  assert path.read_text() == "new" and os.listdir(tmp_path / "sub") == ["results.json"]
  umask = os.umask(0)
  os.umask(umask)
  assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # the mode plain open() gives


def test_train_and_evaluate_on_a_gs_workdir_writes_there_and_resumes(fake_gcs, tmp_path):
  run = fake_gcs / "bucket" / "run"
  first = train_and_evaluate(synthetic_config(**{"train.num_steps": 10}), "gs://bucket/run")
  assert first["steps"] == 10
  # Orbax's GCS commit protocol ran (a commit_success.txt per step, no rename), in the bucket.
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["10", "5"]
  assert (run / "checkpoints" / "10" / "commit_success.txt").is_file()
  assert [r["step"] for r in _rows((run / "metrics.jsonl").read_text()) if "loss" in r] == [5, 10]
  assert json.loads((run / "results.json").read_text())["steps"] == 10
  events = list((run / "tensorboard").glob("events.out.tfevents.*"))
  assert len(events) == 1 and events[0].stat().st_size > 0
  assert (run / "run.lock").read_text() == ""  # the advisory lock is cleared at the end

  # Resumed from the bucket's step-10 checkpoint: the same state as 20 uninterrupted local steps.
  resumed = train_and_evaluate(synthetic_config(**{"train.num_steps": 20}), "gs://bucket/run")
  straight = train_and_evaluate(synthetic_config(**{"train.num_steps": 20}), tmp_path / "local")
  assert resumed["state_fingerprint"] == straight["state_fingerprint"]
  # The training rows, each step once (the first attempt's last-step evaluation row at 10 stays).
  remote_rows = [r for r in _rows((run / "metrics.jsonl").read_text()) if "loss" in r]
  local_rows = [r for r in _rows((tmp_path / "local" / "metrics.jsonl").read_text()) if "loss" in r]
  assert [r["step"] for r in remote_rows] == [r["step"] for r in local_rows] == [5, 10, 15, 20]
  assert [r["loss"] for r in remote_rows] == [r["loss"] for r in local_rows]
  assert json.loads((run / "results.json").read_text())["final"] == {
      **resumed["final"], "eval_seconds": resumed["final"]["eval_seconds"]}
  assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per attempt


def test_remote_metrics_are_rewritten_whole_at_sync_and_truncation(fake_gcs):
  path = fake_gcs / "b" / "run" / "metrics.jsonl"
  writer = writers.MetricWriter("gs://b/run", total_steps=30, batch_size=4)
  writer._jsonl._every = 3600.0  # pylint: disable=protected-access  (no time-based rewrite here)
  for step in (10, 20, 30):
    writer.write_scalars(step, {"loss": step / 10}, wall=0.0)
  assert not path.exists()  # held in memory until a sync
  writer.sync()
  assert [r["step"] for r in _rows(path.read_text())] == [10, 20, 30]
  writer.truncate_after(20)  # a resumed run drops the rows it will write again, at once
  assert [r["step"] for r in _rows(path.read_text())] == [10, 20]
  writer.close()
  again = writers.MetricWriter("gs://b/run", total_steps=30, batch_size=4)  # resuming keeps them
  again.write_scalars(30, {"loss": 3.5}, wall=0.0)
  again.close()
  assert [(r["step"], r["loss"]) for r in _rows(path.read_text())] == [(10, 1.0), (20, 2.0), (30, 3.5)]


def test_remote_lock_is_advisory_and_names_the_previous_holder(fake_gcs, caplog):
  lock = fake_gcs / "b" / "run" / host.LOCK_FILE
  with host.workdir_lock("gs://b/run"):
    holder = json.loads(lock.read_text())
    assert holder["pid"] == os.getpid()
    with caplog.at_level(pylogging.WARNING), host.workdir_lock("gs://b/run"):  # not refused
      pass
  assert f"pid {os.getpid()}" in caplog.text and "not locked" in caplog.text
  assert lock.read_text() == ""


def test_gs_checkpoints_restore_and_quarantine_in_the_bucket(fake_gcs):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from snm_jax.train.trainer.checkpointing import Checkpointer, abstract_like  # pylint: disable=g-import-not-at-top
  ckpt = Checkpointer("gs://b/run/checkpoints", keep=3, async_save=False)
  assert str(ckpt.directory) == "gs://b/run/checkpoints"
  state = {"w": jnp.arange(6.0).reshape(2, 3)}
  for step in (1, 2):
    ckpt.save(step, {"w": state["w"] * step}, {"step": step})
  ckpt.wait()
  folder = fake_gcs / "b" / "run" / "checkpoints"
  for f in (folder / "2").rglob("*"):
    if f.is_file() and "state" in str(f) and "commit_success" not in f.name:
      f.write_bytes(b"garbage")
  step, restored, data = ckpt.restore_latest(abstract_like(state))
  ckpt.close()
  assert (step, data) == (1, {"step": 1})
  assert jnp.array_equal(restored["w"], state["w"])
  assert (fake_gcs / "b" / "run" / "checkpoints.corrupt" / "2").is_dir()  # moved aside in the bucket
  assert sorted(p.name for p in folder.iterdir()) == ["1"]


def test_report_reads_and_writes_a_gs_sweep_like_a_local_one(fake_gcs, tmp_path):
  from experiments import report  # pylint: disable=g-import-not-at-top
  summary = (REPO / "results" / "table2_bibtex" / "summary.json").read_bytes()
  (tmp_path / "local").mkdir()
  (tmp_path / "local" / "summary.json").write_bytes(summary)
  (fake_gcs / "b" / "sweep").mkdir(parents=True)
  (fake_gcs / "b" / "sweep" / "summary.json").write_bytes(summary)
  remote_md = report.write_report("gs://b/sweep")
  assert str(remote_md) == "gs://b/sweep/report.md"
  local_md = report.write_report(tmp_path / "local")
  assert (fake_gcs / "b" / "sweep" / "report.md").read_text() == local_md.read_text()
  for name in ("learning_curves.png", "cost_per_step.png"):
    assert (fake_gcs / "b" / "sweep" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
