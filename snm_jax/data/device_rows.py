"""Training rows held on the devices: a batch crosses from the host as row indices.

A `SparseBatcher` with `rows_on_device` whose rows are padded once in host memory yields, per
batch, "row" int32 (n,) in place of feat_ids, feat_vals and label_set. `DeviceRows` places the
padded arrays (`SparseBatcher.device_tables`) on every device of the mesh once, replicated, and
gathers a global batch's rows there in one jitted call: each device gathers the rows of its own
data shard, so nothing is communicated. The batch is the same arrays as the host's gather,
without the host building and transferring ~(8 max_nnz + 4 max_labels) bytes per example per
step on the cores the train step runs on (Delicious: 1.3 MB per batch of 512).

Neither Grain nor jax has this: Grain's batches are host arrays, and jax's transfers move them.
"""
from __future__ import annotations

import jax
import numpy as np

from snm_jax.data.pipeline import make_global_batch, make_stacked_global_batch


class DeviceRows:
  """The padded rows of `batcher` on the devices of `mesh`. `to_global(local_batch)`: this
  process's slice of a batch as the step's global arrays (`pipeline.make_global_batch`'s); a
  batch holding "row" crosses as ONE (n, columns) int32 array of its per-example columns (row,
  label, valid, example_id: one transfer, not four; each costs ~0.2 ms of host time) and is
  completed on the devices."""

  def __init__(self, batcher, mesh):
    self.batcher, self.mesh = batcher, mesh
    self._tables = None   # (widths, {name: replicated jax.Array})
    self._gathers = {}    # (column names and dtypes, the packed array's sharding) -> jitted gather

  def tables(self) -> dict:
    """The batcher's `device_tables()` as replicated global arrays; placed again when a width
    changes (a candidate group widens its members' batches before their first step)."""
    widths = (self.batcher.max_nnz, self.batcher.max_labels)
    if self._tables is None or self._tables[0] != widths:
      host = self.batcher.device_tables()
      replicated = jax.NamedSharding(self.mesh, jax.P())
      # make_array_from_callback: each process places its own (identical) copy on its devices.
      self._tables = (widths, {name: jax.make_array_from_callback(a.shape, replicated,
                                                                  lambda index, a=a: a[index])
                               for name, a in host.items()})
    return self._tables[1]

  def _gather(self, columns: tuple, packed: jax.Array):
    key = (columns, packed.ndim, packed.sharding)
    if key not in self._gathers:
      # Every output is sharded as the packed array's leading axes (the rows; after the steps').
      out = jax.NamedSharding(self.mesh, jax.P(*packed.sharding.spec[:packed.ndim - 1]))

      def gather(tables, packed):  # packed (..., n, columns); its "row" in [0, N]: never out of range
        cols = {name: packed[..., i].astype(dtype) for i, (name, dtype) in enumerate(columns)}
        row = cols.pop("row")
        return {**cols, **{name: t.at[row].get(mode="promise_in_bounds") for name, t in tables.items()}}

      self._gathers[key] = jax.jit(gather, out_shardings=out)
    return self._gathers[key]

  @staticmethod
  def _pack(local_batch: dict) -> tuple[tuple, np.ndarray]:
    """((name, dtype) per column, int32 (n, columns)): the batch's per-example columns."""
    names = sorted(local_batch)
    return (tuple((name, np.asarray(local_batch[name]).dtype) for name in names),
            np.stack([np.asarray(local_batch[name], np.int32) for name in names], axis=1))

  def to_global(self, local_batch: dict) -> dict:
    if "row" not in local_batch:
      return make_global_batch(local_batch, self.mesh)
    columns, packed = self._pack(local_batch)
    packed = make_global_batch({"packed": packed}, self.mesh)["packed"]
    return self._gather(columns, packed)(self.tables(), packed)

  def to_global_stacked(self, local_batches: list[dict], global_batch_size: int) -> dict:
    """Several batches stacked on a leading axis, (k, global batch, ...) sharded as
    `pipeline.make_stacked_global_batch` places them (a scan's k steps)."""
    if "row" not in local_batches[0]:
      return make_stacked_global_batch(local_batches, self.mesh, global_batch_size)
    packs = [self._pack(b) for b in local_batches]
    packed = make_stacked_global_batch([{"packed": p} for _, p in packs], self.mesh,
                                       global_batch_size)["packed"]
    return self._gather(packs[0][0], packed)(self.tables(), packed)
