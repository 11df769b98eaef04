"""Orbax checkpointing of the train state and the input-iterator position.

A checkpoint holds `state` (every array, with its sharding restored from the
*target* shardings, so an 8-device checkpoint restores onto 4 or 1 devices)
and `data` (the iterator's JSON state). Restoring falls back to the previous
checkpoint, with a warning, when the latest one is corrupt or partial.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils


class Checkpointer:
  def __init__(self, directory, keep: int = 2, async_save: bool = True):
    self.directory = Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(
        create=True,
        preservation_policy=ocp.checkpoint_managers.LatestN(keep),
        enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data"))

  def save(self, step: int, state, data_state: dict, force: bool = True) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force)

  def restore_latest(self, abstract_state):
    """Returns (step, state, data_state) from the newest readable checkpoint, or None.

    `abstract_state` is a pytree of jax.ShapeDtypeStruct with the target shardings.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      try:
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return step, out["state"], dict(out["data"])
      except Exception as e:  # pylint: disable=broad-except
        # Orbax raises many types for truncated/corrupt files; any of them means
        # "this step is unusable", and the previous one is tried.
        logging.warning("checkpoint at step %d in %s is unreadable (%s: %s); moved to %s, "
                        "trying the previous one", step, self.directory, type(e).__name__,
                        str(e)[:200], self._quarantine(step))
    return None

  def _quarantine(self, step: int) -> Path:
    """Moves an unreadable step aside (kept for inspection) so it can be re-saved."""
    target = self.directory.parent / f"{self.directory.name}.corrupt" / str(step)
    if jax.process_index() == 0:
      target.parent.mkdir(parents=True, exist_ok=True)
      if target.exists():
        shutil.rmtree(target)
      shutil.move(str(self.directory / str(step)), str(target))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"quarantine checkpoint {step}")
    self.manager.reload()
    return target

  def delete_after(self, step: int) -> None:
    """Deletes saved steps > `step` (e.g. a best-so-far state newer than the
    checkpoint a run resumed from: the resumed run will recompute it)."""
    for later in [s for s in self.manager.all_steps() if s > step]:
      logging.info("deleting %s/%d: newer than the restored step %d", self.directory, later, step)
      self.manager.delete(later)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree):
  """ShapeDtypeStructs with the shardings of `tree` (the restore target)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
