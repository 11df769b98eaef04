"""Multi-host start-up on JAX's own distributed runtime (`jax.distributed`)."""

from __future__ import annotations

import os

import jax
from absl import logging

# Environment variables that mean "this process is one of several": SLURM and
# TPU-VM pods set theirs; `launch/local_multiprocess.sh` sets JAX_COORDINATOR_ADDRESS.
_MULTI_PROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES",
                      "MEGASCALE_COORDINATOR_ADDRESS")


def wants_distributed(dist_config) -> bool:
  mode = dist_config.initialize
  if mode == "yes":
    return True
  if mode == "no":
    return False
  if dist_config.coordinator_address:
    return True
  if os.environ.get("SLURM_NTASKS", "1") not in ("", "1"):
    return True
  return any(os.environ.get(v) for v in _MULTI_PROCESS_ENV if v != "SLURM_NTASKS")


def maybe_initialize(dist_config) -> None:
  """Calls `jax.distributed.initialize` when asked by the config or environment.

  Explicit config fields win; otherwise JAX's cluster auto-detection (SLURM,
  TPU VMs, and the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
  JAX_PROCESS_ID variables) supplies coordinator, process count and id.
  """
  if not wants_distributed(dist_config):
    return
  kwargs = {}
  if dist_config.coordinator_address:
    kwargs["coordinator_address"] = dist_config.coordinator_address
  if dist_config.num_processes:
    kwargs["num_processes"] = dist_config.num_processes
  if dist_config.process_id >= 0:
    kwargs["process_id"] = dist_config.process_id
  if "coordinator_address" not in kwargs and os.environ.get("JAX_COORDINATOR_ADDRESS"):
    kwargs = {"coordinator_address": os.environ["JAX_COORDINATOR_ADDRESS"],
              "num_processes": int(os.environ["JAX_NUM_PROCESSES"]),
              "process_id": int(os.environ["JAX_PROCESS_ID"])}
  jax.distributed.initialize(**kwargs)
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
