"""Orbax checkpointing of the train state and the input-iterator position.

A checkpoint holds `state` (every array, with its sharding restored from the
*target* shardings, so an 8-device checkpoint restores onto 4 or 1 devices)
and `data` (JSON: the iterator's state, the run's progress record, and
`state_sha256`, the digest of the state's arrays, `state_digest`).

Restoring (`restore_latest`) tries the checkpoints newest first. One is
*unreadable* when orbax cannot restore it (truncated, corrupt, missing files),
when the restored arrays do not match their digest (e.g. a flipped bit), or
when the caller's `accept` check refuses it (e.g. an iterator position outside
its epoch). Unreadable checkpoints newer than the one used are moved to
`<dir>.corrupt/<step>` with a warning. When none is readable the run starts
over, loudly, or stops (`on_unreadable="fail"`) leaving every file in place.

`check_resume_config` compares a workdir's saved config.json with the config
that resumes it, before anything is restored: only fields that do not change
the state's shapes, the data order or the trajectory may differ.
"""

from __future__ import annotations

import hashlib
import sys

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from snm_jax.errors import CheckpointError, ConfigError
from snm_jax.train.config import builders
from snm_jax.train.runtime.host import is_writer, to_host
from snm_jax.train.config.overrides import RENAMED_FIELDS
from snm_jax.train.runtime.workpath import workdir_path

DIGEST_KEY = "state_sha256"
ON_UNREADABLE = ("restart", "fail")

# Fields that may differ between a workdir's saved config.json and the config resuming it: the run's
# length and cadences, the non-finite policy, evaluation settings (not the selection metric), the mesh
# and cluster (a checkpoint restores onto any mesh), where the data is found, and the recipe fields (a
# recipe's candidates are plain runs). An entry ending in "." covers its whole section. Every other
# field changes the state's shapes, the data order or the training trajectory.
RESUMABLE_FIELDS = ("train.num_steps", "train.log_every", "train.eval_every", "train.checkpoint_every",
                    "train.keep_checkpoints", "train.fingerprint", "train.patience",
                    "train.on_nonfinite", "train.max_skipped_steps", "train.on_unreadable_checkpoints",
                    "train.preemption_signals", "dataset.read_threads", "dataset.prefetch",
                    "dataset.workers", "dataset.format", "dataset.shards",
                    "eval.", "diagnostics.", "mesh.", "distributed.", "dataset.data_dir", "recipe.")
NOT_RESUMABLE = ("eval.select_metric",)
# Fields added since some workdirs were written, with the value their absence meant: a saved
# config.json without one is compared as if it held it (model.input_update=sparse changes the
# state's pytree, so resuming an older workdir with it must be refused, not restarted; a bfloat16
# model.dtype / table.dtype changes the trajectory, and table.dtype the table's dtype). table.rounding
# is not listed: it acts only on a bfloat16 table, which no workdir written before it has.
ADDED_FIELDS = {"model.input_update": "dense", "model.dtype": "float32", "table.dtype": "float32",
                "dataset.format": "memory", "dataset.shards": "", "dataset.read_threads": 1,
                "dataset.prefetch": 2, "dataset.workers": 0, "train.preemption_signals": "SIGTERM"}


def state_digest(state) -> str:
  """sha256 over every leaf of `state`: its path, dtype, shape and bytes (C order).

  Computed from the host-gathered value of each array (`to_host`, a collective
  on several processes: every process must call it), so it depends only on the
  values, not on the mesh or the process count: a checkpoint saved on 8
  devices verifies when restored onto 1. Costs one device-to-host copy of the
  state per save and per restore, the same order as writing it.
  """
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    value = np.ascontiguousarray(to_host(leaf))
    h.update(f"{jax.tree_util.keystr(path)}|{value.dtype.str}|{value.shape};".encode())
    h.update(value.tobytes())
  return h.hexdigest()


def _single_replica_writes_on_one_process() -> None:
  """On one process, orbax writes each shard of a jax.Array whole from its first replica.

  orbax's default on CPU/TPU (replica-parallel saving) splits a shard replicated R ways into R
  slices, each written by the replica holding it: that spreads the bytes over hosts, but on one
  process every slice is written by the same process anyway, and each is cut by an eager
  `lax.slice_in_dim`, one XLA compile per (shape, slice, device): 48 compiles, ~2 s of CPU, for
  the first save of a small model on 8 devices. Writing the first replica's shard whole (orbax's
  GPU default) saves the same values (the same digest, the same restored state); only the chunk
  shape on disk follows the shard instead of its slice, which a restore reads either way. With
  several processes orbax's default is kept. ArrayHandler has no public setter for it; the
  registered handler is orbax's default one, left otherwise as it is.
  """
  if jax.process_count() == 1:
    ocp.type_handlers.get_type_handler(jax.Array)._use_replica_parallel = False  # pylint: disable=protected-access


