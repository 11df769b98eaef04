"""Candidate groups (snm_jax/train/trainer/group.py): members trained as one vmapped program give
the runs each member's config gives alone, and the group never reads the test split to choose."""

import json

import jax
import numpy as np
import pytest

from experiments.configs import xmc
from snm_jax import sharding
from snm_jax.train.config.overrides import with_overrides
from snm_jax.train.recipes import ensemble
from snm_jax.train.trainer import group as group_lib
from snm_jax.train.trainer.loop import train_and_evaluate

# Three members of one shape: two table learning rates, and a second validation split.
MEMBERS = {"lr_x1": {}, "lr_x2": {"table.learning_rate": 2.0},
           "split_1": {"dataset.validation_seed": 1, "seed": 3}}


def base_config():
  c = with_overrides(xmc.get_config("synthetic,runlocal"), {
      "recipe.name": "", "model.kind": "linear", "loss.kind": "full_softmax", "mining.sampler": "full",
      "mining.num_samples": 0, "train.batch_size": 64, "train.num_steps": 24, "train.eval_every": 8,
      "table.learning_rate": 1.0, "model.bag_matmul": "dense", "loss.logit_scale": 1.0,
      "dataset.synthetic.num_labels": 64, "dataset.synthetic.num_train": 1000,
      "dataset.synthetic.num_test": 200, "dataset.synthetic.dim": 32, "mining.num_strata": 1,
      "model.hidden": 8, "model.out": 8, "model.dropout": 0.0, "train.checkpoint_every": 0})
  return with_overrides(c, {"mining.num_samples": 64})


def member_configs():
  return {n: with_overrides(base_config(), over) for n, over in MEMBERS.items()}


def _best_table(config, workdir):
  mesh = sharding.make_mesh(config.mesh.shape)
  member, _ = ensemble.load_member(config, workdir, mesh, num_features=32)
  return np.asarray(jax.device_get(member.table))


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
  root = tmp_path_factory.mktemp("alone")
  return root, {n: train_and_evaluate(c, root / n) for n, c in member_configs().items()}


# (mode, steps_per_call): serial with 3 steps per dispatch cuts each 8-step evaluation interval
# into 3 + 3 + 1 + 1 (a scan of 3, then single steps).
@pytest.fixture(scope="module", params=[("vmap", 1), ("serial", 1), ("serial", 3)])
def runs(request, alone, tmp_path_factory):
  mode, steps_per_call = request.param
  root = tmp_path_factory.mktemp(f"group_{mode}_{steps_per_call}")
  configs = member_configs()
  mesh = sharding.make_mesh(configs["lr_x1"].mesh.shape)
  group = group_lib.CandidateGroup([(n, c, root / "group" / n) for n, c in configs.items()], mesh,
                                   mode=mode, steps_per_call=steps_per_call)
  # The two rates read the same batches: one pipeline feeds both (the other split has its own).
  assert group._feed == {"lr_x1": "lr_x1", "lr_x2": "lr_x1", "split_1": "split_1"}  # pylint: disable=protected-access
  group.finish()
  assert group._compiled == ({(0, 1)} if steps_per_call == 1 else {(0, 1), (0, steps_per_call)})  # pylint: disable=protected-access
  together = {n: json.loads((root / "group" / n / "results.json").read_text()) for n in configs}
  return root, alone[0], configs, alone[1], together


def test_members_share_one_group_key():
  keys = {group_lib.group_key(c) for c in member_configs().values()}
  assert len(keys) == 1 and None not in keys
  other = with_overrides(base_config(), {"train.batch_size": 32})
  assert group_lib.group_key(other) not in keys


def test_a_group_trains_each_member_as_its_own_run(runs):
  root, alone_root, configs, alone, together = runs
  for name, config in configs.items():
    a, g = alone[name], together[name]
    assert g["steps"] == a["steps"] == config.train.num_steps
    assert g["selected"]["step"] == a["selected"]["step"], name
    np.testing.assert_allclose(g["selected"]["value"], a["selected"]["value"], rtol=1e-4, err_msg=name)
    for k in ("P@1", "P@5", "nDCG@5"):
      np.testing.assert_allclose(g["final"][k], a["final"][k], atol=1e-3, err_msg=f"{name} {k}")
    np.testing.assert_allclose(_best_table(config, root / "group" / name),
                               _best_table(config, alone_root / name), rtol=1e-4, atol=1e-5,
                               err_msg=name)
  # the members really differ (different rates / data), so the comparison above is not vacuous
  assert together["lr_x1"]["selected"]["value"] != together["lr_x2"]["selected"]["value"]


