"""`train_and_evaluate(config, workdir)`: the whole run, resumable from `workdir`.

Sections: data -> mesh -> model and step -> state (created sharded) ->
checkpoint restore -> loop (step, log, eval, checkpoint) -> final evaluation.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from snm_jax import metrics as snm_metrics
from snm_jax import sharding
from snm_jax.data.conversions import conversion_fn
from snm_jax.data.pipeline import SparseBatcher, make_global_batch, process_data_slice
from snm_jax.mining.samplers import padded_num_labels
from snm_jax.errors import ConfigError, NonFiniteLossError
from snm_jax.train import builders
from snm_jax.train.checkpointing import Checkpointer, abstract_like
from snm_jax.train.evaluate import Evaluator, multilabel_metrics, retrieval_metrics
from snm_jax.train.host import is_writer, itstime, to_host
from snm_jax.train.run_data import load_run_data
from snm_jax.train.step import TrainState, make_train_step
from snm_jax.train.writers import MetricWriter


def create_state(config, tower, num_features, table_rows, dim, tx, row_opt, mesh, max_nnz):
  """Initialises the state directly with its shardings (no full table on one device)."""
  key = jax.random.key(config.seed)
  k_tower, k_table = jax.random.split(key)
  dummy_ids = jnp.zeros((1, max_nnz), jnp.int32)
  dummy_vals = jnp.zeros((1, max_nnz), jnp.float32)

  num_model = mesh.shape[sharding.MODEL]
  strata = config.mining.num_strata
  scale = 0.0 if config.model.kind == "linear" else config.table.init_scale  # B&M start linear at 0

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


def test_labels_first(labels) -> np.ndarray:
  """Each point's first stored label, -1 for points without labels."""
  labels = labels.tocsr()
  first = np.full(labels.shape[0], -1, np.int64)
  has = np.diff(labels.indptr) > 0
  first[has] = labels.indices[labels.indptr[:-1][has]]
  return first


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
  """Trains, evaluates and writes config.json, metrics.jsonl, results.json (process 0)."""
  workdir = Path(workdir)
  t_start = time.time()

  # ---- data ------------------------------------------------------------------
  run_data = load_run_data(config)
  num_labels = run_data.num_labels
  builders.validate(config, num_labels)
  logging.info("data: %s, %d train / %d test points, d=%d, K=%d", run_data.source,
               run_data.train.features.shape[0], run_data.test.features.shape[0],
               run_data.num_features, num_labels)

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
  loss_spec = builders.make_loss_spec(config, num_labels)
  tx = builders.make_tower_optimizer(config)
  row_opt = builders.make_row_optimizer(config)
  table_lr = lambda step: config.table.learning_rate  # pylint: disable=unnecessary-lambda-assignment
  cdf_dev = None if cdf is None else jax.device_put(cdf, sharding.named(mesh, jax.P(sharding.MODEL)))
  train_step = make_train_step(tower_apply=tower.apply, tx=tx, row_opt=row_opt, table_lr=table_lr,
                               sampler=sampler, loss=loss_spec, mesh=mesh,
                               normalize_classes=config.model.normalize_classes,
                               stratum_cdf=cdf_dev, table_rows=table_rows)

  # ---- input pipeline -------------------------------------------------------
  # This process's block of the global batch under the mesh (not jax.process_index():
  # processes that share a data shard, e.g. a model axis spanning hosts, feed the same rows).
  process_index, process_count = process_data_slice(mesh)
  batcher = SparseBatcher(
      run_data.train.features, run_data.train.labels, config.dataset.conversion,
      global_batch_size=config.train.batch_size,
      max_nnz=config.dataset.max_nnz or "auto", max_labels=config.dataset.max_labels or "auto",
      seed=config.seed, process_index=process_index, process_count=process_count)
  max_nnz = batcher.max_nnz

  # ---- state (created sharded) and restore ---------------------------------------
  state = create_state(config, tower, run_data.num_features, table_rows, dim, tx,
                       row_opt, mesh, max_nnz)
  logging.info("state created: table %s (%s) on mesh %s", state.table.shape, state.table.dtype,
               dict(mesh.shape))
  ckpt = Checkpointer(workdir / "checkpoints", keep=config.train.keep_checkpoints)
  restored = ckpt.restore_latest(abstract_like(state))
  if restored is not None:
    step0, state, data_state = restored
    batcher.set_state(data_state["iterator"])
    logging.info("resumed from step %d", step0)
  writer = MetricWriter(workdir, config.train.num_steps, config.train.batch_size)
  writer.write_json("config.json", json.loads(config.to_json_best_effort()))

  debias = tree_sampler is not None and config.adversarial.debias_eval and \
      config.loss.kind == "adversarial_ns"
  eval_features = run_data.test.features[:config.eval.max_examples or None]
  if debias:  # Eq. 5: score_y(x) = xi_y(x) + log p_n(y|x), block by block inside the top-k scan.
    x_proj_test = np.asarray(tree_sampler.project_sparse_host(eval_features))
    extra_fn = lambda rows: x_proj_test[np.maximum(rows, 0)]  # pylint: disable=unnecessary-lambda-assignment
    bias_fn = tree_sampler.log_prob_block
  else:
    extra_fn = bias_fn = None
  evaluator = Evaluator(
      bias_fn=bias_fn, extra_fn=extra_fn, with_loglik=config.eval.log_likelihood,
      tower_apply=tower.apply,
      features=eval_features,
      labels=run_data.test.labels[:config.eval.max_examples or None], mesh=mesh,
      num_labels=num_labels, k=max(config.eval.k_max, min(config.eval.recall_r, num_labels)),
      query_chunk=config.eval.query_chunk, row_block=config.eval.row_block,
      normalize_classes=config.model.normalize_classes, max_nnz=max_nnz,
      max_labels=batcher.max_labels)
  a, b = snm_metrics.propensity_params(run_data.train.name) if run_data.train.name else (
      config.eval.psp_a, config.eval.psp_b)
  propensities = snm_metrics.jain_propensities(run_data.label_counts, run_data.train.features.shape[0], a, b)

  def evaluate(state) -> dict:
    t0 = time.perf_counter()
    pred, loglik = evaluator.predict(state.params, state.table)
    test_labels = evaluator.batcher.labels
    out = multilabel_metrics(pred, test_labels, propensities, config.eval.k_max)
    out.update(retrieval_metrics(pred, test_labels, run_data.label_counts, config.eval.recall_r))
    if loglik is not None:  # Bamler & Mandt's predictive log-likelihood of the first label
      out["log_likelihood"] = float(np.nanmean(loglik))
      out["accuracy"] = float(np.mean(pred[:, 0] == test_labels_first(test_labels)))
    if run_data.synthetic is not None:
      raw = run_data.synthetic.test.features[:evaluator.num_points]
      bayes, _ = run_data.synthetic.bayes_topk(raw, config.eval.k_max)
      b_out = multilabel_metrics(np.asarray(bayes), test_labels, propensities, config.eval.k_max)
      out.update({f"bayes/{k}": v for k, v in b_out.items()})
    out["eval_seconds"] = time.perf_counter() - t0
    return out

  # ---- loop ------------------------------------------------------------------
  base_key = jax.random.key(config.seed + 1)
  num_steps = config.train.num_steps
  step = int(jax.device_get(state.step))
  history = []
  # Training time excludes evaluation (its cost differs between methods, e.g.
  # Eq. 5 bias removal), so learning curves against seconds compare training cost.
  train_seconds = 0.0
  t_loop = time.perf_counter()
  eval_seconds = 0.0
  metrics_dev = None
  writer.progress(step, {})

  def check_finite(state):
    bad = int(jax.device_get(state.nonfinite_steps))
    if bad and config.train.on_nonfinite == "stop":
      first = int(jax.device_get(state.first_nonfinite_step))
      raise NonFiniteLossError(
          f"non-finite loss at step {first} (train.on_nonfinite='stop'); the last good "
          f"checkpoint in {ckpt.directory} is kept, the run stops without saving")
    return bad

  def save(state, step):
    check_finite(state)
    ckpt.save(step, state, {"iterator": batcher.get_state()})

  while step < num_steps:
    batch = make_global_batch(next(batcher), mesh)
    state, metrics_dev = train_step(state, batch, jax.random.fold_in(base_key, step))
    step += 1
    if step == 1 or (restored is not None and step == restored[0] + 1):
      jax.block_until_ready(metrics_dev)
      logging.info("first step compiled and run in %.1fs", time.perf_counter() - t_loop)
    if itstime(step, config.train.log_every, num_steps):
      scalars = writer.progress(step, _scalars(metrics_dev))
      scalars["nonfinite_steps"] = check_finite(state)
      scalars["train_seconds"] = train_seconds + time.perf_counter() - t_loop - eval_seconds
      writer.write_scalars(step, scalars, time.time() - t_start)
    if itstime(step, config.train.eval_every) and step < num_steps:
      jax.block_until_ready(state)
      trained_so_far = train_seconds + time.perf_counter() - t_loop - eval_seconds
      t_eval = time.perf_counter()
      eval_out = evaluate(state)
      eval_seconds += time.perf_counter() - t_eval
      writer.write_scalars(step, {f"eval/{k}": v for k, v in eval_out.items()
                                  if isinstance(v, float)}, time.time() - t_start)
      history.append({"step": step, "train_seconds": trained_so_far,
                      **{k: v for k, v in eval_out.items() if isinstance(v, float)}})
      logging.info("eval @%d: %s", step, {k: round(v, 4) for k, v in eval_out.items() if isinstance(v, float)})
    if config.train.checkpoint_every >= 0 and itstime(step, config.train.checkpoint_every, num_steps):
      save(state, step)
  jax.block_until_ready(state)
  train_seconds += time.perf_counter() - t_loop - eval_seconds
  ckpt.wait()

  # ---- final evaluation ---------------------------------------------------------
  final = evaluate(state)
  results = {
      "dataset": run_data.source, "num_labels": num_labels, "steps": step,
      "train_seconds_this_run": train_seconds, "wall_seconds": time.time() - t_start,
      "seconds_per_step": train_seconds / max(step, 1),
      "nonfinite_steps": check_finite(state),
      "truncation": batcher.stats, "final": final, "history": history,
      "mesh": dict(mesh.shape), "num_processes": jax.process_count(),
      "tree_fit_seconds": tree_fit_seconds,  # not included in train_seconds
      "train_seconds_excludes_eval": True,
  }
  if config.train.fingerprint:
    results["state_fingerprint"] = state_fingerprint(state)
  writer.write_json("results.json", results)
  writer.close()
  ckpt.close()
  results["state"] = state
  return results
