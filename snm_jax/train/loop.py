"""`train_and_evaluate(config, workdir)`: the whole run, resumable from `workdir`.

Sections: data -> mesh -> model and step -> state (created sharded) ->
checkpoint restore -> loop (step, log, eval, checkpoint) -> final evaluation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from snm_jax import sharding
from snm_jax.data.conversions import conversion_fn
from snm_jax.data.pipeline import SparseBatcher, make_global_batch, process_data_slice
from snm_jax.mining.samplers import padded_num_labels
from snm_jax.errors import ConfigError, NonFiniteLossError
from snm_jax.train import builders
from snm_jax.train.checkpointing import Checkpointer, abstract_like, check_resume_config
from snm_jax.train.evaluate import make_evaluate
from snm_jax.train.host import itstime, to_host, workdir_lock
from snm_jax.train.progress import Progress
from snm_jax.train.run_data import load_run_data
from snm_jax.train.step import TrainState, make_train_step
from snm_jax.train.writers import MetricWriter


def create_state(config, tower, table_rows, dim, tx, row_opt, mesh, max_nnz):
  """Initialises the state directly with its shardings (no full table on one device)."""
  key = jax.random.key(config.seed)
  k_tower, k_table = jax.random.split(key)
  dummy_ids = jnp.zeros((1, max_nnz), jnp.int32)
  dummy_vals = jnp.zeros((1, max_nnz), jnp.float32)

  num_model = mesh.shape[sharding.MODEL]
  strata = config.mining.num_strata
  scale = builders.table_init_scale(config)

  def init_table_shard():
    # Block by block inside a fori_loop, each block from a key of (stratum,
    # block): the table is the same on any mesh (a stratum never straddles two
    # shards), and the init's temporaries are one block, not ~3x the table
    # (threefry bits + floats) as a single jax.random.normal would need.
    j = jax.lax.axis_index(sharding.MODEL)
    per_shard = strata // num_model
    rows = table_rows // strata
    block = min(rows, 65_536)
    blocks_per_stratum = -(-rows // block)

    def body(i, buf):
      local_s, b = i // blocks_per_stratum, i % blocks_per_stratum
      start = jnp.minimum(b * block, rows - block)  # the last block is shifted back
      key = jax.random.fold_in(jax.random.fold_in(k_table, j * per_shard + local_s), b)
      values = scale * jax.random.normal(key, (block, dim), jnp.float32)
      return jax.lax.dynamic_update_slice_in_dim(buf, values, local_s * rows + start, 0)

    return jax.lax.fori_loop(0, per_shard * blocks_per_stratum, body,
                             jnp.zeros((per_shard * rows, dim), jnp.float32))

  init_table = jax.shard_map(init_table_shard, mesh=mesh, in_specs=(),
                             out_specs=sharding.TABLE, check_vma=False)

  def init():
    params = tower.init(k_tower, dummy_ids, dummy_vals)
    table = init_table()
    return TrainState.create(params=params, opt_state=tx.init(params),
        table=table,
        table_state=row_opt.init(table_rows, dim))

  abstract = jax.eval_shape(init)
  replicated = sharding.named(mesh, sharding.REPLICATED)
  shardings = jax.tree.map(lambda _: replicated, abstract)
  shardings = shardings.replace(
      table=sharding.named(mesh, sharding.TABLE),
      table_state=jax.tree.map(lambda x: sharding.named(mesh, jax.P(sharding.MODEL, *[None] * (x.ndim - 1))),
                               abstract.table_state))
  state = jax.jit(init, out_shardings=shardings)()
  sharding.assert_table_sharded(state.table, mesh)
  return state


def state_fingerprint(state) -> str:
  """sha256 of every parameter and table byte: equal fingerprints = bitwise-equal runs."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves((state.params, state.table, state.table_state, state.opt_state)):
    h.update(np.ascontiguousarray(to_host(leaf)).tobytes())
  return h.hexdigest()


def _fit_tree(config, run_data):
  """Fits Bamler & Mandt's tree on the training (point, label) pairs of the conversion."""
  from snm_jax.adversarial.training import fit_tree_sampler  # pylint: disable=g-import-not-at-top
  if not 0 < config.adversarial.pca_dim <= run_data.num_features:
    raise ConfigError("adversarial.pca_dim", f"{config.adversarial.pca_dim} must be in "
                      f"[1, num_features={run_data.num_features}]")
  rows, labels = conversion_fn(config.dataset.conversion, run_data.train.labels, config.seed)(0)
  t0 = time.perf_counter()
  sampler = fit_tree_sampler(run_data.train.features[rows], labels, run_data.num_labels,
                             pca_dim=config.adversarial.pca_dim, reg=config.adversarial.node_reg,
                             num_samples=config.mining.num_samples,
                             max_reassign_iters=config.adversarial.max_reassign_iters)
  logging.info("adversarial tree fitted on %d pairs, C=%d, in %.1fs", len(labels),
               run_data.num_labels, time.perf_counter() - t0)
  return sampler