@pytest.mark.parametrize("mode", group_lib.MODES)
def test_a_dropped_member_is_never_evaluated_on_test(tmp_path, mode):
  configs = member_configs()
  mesh = sharding.make_mesh(configs["lr_x1"].mesh.shape)
  group = group_lib.CandidateGroup([(n, c, tmp_path / n) for n, c in configs.items()], mesh, mode=mode)
  test_calls = []
  for name, task in group.tasks.items():
    real = task.evaluators["test"]
    task.evaluators["test"] = lambda s, name=name, real=real: test_calls.append(name) or real(s)
  group.advance(8)
  assert all(group.best_value(n) is not None for n in configs)
  group.drop(["lr_x2"], {"rule": "test"})
  group.finish()
  assert "lr_x2" not in test_calls and sorted(set(test_calls)) == ["lr_x1", "split_1"]
  record = json.loads((tmp_path / "lr_x2" / "eliminated.json").read_text())
  assert record["step"] == 8 and record["best_step"] == 8
  assert not (tmp_path / "lr_x2" / "results.json").exists()
  assert (tmp_path / "lr_x1" / "results.json").exists()


def test_rung_steps_and_survivors_follow_successive_halving():
  from snm_jax.train.recipes import candidates  # pylint: disable=g-import-not-at-top
  assert candidates.rung_steps(686, 3, 2) == [76, 229]
  assert candidates.rung_steps(686, 3, 2, eval_every=34) == [68, 238]  # at evaluations
  assert candidates.rung_steps(686, 0, 2) == [] and candidates.rung_steps(10, 3, 4) == [1, 3]
  assert candidates.keep_count(7, 3, 1) == 3 and candidates.keep_count(7, 3, 4) == 4
  assert candidates.keep_count(2, 3, 3) == 2
  values = {"a": 0.5, "b": 0.7, "c": 0.6, "d": 0.1, "e": 0.7, "f": 0.2, "g": 0.3}
  # the best 3, in the candidates' order; ties keep the earlier candidate
  assert candidates.survivors(values, 3) == ["b", "c", "e"]
  assert candidates.survivors(values, 4) == ["a", "b", "c", "e"]
  assert candidates.survivors({"a": 0.1, "b": 0.1}, 1) == ["a"]


def test_an_interrupted_recipe_halves_as_an_uninterrupted_one(tmp_path):
  """Nine candidates, eta = 3, two rungs, one kept: the rerun of a recipe interrupted after its
  first rung (the candidates stopped at the second rung and the finished one retrained) stops the
  same candidates at the same rungs and chooses the same one."""
  import shutil  # pylint: disable=g-import-not-at-top
  from run_configs import tiny_synthetic_recipe  # pylint: disable=g-import-not-at-top
  from snm_jax.train.recipes import recipe  # pylint: disable=g-import-not-at-top
  c = tiny_synthetic_recipe(**{"recipe.search": "table.learning_rate*=0.125,0.25,0.5,1,2,4,8,16,32",
                               "model.kind": "linear", "recipe.ensemble": 1, "recipe.halving": 3,
                               "recipe.rungs": 2})
  first = recipe.run(c, tmp_path / "a")
  stopped = {e["name"]: e["rung_step"] for e in first["recipe"]["eliminated"]}
  rungs = sorted(set(stopped.values()))
  assert len(rungs) == 2 and len(stopped) == 8, stopped
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  cands = tmp_path / "b" / "candidates"
  for name, rung in stopped.items():  # the second rung's decisions were not made yet
    if rung == rungs[1]:
      (cands / name / "eliminated.json").unlink()
  chosen = first["recipe"]["chosen"]
  (cands / chosen / "results.json").unlink()  # nor had the survivor finished
  shutil.rmtree(cands / chosen / "best")
  again = recipe.run(c, tmp_path / "b")
  assert {e["name"]: e["rung_step"] for e in again["recipe"]["eliminated"]} == stopped
  assert again["recipe"]["chosen"] == chosen
  timeless = lambda m: {k: v for k, v in m.items() if k != "eval_seconds"}  # noqa: E731
  assert timeless(again["final"]) == timeless(first["final"])


