"""A candidate group locks every member's workdir while it trains, as a single run locks its own:
a member workdir held by another run stops the group before anything is trained or written."""

import pytest

from snm_jax import sharding
from snm_jax.errors import WorkdirInUseError
from snm_jax.train.recipes import candidates
from snm_jax.train.runtime.host import workdir_lock
from test_candidate_group import base_config, member_configs


def test_a_locked_member_workdir_stops_the_group(tmp_path):
  configs = member_configs()
  members = [(name, 0, config, tmp_path / name) for name, config in configs.items()]
  mesh = sharding.make_mesh(configs["lr_x1"].mesh.shape)
  with workdir_lock(tmp_path / "lr_x2"):  # another run holds one member's workdir
    with pytest.raises(WorkdirInUseError, match="lr_x2"):
      candidates.train(base_config(), members, mesh)
  assert not any((tmp_path / name / "results.json").exists() for name in configs)
  assert not any((tmp_path / name / "config.json").exists() for name in configs)
  # Released on the error: the same members train once the other run is gone.
  out = candidates.train(base_config(), members, mesh)
  assert sorted(n for n, _ in out) == sorted(configs) and all("final" in r for r in out.values())
