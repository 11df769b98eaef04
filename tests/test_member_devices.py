"""A recipe's members dealt over one-device meshes (snm_jax/train/runtime/member_devices.py,
`CandidateGroup(slots=...)`, `group.advance_together`): each member trains on its own device to
the same bits as on one shared device, and the rules for when a recipe spreads its members."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments.configs import xmc
from snm_jax import sharding
from snm_jax.errors import ConfigError
from snm_jax.train.config import validation
from snm_jax.train.config.overrides import with_overrides
from snm_jax.train.runtime import member_devices
from snm_jax.train.trainer import group as group_lib
from tests.test_candidate_group import member_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _groups(tmp_path, slots):
  """Two candidate groups (the three members of test_candidate_group, and two of another batch
  size) on one-device meshes, dealt over `slots` as `recipes.candidates.train` deals them."""
  shapes = {"a": {n: with_overrides(c, {"mesh.shape": (1, 1)}) for n, c in member_configs().items()},
            "b": {n: with_overrides(c, {"mesh.shape": (1, 1), "train.batch_size": 32})
                  for n, c in list(member_configs().items())[:2]}}
  groups, dealt = [], 0
  for shape, configs in shapes.items():
    groups.append(group_lib.CandidateGroup([(f"{shape}_{n}", c, tmp_path / shape / n) for n, c in configs.items()],
                                           sharding.make_mesh((1, 1)), mode="serial", steps_per_call=3,
                                           slots=slots, first_slot=dealt))
    dealt += len(configs)
  return groups


def _devices(state):
  return {d for leaf in jax.tree.leaves(state) for d in leaf.devices()}


def test_members_on_their_own_devices_train_to_the_same_bits(tmp_path):
  slots = [sharding.make_mesh((1, 1), devices=[d]) for d in jax.devices()[:2]]
  shared = _groups(tmp_path / "shared", None)
  spread = _groups(tmp_path / "spread", slots)
  for groups in (shared, spread):
    assert group_lib.advance_together(groups, 16)  # side by side, interleaved
  # dealt in turn across the groups: a0 a1 a2 | b0 b1 -> devices 0 1 0 | 1 0
  where = {n: _devices(g.states[n]) for g in spread for n in g.alive}
  assert where == {"a_lr_x1": {jax.devices()[0]}, "a_lr_x2": {jax.devices()[1]},
                   "a_split_1": {jax.devices()[0]}, "b_lr_x1": {jax.devices()[1]},
                   "b_lr_x2": {jax.devices()[0]}}
  assert all(_devices(g.states[n]) == {jax.devices()[0]} for g in shared for n in g.alive)
  for one, each in zip(shared, spread):
    assert one.step == each.step == 16
    for name in one.alive:
      assert one.best_value(name) == each.best_value(name), name
      leaves_one = jax.tree.leaves(jax.device_get(one.states[name]))
      leaves_each = jax.tree.leaves(jax.device_get(each.states[name]))
      assert all(np.array_equal(a, b) for a, b in zip(leaves_one, leaves_each)), name
  # the members differ, so the equality above is not vacuous
  a = spread[0]
  assert not np.array_equal(jax.device_get(a.states["a_lr_x1"].table), jax.device_get(a.states["a_lr_x2"].table))

  # A rung stops a_lr_x2: dealt again in turn across the groups, group a takes devices {0, 1}, where
  # a_lr_x1 stays (0) and a_split_1 moves (0 -> 1), group b {0, 1}, where both stay; every member
  # still trains to the same bits.
  for groups in (shared, spread):
    groups[0].drop(["a_lr_x2"], {"rule": "test"})
    dealt = 0
    for g in groups:
      dealt += g.redeal(dealt)
    assert group_lib.advance_together(groups, 24)
  where = {n: _devices(g.states[n]) for g in spread for n in g.alive}
  assert where == {"a_lr_x1": {jax.devices()[0]}, "a_split_1": {jax.devices()[1]},
                   "b_lr_x1": {jax.devices()[1]}, "b_lr_x2": {jax.devices()[0]}}
  for one, each in zip(shared, spread):
    assert one.step == each.step == 24
    for name in one.alive:
      assert one.best_value(name) == each.best_value(name), name
      assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(jax.device_get(one.states[name])),
                                                      jax.tree.leaves(jax.device_get(each.states[name])))), name
  for one, each in zip(shared, spread):
    one.finish()
    each.finish()
    for name in one.names:
      metrics = [{k: v for k, v in g.records[name].get("final", {}).items() if k != "eval_seconds"}
                 for g in (one, each)]
      assert metrics[0] == metrics[1], name
  for g in shared + spread:
    g.close()


def _recipe(**over):
  return with_overrides(xmc.get_config("synthetic,runlocal"), over)


def test_member_slots_rules():
  cores = member_devices.usable_cores()
  auto = member_devices.member_slots(_recipe())
  if min(cores, jax.local_device_count()) >= 2:  # the tests' 8 CPU devices: one slot per core
    assert len(auto) == min(cores, jax.local_device_count())
    assert [m.devices.flat[0] for m in auto] == jax.local_devices()[:len(auto)]
    assert all(m.devices.size == 1 for m in auto)
  else:
    assert auto is None
  assert member_devices.member_slots(_recipe(**{"recipe.member_devices": 0})) is None
  assert member_devices.member_slots(_recipe(**{"mesh.shape": (1, 2)})) is None  # a model axis: no
  assert member_devices.member_slots(_recipe(**{"recipe.name": ""})) is None      # not a recipe
  three = member_devices.member_slots(_recipe(**{"recipe.member_devices": 3}))
  assert [m.devices.flat[0] for m in three] == jax.devices()[:3]
  with pytest.raises(ConfigError, match="recipe.member_devices.*9 devices asked for"):
    member_devices.member_slots(_recipe(**{"recipe.member_devices": 9}))


def test_member_devices_is_validated():
  with pytest.raises(ConfigError, match="recipe.member_devices"):
    validation.validate(_recipe(**{"recipe.member_devices": -2}))
  with pytest.raises(ConfigError, match="recipe.member_devices.*mesh.shape"):
    validation.validate(_recipe(**{"recipe.member_devices": 2, "mesh.shape": (2, 1)}))
  validation.validate(_recipe(**{"recipe.member_devices": 2, "mesh.shape": (1, 1)}))


_PROBE = """
import jax
from experiments.configs import xmc
from snm_jax.train.config.overrides import with_overrides
from snm_jax.train.runtime import member_devices
config = xmc.get_config("synthetic,runlocal")
if {plain}:
  config = with_overrides(config, {{"recipe.name": ""}})