def _scalars(metrics_dev) -> dict:
  return {k: float(v) for k, v in jax.device_get(metrics_dev).items()}


def train_and_evaluate(config, workdir) -> dict:
  """Trains, evaluates and writes config.json, metrics.jsonl, results.json (process 0).

  With a validation split (`dataset.validation_fraction` > 0) every evaluation
  also scores it, the state with the best `eval.select_metric` on it is kept
  in `workdir/best`, training stops after `train.patience` evaluations without
  improvement (if > 0), and `results["final"]` is the test evaluation of that
  selected state; without one it is the last state's.

  Before anything runs: every config field is validated (ConfigError), the
  workdir is locked for the whole run (WorkdirInUseError if another run holds
  it; released at the end, on errors too), and a workdir with checkpoints is
  resumed only by a config whose shape- and trajectory-changing fields equal
  its saved config.json (`checkpointing.check_resume_config`).
  """
  t_start = time.time()
  builders.validate(config)  # every field the data is not needed for, before any loading
  workdir = Path(workdir)
  with workdir_lock(workdir), contextlib.ExitStack() as cleanup:
    return _train_and_evaluate(config, workdir, t_start, cleanup)


def _check_saved_config(config, workdir: Path) -> None:
  """A workdir with checkpoints may be resumed only by a compatible config (before restoring)."""
  ckpt_dir = workdir / "checkpoints"
  saved = workdir / "config.json"
  if not (saved.is_file() and ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())):
    return
  try:
    saved_config = json.loads(saved.read_text())
  except (OSError, ValueError) as e:
    logging.warning("cannot read %s (%s): the resumed config is not compared with it", saved, e)
    return
  check_resume_config(saved_config, json.loads(config.to_json_best_effort()), workdir)