class Checkpointer:
  def __init__(self, directory, keep: int = 2, async_save: bool = True):
    _single_replica_writes_on_one_process()
    # Local: absolute; a URI (gs://...) as it is: orbax writes it with epath and TensorStore's
    # remote drivers, and commits a step with a commit_success.txt file instead of a rename.
    self.directory = workdir_path(directory)
    options = ocp.CheckpointManagerOptions(
        create=True,
        preservation_policy=ocp.checkpoint_managers.LatestN(keep),
        enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data"))

  def save(self, step: int, state, data_state: dict, force: bool = True) -> None:
    """Saves `state` and the JSON `data_state`, plus the state's digest (`state_digest`)."""
    data_state = {**data_state, DIGEST_KEY: state_digest(state)}
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore_latest(self, abstract_state, accept=None, on_unreadable: str = "restart"):
    """Returns (step, state, data_state) from the newest usable checkpoint, or None.

    Args:
      abstract_state: pytree of jax.ShapeDtypeStruct with the target shardings.
      accept: optional `(step, state, data_state) -> None` that raises if the
        checkpoint cannot be used (e.g. `SparseBatcher.set_state` refusing the
        iterator position); the checkpoint is then unreadable like a corrupt one.
      on_unreadable: when no checkpoint is usable, "restart" moves them all
        aside, warns on the log and on stderr that the run starts over, and
        returns None; "fail" raises CheckpointError and moves nothing.
    """
    if on_unreadable not in ON_UNREADABLE:
      raise ValueError(f"on_unreadable={on_unreadable!r} is not one of {ON_UNREADABLE}")
    failures = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        state, data = self.restore(step, abstract_state)
        if accept is not None:
          accept(step, state, data)
      except Exception as e:  # pylint: disable=broad-except
        # Orbax raises many types for truncated/corrupt files; any of them means
        # "this step is unusable", and the previous one is tried.
        failures.append((step, f"{type(e).__name__}: {str(e)[:300]}"))
        logging.warning("checkpoint at step %d in %s is unreadable (%s); trying the previous one",
                        step, self.directory, failures[-1][1])
        continue
      for bad, _ in failures:
        logging.warning("unreadable checkpoint %s/%d moved to %s", self.directory, bad,
                        self._quarantine(bad))
      if failures:
        logging.warning("resuming from step %d, the newest readable checkpoint in %s", step,
                        self.directory)
      return step, state, data
    if not failures:
      return None
    reasons = "; ".join(f"step {s}: {why}" for s, why in failures)
    if on_unreadable == "fail":
      raise CheckpointError(
          f"every checkpoint in {self.directory} is unreadable ({reasons}); nothing was moved "
          "(train.on_unreadable_checkpoints='fail'): inspect them, or delete the folder or set "
          "train.on_unreadable_checkpoints='restart' to train from step 0")
    moved = [str(self._quarantine(s)) for s, _ in failures]
    message = (f"WARNING: every checkpoint in {self.directory} is unreadable ({reasons}); they were "
               f"moved to {self._quarantine_root()} and the run STARTS OVER from step 0 "
               "(train.on_unreadable_checkpoints='fail' stops instead)")
    logging.warning("%s", message)
    if is_writer():
      print(message, file=sys.stderr, flush=True)
    return None

  def restore(self, step: int, abstract_state):
    """(state, data_state) of the checkpoint of `step`, its arrays verified against their digest;
    raises (orbax's errors, CheckpointError) when it is unreadable."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    state, data = out["state"], dict(out["data"])
    self._verify(step, state, data)
    return state, data

  def _verify(self, step: int, state, data: dict) -> None:
    """Raises if the restored state's digest differs from the one saved with it."""
    saved = data.pop(DIGEST_KEY, None)
    if saved is None:
      logging.warning("checkpoint at step %d in %s has no %s (saved before digests were written): "
                      "its arrays are not verified", step, self.directory, DIGEST_KEY)
      return
    got = state_digest(state)
    if got != saved:
      raise CheckpointError(f"the restored arrays' sha256 {got[:16]}... differs from the "
                            f"{saved[:16]}... saved with them (corrupt data files)")

  def _quarantine_root(self):
    return self.directory.parent / f"{self.directory.name}.corrupt"

  def _quarantine(self, step: int):
    """Moves an unreadable step aside (kept for inspection) so it can be re-saved.

    A sibling folder, so locally a rename within one filesystem; on an object
    store epath's rename is a copy then a delete, not atomic.
    """
    target = self._quarantine_root() / str(step)
    if is_writer():
      target.parent.mkdir(parents=True, exist_ok=True)
      if target.exists():
        target.rmtree()
      source = self.directory / str(step)
      if source.exists():
        source.rename(target)
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


def saved_steps(directory) -> list[int]:
  """The steps of the checkpoints in `directory`, ascending (none when it does not exist), read
  from its listing without opening a checkpoint manager."""
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def abstract_like(tree):
  """ShapeDtypeStructs with the shardings of `tree` (the restore target)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _flatten(tree: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def resumable(field: str) -> bool:
  """True for a field that may change between a run and its resumption (RESUMABLE_FIELDS)."""
  return field not in NOT_RESUMABLE and _listed(field, RESUMABLE_FIELDS)


def _current_names(flat: dict) -> dict:
  """A flattened config with RENAMED_FIELDS under their new names (a config.json written before
  the rename, e.g. `loss.scale`, is compared as `loss.logit_scale`)."""
  return {RENAMED_FIELDS.get(f, f): v for f, v in flat.items()}


def config_differences(saved: dict, new: dict) -> list[tuple[str, object, object]]:
  """(field, saved value, new value) for every dotted field present in both JSON configs that
  differs, sorted. Fields only one side has (added or removed since) are not compared, except
  ADDED_FIELDS, which a saved config lacks with their listed value; a field `saved` holds under
  its old name (RENAMED_FIELDS) is compared under the new one."""
  a, b = _current_names(_flatten(saved)), _flatten(new)
  a = {**{f: v for f, v in ADDED_FIELDS.items() if f in b}, **a}
  inert = _inert_fields(saved, new)
  return sorted((f, a[f], b[f]) for f in a.keys() & b.keys() if a[f] != b[f] and f not in inert)


def _inert_fields(saved: dict, new: dict) -> set[str]:
  """Fields that change nothing for either config: model.input_update when neither has a gathered
  EmbeddingBag (e.g. bag_matmul=dense, or the linear model), so a workdir written before the field
  existed resumes under its new default; the diagnostics' settings when neither runs them
  (diagnostics.every = 0)."""
  configs = [ml_collections.ConfigDict(c) for c in (saved, new)]
  inert = set() if any(builders.gathered_bag(c) for c in configs) else {"model.input_update"}
  if all(c.get("diagnostics", {}).get("every", 0) == 0 for c in configs):  # no diagnostics run
    inert |= {f"diagnostics.{k}" for c in configs for k in c.get("diagnostics", {}).keys()}
  return inert


# Fields that change neither the trajectory nor the results a finished run reports (recipe.*: a
# recipe's candidates are plain runs, recipe.name cleared, which read none of them).
REUSABLE_FIELDS = ("train.log_every", "train.checkpoint_every", "train.keep_checkpoints", "train.fingerprint",
                   "train.on_unreadable_checkpoints", "train.preemption_signals", "mesh.", "distributed.",
                   "dataset.data_dir", "dataset.read_threads", "dataset.prefetch", "dataset.workers", "recipe.")


def check_finished_config(saved: dict, new: dict, where) -> None:
  """Raises ConfigError when a finished run's saved config.json differs from the config about to
  reuse its results.json in a field that changes them (anything but REUSABLE_FIELDS; fields added
  since compare as ADDED_FIELDS): a finished run is never silently taken for another config."""
  diffs = [d for d in config_differences(saved, new) if not _listed(d[0], REUSABLE_FIELDS)]
  if diffs:
    raise _differences_error(diffs, f"{where} holds a finished run (results.json) of the saved "
                             "config.json, not of this config. Use a new workdir, or delete that "
                             "run's folder to retrain it.")


def _listed(field: str, entries) -> bool:
  """Whether `field` is one of `entries` (an entry ending in '.' is a whole section)."""
  return any(field.startswith(f) if f.endswith(".") else field == f for f in entries)


def _differences_error(diffs, why: str) -> ConfigError:
  """The ConfigError naming the first differing field, listing the others, then `why`."""
  field, old, cur = diffs[0]
  others = "; ".join(f"{f}: saved {o!r}, now {c!r}" for f, o, c in diffs[1:])
  return ConfigError(field, f"saved {old!r}, now {cur!r}" + (f" (also differ: {others})" if others else "")
                     + f": {why}")


def check_resume_config(saved: dict, new: dict, where) -> None:
  """Raises ConfigError naming every field that differs between `saved` (the workdir's
  config.json) and `new` (JSON of the config about to resume it) and may not change on
  resume (`resumable`). Logs the resumable ones that changed."""
  diffs = config_differences(saved, new)
  old_names = sorted(f for f in _flatten(saved) if f in RENAMED_FIELDS)
  if old_names:
    logging.info("the saved config.json of %s uses old field names: %s (compared under the new names)",
                 where, "; ".join(f"{f}: renamed to {RENAMED_FIELDS[f]}" for f in old_names))
  changed = [d for d in diffs if resumable(d[0])]
  refused = [d for d in diffs if not resumable(d[0])]
  if changed:
    logging.info("resuming %s with changed fields: %s", where,
                 ", ".join(f"{f} {old!r} -> {cur!r}" for f, old, cur in changed))
  if refused:
    raise _differences_error(
        refused, f"{where} holds checkpoints of the saved config.json, and these fields change the "
        "state's shapes, the data order or the training. Resume with the saved values (allowed: "
        f"{refused[0][1]!r}) or use a new --workdir; fields that may change on resume: "
        f"{', '.join(RESUMABLE_FIELDS)} (a '.' entry is a whole section)")
