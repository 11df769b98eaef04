"""A recipe's candidate members spread over devices, one member per device: on CPU, one per core.

XLA:CPU splits one program's matmuls over the cores, and on the small matmuls of a recipe's
members that scales poorly: on 2 cores, two Delicious wide-and-deep members' steps took 13.2 ms
per member-step on one CPU device (each step on both cores, one after the other) against 11.0 ms
with each member on its own CPU device (both steps at once, one per core), Bibtex's linear members
4.5 against 3.7 ms (2026-11-28, interleaved in one process; benchmarks/member_devices.py).

`request_cpu_devices` gives the process one CPU device per core, as the process starts
(`jax_num_cpu_devices`, before the backends exist; experiments.train and experiments.demo call it
for a recipe); `member_slots` are the one-device meshes a recipe deals its group members over
(`snm_jax.train.trainer.group.CandidateGroup`'s `slots`). Neither jax nor XLA has a mode that runs
independent programs of one device side by side, hence the devices.
"""

from __future__ import annotations

import os

import jax
from absl import logging

from snm_jax import sharding
from snm_jax.errors import ConfigError
from snm_jax.train.runtime.distributed import wants_distributed

ONE_DEVICE_SHAPES = ((-1, 1), (1, 1))  # the mesh shapes a one-device member stands for


def usable_cores() -> int:
  """The cores this process may run on (its CPU affinity where the OS reports one)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # (not on every OS)
    return os.cpu_count() or 1


def _wanted(config) -> int:
  """How many member devices `config` asks for: 0 = none, -1 = one per core. 0 also when its
  groups would not deal members over devices (only serial groups do: `recipe.group` off, or
  `recipe.group_mode` vmap) and, for -1, when its mesh is not one device per member."""
  recipe = config.get("recipe")
  if recipe is None or not recipe.get("name", ""):
    return 0
  wanted = int(recipe.get("member_devices", 0))
  if not recipe.get("group", True) or recipe.get("group_mode", "auto") == "vmap":
    return 0  # (validation refuses an explicit count then)
  if wanted < 0 and tuple(config.mesh.shape) not in ONE_DEVICE_SHAPES:
    return 0
  return wanted


def _cpu_platform_possible() -> bool:
  """False when jax_platforms (JAX_PLATFORMS) names platforms and cpu is not the first of them."""
  platforms = jax.config.jax_platforms or ""
  return not platforms or platforms.split(",")[0].strip() == "cpu"


def request_cpu_devices(config) -> int:
  """Gives this process one CPU device per core (recipe.member_devices = -1) or n (n > 0) when
  `config` is a single-process recipe that spreads its members and nothing chose the CPU device
  count already (XLA_FLAGS' --xla_force_host_platform_device_count, jax_num_cpu_devices). Call it
  before any jax computation. Returns the count set, 0 when it left it."""
  wanted = _wanted(config)
  if wanted == 0 or wants_distributed(config.distributed) or (wanted < 0 and not _cpu_platform_possible()):
    return 0
  if ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
      or jax.config.jax_num_cpu_devices != -1):
    return 0
  count = usable_cores() if wanted < 0 else wanted
  if count < 2:
    return 0
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError as e:  # the backends exist already: the members share the config's mesh
    logging.warning("recipe.member_devices: the CPU devices were created before the recipe could ask "
                    "for one per core (%s); its members share one mesh", e)
    return 0
  return count


def member_slots(config) -> list | None:
  """The one-device meshes the recipe `config` deals its group members over, or None: every
  member on the config's mesh (recipe.member_devices = 0; auto off the CPU backend, with several
  processes, with another mesh shape, or with fewer than two such devices).

  Raises ConfigError for an explicit count with several processes or more devices than there are."""
  wanted = _wanted(config)
  if wanted == 0:
    return None
  if wanted < 0:
    if jax.default_backend() != "cpu" or jax.process_count() > 1:
      return None
    devices = jax.local_devices()[:usable_cores()]
  else:
    if jax.process_count() > 1:
      raise ConfigError("recipe.member_devices", f"{wanted} one-device members in a run of "
                        f"{jax.process_count()} processes: set 0 (every member on the mesh)")
    if wanted > jax.local_device_count():
      raise ConfigError("recipe.member_devices", f"{wanted} devices asked for, this process has "
                        f"{jax.local_device_count()}")
    devices = jax.local_devices()[:wanted]
  if len(devices) < 2:
    return None
  return [sharding.make_mesh((1, 1), devices=[d]) for d in devices]