def _train_and_evaluate(config, workdir: Path, t_start: float, cleanup: contextlib.ExitStack) -> dict:
  _check_saved_config(config, workdir)

  # ---- data ------------------------------------------------------------------
  run_data = load_run_data(config)
  num_labels = run_data.num_labels
  builders.validate(config, num_labels)
  selecting = run_data.validation is not None
  logging.info("data: %s, %d train / %d validation / %d test points, d=%d, K=%d", run_data.source,
               run_data.train.features.shape[0],
               run_data.validation.features.shape[0] if selecting else 0,
               run_data.test.features.shape[0], run_data.num_features, num_labels)

  # ---- mesh ------------------------------------------------------------------
  mesh = sharding.make_mesh(config.mesh.shape)
  sharding.check_divisible("train.batch_size", config.train.batch_size, mesh, sharding.DATA)
  if config.mining.num_strata % mesh.shape[sharding.MODEL]:
    raise ConfigError("mining.num_strata", f"{config.mining.num_strata} is not a multiple of "
                      f"the mesh's model size {mesh.shape[sharding.MODEL]}")

  # ---- model, sampler, loss, optimisers, step ---------------------------------
  tower, dim = builders.make_tower(config, run_data.num_features)
  table_rows = padded_num_labels(num_labels, config.mining.num_strata)
  tree_sampler, tree_fit_seconds = None, 0.0
  if config.mining.sampler == "tree":
    t_fit = time.perf_counter()
    tree_sampler = _fit_tree(config, run_data)
    tree_fit_seconds = time.perf_counter() - t_fit
    sampler, cdf = tree_sampler, None
  else:
    sampler, cdf = builders.make_sampler(config, num_labels, run_data.label_counts)
  tx = builders.make_tower_optimizer(config)
  row_opt = builders.make_row_optimizer(config)
  normalize_classes = builders.resolve_normalize_classes(config)
  cdf_dev = None if cdf is None else jax.device_put(cdf, sharding.named(mesh, jax.P(sharding.MODEL)))
  train_step = make_train_step(tower_apply=tower.apply, tx=tx, row_opt=row_opt,
                               table_lr=builders.make_table_schedule(config), sampler=sampler,
                               loss=builders.make_loss_spec(config, num_labels), mesh=mesh,
                               normalize_classes=normalize_classes, stratum_cdf=cdf_dev,
                               table_rows=table_rows)

  # ---- input pipeline -------------------------------------------------------
  # This process's block of the global batch under the mesh (not jax.process_index():
  # processes that share a data shard, e.g. a model axis spanning hosts, feed the same rows).
  process_index, process_count = process_data_slice(mesh)
  batcher = SparseBatcher(
      run_data.train.features, run_data.train.labels, config.dataset.conversion,
      global_batch_size=config.train.batch_size,
      max_nnz=config.dataset.max_nnz or "auto", max_labels=config.dataset.max_labels or "auto",
      seed=config.seed, process_index=process_index, process_count=process_count)

  # ---- state (created sharded) and restore ---------------------------------------
  state = create_state(config, tower, table_rows, dim, tx, row_opt, mesh, batcher.max_nnz)
  logging.info("state created: table %s (%s) on mesh %s", state.table.shape, state.table.dtype,
               dict(mesh.shape))
  writer = MetricWriter(workdir, config.train.num_steps, config.train.batch_size)
  cleanup.callback(writer.close)
  ckpt = Checkpointer(workdir / "checkpoints", keep=config.train.keep_checkpoints)
  cleanup.callback(ckpt.close)  # an error still commits (or waits for) the in-flight save
  best_ckpt = Checkpointer(workdir / "best", keep=1) if selecting else None
  if best_ckpt is not None:
    cleanup.callback(best_ckpt.close)
  progress = Progress()

  def accept(step, restored_state, data_state):
    """A checkpoint whose iterator position or progress record is invalid is unreadable too."""
    del step, restored_state
    Progress.from_json(data_state.get("progress"))
    batcher.set_state(data_state["iterator"])

  restored = ckpt.restore_latest(abstract_like(state), accept=accept,
                                 on_unreadable=config.train.get("on_unreadable_checkpoints", "restart"))
  step0 = 0
  if restored is not None:
    step0, state, data_state = restored
    progress = Progress.from_json(data_state.get("progress"))
    logging.info("resumed from step %d", step0)
  # Whatever an earlier attempt logged or selected after the starting step (0 when it was killed
  # before its first checkpoint or every checkpoint was unreadable) is redone by this run.
  writer.truncate_after(step0)
  if best_ckpt is not None:
    best_ckpt.delete_after(step0)
  writer.write_json("config.json", json.loads(config.to_json_best_effort()))

  # ---- evaluation ---------------------------------------------------------------
  eval_kwargs = dict(tower_apply=tower.apply, mesh=mesh, normalize_classes=normalize_classes,
                     max_nnz=batcher.max_nnz, max_labels=batcher.max_labels, tree_sampler=tree_sampler)
  evaluate_test = make_evaluate(config, run_data, "test", **eval_kwargs)
  evaluate_val = make_evaluate(config, run_data, "validation", **eval_kwargs) if selecting else None
  select_metric = config.eval.select_metric

  def evaluate(state, step) -> dict:
    """Test (and validation, as `val/...`) metrics of `state`; updates the selection."""
    out = evaluate_test(state)
    if selecting:
      val = evaluate_val(state)
      if select_metric not in val:
        raise ConfigError("eval.select_metric", f"{select_metric!r} is not one of the evaluated "
                          f"metrics {sorted(k for k, v in val.items() if isinstance(v, float))}")
      out.update({f"val/{k}": v for k, v in val.items()})
      if progress.record_selection(step, val[select_metric]):
        best_ckpt.save(step, state, {"metric": select_metric, "value": val[select_metric]})
    return out

  # ---- loop ------------------------------------------------------------------
  base_key = jax.random.key(config.seed + 1)
  num_steps = config.train.num_steps
  step = int(jax.device_get(state.step))
  t_segment, eval_seconds_segment = time.perf_counter(), 0.0
  last_eval = None  # (step, every metric) of the newest evaluation of this process
  writer.progress(step, {})

  def train_seconds() -> float:  # all restarts, evaluations excluded
    return progress.train_seconds + time.perf_counter() - t_segment - eval_seconds_segment

  max_skipped = config.train.get("max_skipped_steps", 10)

  def check_finite(state):
    """The number of non-finite steps so far; raises NonFiniteLossError under "stop", or
    under "skip" once more than train.max_skipped_steps were skipped."""
    bad = int(jax.device_get(state.nonfinite_steps))
    stop = config.train.on_nonfinite == "stop"
    if bad and (stop or bad > max_skipped):
      first = int(jax.device_get(state.first_nonfinite_step))
      ckpt.wait()  # the in-flight save (of a finite state) is committed before stopping
      latest = ckpt.latest_step()
      kept = (f"the last good checkpoint (step {latest}) in {ckpt.directory} is kept"
              if latest is not None else f"no checkpoint was saved yet in {ckpt.directory}")
      why = ("train.on_nonfinite='stop'" if stop else
             f"{bad} steps skipped so far, more than train.max_skipped_steps={max_skipped}")
      raise NonFiniteLossError(
          f"non-finite loss or gradient at step {first} of {num_steps} ({why}); {kept}; the run "
          "stops without saving")
    return bad

  while step < num_steps and not progress.stopped_early:
    batch = make_global_batch(next(batcher), mesh)
    state, metrics_dev = train_step(state, batch, jax.random.fold_in(base_key, step))
    step += 1
    if step == 1 or (restored is not None and step == restored[0] + 1):
      jax.block_until_ready(metrics_dev)
      logging.info("first step compiled and run in %.1fs", time.perf_counter() - t_segment)
    if itstime(step, config.train.log_every, num_steps):
      scalars = writer.progress(step, _scalars(metrics_dev))
      scalars["nonfinite_steps"] = check_finite(state)
      scalars["train_seconds"] = train_seconds()
      writer.write_scalars(step, scalars, time.time() - t_start)
    if itstime(step, config.train.eval_every, num_steps):
      jax.block_until_ready(state)
      trained_so_far, t_eval = train_seconds(), time.perf_counter()
      eval_out = evaluate(state, step)
      last_eval = (step, eval_out)
      eval_seconds_segment += time.perf_counter() - t_eval
      floats = {k: v for k, v in eval_out.items() if isinstance(v, float)}
      writer.write_scalars(step, {f"eval/{k}": v for k, v in floats.items()}, time.time() - t_start)
      progress.history.append({"step": step, "train_seconds": trained_so_far, **floats})
      logging.info("eval @%d: %s", step, {k: round(v, 4) for k, v in floats.items()})
      if selecting and progress.out_of_patience(config.train.patience):
        progress.stopped_early = True
        logging.info("early stop at step %d: %d evaluations without a better validation %s "
                     "(best %.4f at step %d)", step, progress.evals_since_best, select_metric,
                     progress.best_value, progress.best_step)
    if config.train.checkpoint_every >= 0 and (
        itstime(step, config.train.checkpoint_every, num_steps) or progress.stopped_early):
      check_finite(state)
      ckpt.save(step, state, {"iterator": batcher.get_state(),
                              "progress": {**progress.to_json(), "train_seconds": train_seconds()}})
  jax.block_until_ready(state)
  progress.train_seconds = train_seconds()
  ckpt.wait()

  # ---- final evaluation: the selected state on test ---------------------------
  last = last_eval[1] if last_eval is not None and last_eval[0] == step else None
  final, selected = _final_evaluation(state, step, last, evaluate, evaluate_test, best_ckpt, progress,
                                      select_metric)
  results = {
      "dataset": run_data.source, "num_labels": num_labels, "steps": step,
      "train_seconds": progress.train_seconds, "wall_seconds": time.time() - t_start,
      "seconds_per_step": progress.train_seconds / max(step, 1),
      "nonfinite_steps": check_finite(state),
      "truncation": batcher.stats, "final": final, "selected": selected, "history": progress.history,
      "mesh": dict(mesh.shape), "num_processes": jax.process_count(),
      "tree_fit_seconds": tree_fit_seconds,  # not included in train_seconds
      "train_seconds_excludes_eval": True,
  }
  if config.train.fingerprint:
    results["state_fingerprint"] = state_fingerprint(state)
  writer.write_json("results.json", results)
  results["state"] = state
  return results


def _final_evaluation(state, step, last_eval, evaluate, evaluate_test, best_ckpt, progress,
                      select_metric):
  """(test metrics of the selected state, the selection record).

  Without a validation split the selected state is the last one. With one, the
  last state is evaluated (if the loop did not just do it) so it is a
  candidate too, and the best validation state is restored from `best_ckpt`
  and evaluated on test.
  """
  if last_eval is None:
    last_eval = evaluate(state, step)
  last_test = {k: v for k, v in last_eval.items() if not k.startswith("val/")}
  if best_ckpt is None:
    return last_test, {"step": step, "metric": None, "value": None}
  selected = {"step": progress.best_step, "metric": select_metric,
              "value": progress.best_value, "last_step": step,
              "last": {k: v for k, v in last_test.items() if isinstance(v, float)},
              "stopped_early": progress.stopped_early}
  if progress.best_step == step:
    return last_test, selected
  best_ckpt.wait()
  _, best_state, _ = best_ckpt.restore_latest(abstract_like(state), on_unreadable="fail")
  return evaluate_test(best_state), selected
