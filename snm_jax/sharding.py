"""Mesh construction and every sharding rule of the project, in one place.

The mesh has two axes:
  * ``data``  - the minibatch is split over it (data parallelism);
  * ``model`` - the class-embedding table is split by rows over it.
The dense tower is replicated. A mesh of shape (1, 1) runs the very same
code on one device, which is how single-device runs stay bit-compatible
with sharded ones.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np

from snm_jax.errors import ConfigError

DATA = "data"
MODEL = "model"
AXES = (DATA, MODEL)

# Rules, by role of the array.
BATCH = jax.P(DATA)            # (N, ...) arrays of the minibatch.
TABLE = jax.P(MODEL, None)     # (K, h) class-embedding table, row-sharded.
TABLE_ROWS = jax.P(MODEL)      # (K,) per-row optimiser state.
REPLICATED = jax.P()


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, int]:
  """Fills at most one -1 entry of (data, model) so that the product is num_devices.

  A fully specified shape may use fewer devices than there are (the first ones).
  """
  shape = tuple(int(s) for s in shape)
  if len(shape) != 2:
    raise ConfigError("mesh.shape", f"expected (data, model), got {shape}")
  if shape.count(-1) > 1:
    raise ConfigError("mesh.shape", f"at most one -1 allowed, got {shape}")
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if known <= 0 or num_devices % known:
      raise ConfigError("mesh.shape", f"{shape} does not divide {num_devices} devices")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) > num_devices or min(shape) < 1:
    raise ConfigError("mesh.shape", f"{shape} needs {math.prod(shape)} devices, have {num_devices}")
  return shape  # type: ignore[return-value]


def make_mesh(shape: Sequence[int] = (-1, 1), devices=None) -> jax.sharding.Mesh:
  """Builds the (data, model) mesh; `shape` may contain one -1."""
  devices = list(devices if devices is not None else jax.devices())
  data, model = resolve_mesh_shape(shape, len(devices))
  # Label shards vary fastest so that a model group sits inside one host where
  # possible: the all-gather of mined candidates then stays on fast links.
  grid = np.asarray(devices[:data * model]).reshape(data, model)
  return jax.sharding.Mesh(grid, AXES)


def named(mesh, spec) -> jax.NamedSharding:
  return jax.NamedSharding(mesh, spec)


def check_divisible(field: str, value: int, mesh, axis: str) -> None:
  n = mesh.shape[axis]
  if value % n:
    raise ConfigError(field, f"{value} is not divisible by the mesh's {axis!r} axis size {n}")


def assert_table_sharded(table: jax.Array, mesh) -> None:
  """Fails loudly if the class table is not actually row-sharded over `model`."""
  want = mesh.shape[MODEL]
  shard_rows = {s.data.shape[0] for s in table.addressable_shards}
  expected = table.shape[0] // want
  if shard_rows != {expected}:
    raise AssertionError(
        f"class table {table.shape} is not row-sharded over {want} model shards: "
        f"addressable shard rows {sorted(shard_rows)}")