print(member_devices.request_cpu_devices(config), len(jax.devices()))
"""


@pytest.mark.parametrize("plain,force,expected", [
    (False, None, "cores"),   # a recipe: one CPU device per core
    (True, None, "one"),      # a plain run: jax's default, one CPU device
    (False, 3, "forced"),     # XLA_FLAGS chose the count: left as it is
])
def test_request_cpu_devices_in_a_fresh_process(plain, force, expected):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  if force:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={force}"
  out = subprocess.run([sys.executable, "-c", _PROBE.format(plain=plain)], cwd=ROOT, env=env,
                       capture_output=True, text=True, check=True).stdout.split()
  cores = member_devices.usable_cores()
  want = {"cores": (cores if cores >= 2 else 0, max(cores, 1)), "one": (0, 1), "forced": (0, 3)}[expected]
  assert (int(out[0]), int(out[1])) == want


def _one_device_group(root, slots, names=None, first_slot=0):
  configs = {n: with_overrides(c, {"mesh.shape": (1, 1)}) for n, c in member_configs().items()
             if names is None or n in names}
  return group_lib.CandidateGroup([(n, c, root / n) for n, c in configs.items()], sharding.make_mesh((1, 1)),
                                  mode="serial", steps_per_call=3, slots=slots, first_slot=first_slot)


def _leaves(state):
  return jax.tree.leaves(jax.device_get(state))


def test_a_moved_member_checkpoints_and_resumes_to_the_same_bits(tmp_path):
  """Trained, one member dropped and the rest dealt again (split_1 moves to device 1), checkpointed at
  step 20, resumed by a group dealt the other way round: at step 32 every state, selected state and
  test metric equals those of a group that never left device 0."""
  slots = [sharding.make_mesh((1, 1), devices=[d]) for d in jax.devices()[:2]]
  ref, moved = _one_device_group(tmp_path / "ref", None), _one_device_group(tmp_path / "moved", slots)
  for g in (ref, moved):
    assert group_lib.advance_together([g], 16)
    g.drop(["lr_x2"], {"rule": "test"})
    g.redeal(0)
  assert moved._slot == {"lr_x1": 0, "lr_x2": 1, "split_1": 1}  # pylint: disable=protected-access
  assert _devices(moved.states["split_1"]) == {jax.devices()[1]}
  assert moved.tasks["split_1"].state is None  # the new task's initial state is not kept
  assert group_lib.advance_together([moved], 20)
  moved.checkpoint()
  moved.wait()
  moved.close()
  resumed = _one_device_group(tmp_path / "moved", slots, names=("lr_x1", "split_1"), first_slot=1)
  assert resumed.step == 20
  assert _devices(resumed.states["lr_x1"]) == {jax.devices()[1]}
  for g in (ref, resumed):
    assert group_lib.advance_together([g], 32)
  for name in resumed.alive:
    assert ref.best_value(name) == resumed.best_value(name), name
    for a, b in ((ref.states[name], resumed.states[name]), (ref.best[name], resumed.best[name])):
      assert all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b))), name
  ref.finish()
  resumed.finish()
  for name in resumed.names:
    metrics = [{k: v for k, v in g.records[name]["final"].items() if k != "eval_seconds"} for g in (ref, resumed)]
    assert metrics[0] == metrics[1], name
  ref.close()
  resumed.close()


def test_members_are_spread_only_over_serial_groups():
  for over in ({"recipe.group_mode": "vmap"}, {"recipe.group": False}):
    assert member_devices.member_slots(_recipe(**over)) is None, over
    with pytest.raises(ConfigError, match="recipe.member_devices.*serial candidate groups"):
      validation.validate(_recipe(**{**over, "recipe.member_devices": 2}))
  # a mesh with a model axis: auto asks for no CPU devices at all (none would be used)
  assert member_devices._wanted(_recipe(**{"mesh.shape": (1, -1)})) == 0  # pylint: disable=protected-access
  assert member_devices._wanted(_recipe()) == -1  # pylint: disable=protected-access


def test_one_member_step_and_program_serve_every_slot_and_later_groups():
  """The member step names no device: built once for equal settings (up to the grouped fields) on
  equal data, it runs on any one-device slot, and a later group of such members (the recipe's
  other validation splits) reuses the programs an earlier one compiled."""
  from snm_jax.train.trainer import tasks
  configs = {n: with_overrides(c, {"mesh.shape": (1, 1)}) for n, c in member_configs().items()}
  meshes = [sharding.make_mesh((1, 1), devices=[d]) for d in jax.devices()[:2]]
  built = [tasks.build_task(c, m) for c, m in zip(configs.values(), meshes + meshes[:1])]
  assert built[0].member_step is built[1].member_step is built[2].member_step  # lr, split, device
  other = tasks.build_task(with_overrides(configs["lr_x1"], {"loss.logit_scale": 2.0}), meshes[0])
  assert other.member_step is not built[0].member_step
  assert group_lib._serial_programs(built[0].member_step) is group_lib._serial_programs(built[2].member_step)
  # the step of a member on device 1, run through the program traced for device 0, stays there
  step_one, _ = group_lib._serial_programs(built[0].member_step)
  batch = built[1].batches.to_global(next(built[1].batches.batcher))
  new, _ = step_one(built[1].state, batch, jax.random.key(1), np.float32(1.0))
  assert _devices(new) == {jax.devices()[1]} and int(new.step) == 1


def test_split_batch_widths_are_the_widest_auto_widths_of_the_splits(tmp_path):
  from snm_jax.data.pipeline import SparseBatcher
  from snm_jax.train.recipes import recipe
  from snm_jax.train.trainer.run_data import load_run_data
  config = member_configs()["lr_x1"]
  datas = [load_run_data(with_overrides(config, recipe.split_fields(config, i))) for i in range(3)]
  auto = [SparseBatcher(d.train.features, d.train.labels, None, global_batch_size=8) for d in datas]
  widths = recipe.split_batch_widths(config, datas)
  assert widths == {"max_nnz": max(b.max_nnz for b in auto), "max_labels": max(b.max_labels for b in auto)}
  fixed = with_overrides(config, {"dataset.max_nnz": 40})
  assert recipe.split_batch_widths(fixed, datas) == {"max_labels": max(b.max_labels for b in auto)}
  # a group pads its members' training batches at least that wide; their configs stay "auto"
  wide = {"max_nnz": widths["max_nnz"] + 8, "max_labels": widths["max_labels"] + 8}
  g = group_lib.CandidateGroup([("m", config, tmp_path / "m")], sharding.make_mesh(config.mesh.shape),
                               mode="serial", min_widths=wide)
  batcher = g.tasks["m"].batches.batcher
  assert (batcher.max_nnz, batcher.max_labels) == (wide["max_nnz"], wide["max_labels"])
  assert int(g.configs["m"].dataset.max_nnz) == 0


def test_device_free_member_step_on_a_mesh_with_a_model_axis(tmp_path):
  """The member step's shard_maps take the mesh's abstract shape: on a (2, 4) mesh, its table
  sharded over `model`, the vmapped and the serial group train the same members alike."""
  tables = {}
  for mode in ("vmap", "serial"):
    configs = {n: with_overrides(c, {"mesh.shape": (2, 4), "mining.num_strata": 4})
               for n, c in member_configs().items()}
    g = group_lib.CandidateGroup([(n, c, tmp_path / mode / n) for n, c in configs.items()],
                                 sharding.make_mesh((2, 4)), mode=mode, steps_per_call=3)
    assert g.advance(16) and g.step == 16
    state = g._member_state("lr_x2")  # pylint: disable=protected-access
    assert state.table.sharding.spec[0] == sharding.MODEL and len(state.table.devices()) == 8
    tables[mode] = {n: np.asarray(jax.device_get(g._member_state(n).table)) for n in g.alive}  # pylint: disable=protected-access
  for name, table in tables["vmap"].items():
    np.testing.assert_allclose(tables["serial"][name], table, atol=1e-6)
    assert np.abs(table).max() > 1e-3  # (trained)