def test_clearly_behind_is_a_paired_z_test():
  from snm_jax.train.recipes import candidates  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  leader = rng.random(400)
  # behind by 0.05 everywhere but noisy: paired d has mean 0.05 and std ~0.1, z ~ 10
  behind = leader - 0.05 + rng.normal(0, 0.1, 400)
  # the same mean as the leader's points, shuffled: unpaired it ties, paired it is noise (z ~ 0)
  level = rng.permutation(leader)
  points = {"a": {0: leader}, "b": {0: behind}, "c": {0: level}, "d": {1: behind}}
  values = {n: float(np.mean(next(iter(p.values())))) for n, p in points.items()}
  out = candidates.clearly_behind(points, values, 3.0)
  d = leader - behind
  assert set(out) == {"b"}  # "d" shares no split with the leader: nothing to pair with
  np.testing.assert_allclose(out["b"], d.mean() / (d.std(ddof=1) / np.sqrt(d.size)))
  assert candidates.clearly_behind(points, values, out["b"] + 0.01) == {}
  assert candidates.clearly_behind({"a": {0: leader}}, {"a": 1.0}, 3.0) == {}


def test_a_clearly_behind_candidate_stops_at_the_rung_even_below_the_ensemble_size(tmp_path):
  """Three learning rates, one far too small; halving keeps all three (recipe.ensemble = 3), the
  paired test stops the slow one at the first rung: never evaluated on test, and the result is
  the recipe's without the test (the stopped candidate was in no chosen ensemble)."""
  from run_configs import tiny_synthetic_recipe  # pylint: disable=g-import-not-at-top
  from snm_jax.train.recipes import recipe  # pylint: disable=g-import-not-at-top
  fields = {"recipe.search": "table.learning_rate*=0.002,1,2", "model.kind": "linear",
            "recipe.ensemble": 3, "recipe.halving": 3, "recipe.rungs": 1}
  with_test = recipe.run(tiny_synthetic_recipe(**fields, **{"recipe.drop_behind_z": 3.0}), tmp_path / "z")
  without = recipe.run(tiny_synthetic_recipe(**fields, **{"recipe.drop_behind_z": 0.0}), tmp_path / "none")
  stopped = {e["name"]: e for e in with_test["recipe"]["eliminated"]}
  assert list(stopped) == ["learning_rate_x0.002"], stopped
  record = json.loads((tmp_path / "z" / "candidates" / "learning_rate_x0.002" /
                       "eliminated.json").read_text())
  assert record["z"] > 3.0 and record["rule"].startswith("clearly behind the leader")
  assert not (tmp_path / "z" / "candidates" / "learning_rate_x0.002" / "results.json").exists()
  members = lambda r: r["recipe"].get("ensemble", {}).get("members", [r["recipe"]["chosen"]])  # noqa: E731
  assert "eliminated" not in without["recipe"]
  assert "learning_rate_x0.002" not in members(without)
  assert members(with_test) == members(without)
  timeless = lambda m: {k: v for k, v in m.items() if k != "eval_seconds"}  # noqa: E731
  assert timeless(with_test["final"]) == timeless(without["final"])


class _Crash(Exception):
  """A process lost mid-run (what kill -9 leaves: the checkpoints on disk, nothing else)."""


def _timeless(record):
  """`record` without its timings (the one thing a resumed run may not repeat)."""
  if isinstance(record, dict):
    return {k: _timeless(v) for k, v in record.items() if not k.endswith("seconds")}
  return record


def _candidate_results(workdir):
  cands = workdir / "candidates"
  out = {}
  for d in sorted(cands.iterdir()):
    for marker in ("results.json", "eliminated.json"):
      if (d / marker).exists():
        r = json.loads((d / marker).read_text())
        out[d.name] = (marker, r.get("state_fingerprint"), _timeless(r.get("selected")), r.get("best_value"),
                       r.get("rung_step"), r.get("steps"))
  return out


