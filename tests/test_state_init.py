"""The initial state's program is shared by the runs that differ only in what it does not depend on
(`classification.create_state`): the seed (its argument), the class table's learning rate and the
validation split; anything else builds another program. Each run still gets its own seed's state."""

import jax
import numpy as np

from snm_jax import sharding
from snm_jax.train.trainer import classification
from snm_jax.train.trainer.tasks import build_task
import run_configs


def _state(mesh, **fields):
  config = run_configs.synthetic(32, 256, 32, 8, {"mesh.shape": (1, 2), **fields})
  before = set(map(id, classification._INIT_PROGRAMS.values()))  # pylint: disable=protected-access
  state = build_task(config, mesh).state
  new = [p for p in classification._INIT_PROGRAMS.values() if id(p) not in before]  # pylint: disable=protected-access
  return state, len(new)


def test_runs_differing_in_seed_or_table_learning_rate_share_the_initialiser():
  mesh = sharding.make_mesh((1, 2))
  first, built = _state(mesh, seed=3, **{"table.learning_rate": 0.5})
  again, built_again = _state(mesh, seed=3, **{"table.learning_rate": 2.0})
  other_seed, built_other = _state(mesh, seed=4, **{"dataset.validation_seed": 5})
  assert built <= 1 and built_again == 0 and built_other == 0
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(first.table), np.asarray(other_seed.table))
  assert first.table.sharding.spec == other_seed.table.sharding.spec == sharding.TABLE
  _, built_wider = _state(mesh, seed=3, **{"model.hidden": 48})  # another shape: another program
  assert built_wider == 1