# A recipe of two candidate groups (linear, wide_deep; two table rates each), halving at two rungs
# with the paired rule, a checkpoint every 4 steps, evaluations every 4.
RECIPE = {"dataset.synthetic.num_labels": 64, "dataset.synthetic.num_train": 800,
          "dataset.synthetic.num_test": 100, "dataset.synthetic.dim": 16,
          "recipe.search": "model.kind=linear,wide_deep;table.learning_rate*=1,2", "recipe.ensemble": 2,
          "recipe.halving": 2, "recipe.rungs": 2, "recipe.drop_behind_z": 1.0, "recipe.evaluations": 10,
          "train.checkpoint_every": 4, "train.fingerprint": True, "mesh.shape": (1, 1),
          "recipe.member_devices": 2}  # (two of the 8 test devices: the groups advance side by side)


def recipe_config():
  return with_overrides(xmc.get_config("synthetic,runlocal"), RECIPE)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """(results.json, every candidate's record) of the RECIPE run without interruption."""
  from snm_jax.train.recipes import recipe  # pylint: disable=g-import-not-at-top
  workdir = tmp_path_factory.mktemp("uninterrupted")
  out = recipe.run(recipe_config(), workdir)
  return out, _candidate_results(workdir)


def test_a_preempted_then_crashed_recipe_resumes_to_the_uninterrupted_result(uninterrupted, tmp_path, monkeypatch):
  """A preemption notice at the 13th step: every group checkpoints where it stands and Preempted is
  raised. The rerun resumes them; a crash after its 10th step (the second group past the first
  rung, its last checkpoint at step 12) loses what followed the last periodic checkpoints. The
  third run ends on the results of the uninterrupted recipe: the same members stopped at the same
  rungs with the same values, the same selections and final state fingerprints of every candidate,
  the same choice."""
  from snm_jax.train.recipes import recipe  # pylint: disable=g-import-not-at-top
  from snm_jax.train.runtime import preemption  # pylint: disable=g-import-not-at-top
  c = recipe_config()
  reference, expected = uninterrupted
  assert any(m == "eliminated.json" for m, *_ in expected.values())  # the rungs decided something

  calls = {"n": 0}

  def notice_at(n):
    def reached(self):
      del self
      calls["n"] += 1
      return calls["n"] == n
    return reached

  workdir = tmp_path / "interrupted"
  monkeypatch.setattr(preemption.PreemptionWatch, "reached", notice_at(13))
  with pytest.raises(preemption.Preempted, match="checkpoint of step"):
    recipe.run(c, workdir)
  assert not (workdir / "results.json").exists()
  saved = [p for p in (workdir / "candidates").glob("*/checkpoints/*") if p.name.isdigit()]
  # The groups advance side by side, a step of each in turn, the notice asked after each: the 13th
  # comes after the first group's 7th step, the second group at its 6th. Saved at steps 4 (periodic),
  # 7 and 6, off the periodic grid of 4 (the notice's own checkpoints).
  assert {int(p.name) for p in saved} == {4, 6, 7}

  from snm_jax.train.trainer import group as group_lib  # pylint: disable=g-import-not-at-top
  # (checkpoints and evaluations every 4 steps, so every dispatch is one step: k = 1)
  real_step, steps = group_lib.CandidateGroup._serial_dispatch, {"n": 0}  # pylint: disable=protected-access
  resumed_at = []

  def crash_after_10(self, k):
    if steps["n"] == 0:
      resumed_at.append(self.start_step)
    steps["n"] += k
    if steps["n"] > 10:
      raise _Crash()
    return real_step(self, k)

  monkeypatch.setattr(preemption.PreemptionWatch, "reached", lambda self: False)
  monkeypatch.setattr(group_lib.CandidateGroup, "_serial_dispatch", crash_after_10)
  with pytest.raises(_Crash):
    recipe.run(c, workdir)
  assert resumed_at and resumed_at[0] > 0  # it resumed, not retrained from step 0

  # The second group resumes at step 12, past the first rung (8): that rung was ranked by the run
  # that saved it, with the values of step 8, and is not ranked again with those of step 12.
  from snm_jax.train.recipes import candidates  # pylint: disable=g-import-not-at-top
  real_behind, ranked = candidates.clearly_behind, []
  monkeypatch.setattr(candidates, "clearly_behind", lambda *a: ranked.append(a) or real_behind(*a))
  monkeypatch.setattr(group_lib.CandidateGroup, "_serial_dispatch", real_step)
  again = recipe.run(c, workdir)
  assert len(ranked) == 1  # the second rung only
  assert _candidate_results(workdir) == expected
  assert again["recipe"]["chosen"] == reference["recipe"]["chosen"]
  assert again["recipe"].get("eliminated") == reference["recipe"].get("eliminated")
  assert _timeless(again["final"]) == _timeless(reference["final"])


def test_a_group_lost_after_a_checkpoint_resumes_to_the_uninterrupted_group(tmp_path, mode="vmap"):
  """Three members, a checkpoint every 8 steps: a group dropped at step 12 (a lost process) and a
  new group of the same members resume from step 8 -- state, selection so far, data position --
  and finish on the uninterrupted group's results and selected tables. In vmap mode (the stacked
  states, taken apart to save and stacked again to restore); the recipe tests above resume the
  serial mode, CPU's default."""
  configs = {n: with_overrides(c, {"train.checkpoint_every": 8, "train.fingerprint": True})
             for n, c in member_configs().items()}
  mesh = sharding.make_mesh(configs["lr_x1"].mesh.shape)

  def group(root):
    return group_lib.CandidateGroup([(n, c, root / n) for n, c in configs.items()], mesh, mode=mode)

  whole = group(tmp_path / "whole")
  whole.finish()
  whole.close()
  lost = group(tmp_path / "resumed")
  lost.advance(12)
  lost.close()  # (what a lost process leaves: the committed checkpoints; its threads end here)
  del lost
  again = group(tmp_path / "resumed")
  assert again.start_step == 8 and all(again.best_value(n) is not None for n in configs)
  again.finish()
  again.close()
  for name, config in configs.items():
    a, b = (json.loads((tmp_path / d / name / "results.json").read_text()) for d in ("whole", "resumed"))
    assert a["state_fingerprint"] == b["state_fingerprint"], name
    assert _timeless(a["selected"]) == _timeless(b["selected"]) and _timeless(a["final"]) == _timeless(b["final"])
    np.testing.assert_array_equal(_best_table(config, tmp_path / "resumed" / name),
                                  _best_table(config, tmp_path / "whole" / name))


def test_a_recipe_sent_sigterm_checkpoints_its_groups_and_resumes_to_the_same_result(uninterrupted, tmp_path):
  """`experiments.train` running the recipe gets SIGTERM at a random moment after its first member
  checkpoint: exit 75, no results.json. The same recipe rerun (in this process, with the
  subprocess's compiler settings) ends on the uninterrupted recipe's candidates and result."""
  import os  # pylint: disable=g-import-not-at-top
  import random  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from pathlib import Path  # pylint: disable=g-import-not-at-top
  from snm_jax.train.recipes import recipe  # pylint: disable=g-import-not-at-top
  from snm_jax.train.runtime.preemption import PREEMPTED_EXIT_STATUS  # pylint: disable=g-import-not-at-top
  import interrupts  # pylint: disable=g-import-not-at-top
  reference, expected = uninterrupted
  repo = Path(__file__).resolve().parents[1]
  env = {**os.environ, "XLA_FLAGS": os.environ["SNM_JAX_TEST_XLA_FLAGS"], "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "experiments.train", "--config=experiments/configs/xmc.py:synthetic,runlocal",
         *[f"--config.{k}={v}".replace(" ", "") for k, v in RECIPE.items()]]  # ("(1,1)": one device, as here)
  rng = random.Random(5)
  for trial in range(3):  # the recipe may finish before its signal arrives: start again
    workdir = tmp_path / f"trial{trial}"
    proc = subprocess.Popen([*cmd, f"--workdir={workdir}"], cwd=repo, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    a_member_checkpointed = lambda: any(p.name.isdigit() for p in workdir.glob("candidates/*/checkpoints/*"))  # noqa: E731
    err = interrupts.signal_when(proc, a_member_checkpointed, signal.SIGTERM, rng.uniform(0.0, 0.2))
    if proc.returncode == 0:
      continue
    assert proc.returncode == PREEMPTED_EXIT_STATUS, err[-3000:]
    assert "checkpoint of step" in err and not (workdir / "results.json").exists()
    again = recipe.run(recipe_config(), workdir)
    assert _candidate_results(workdir) == expected
    assert again["recipe"]["chosen"] == reference["recipe"]["chosen"]
    assert _timeless(again["final"]) == _timeless(reference["final"])
    return
  pytest.fail("every recipe finished before its signal")
