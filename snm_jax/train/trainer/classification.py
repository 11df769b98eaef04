"""The extreme-classification task: sparse (or dense) inputs, a sharded class table and
sampled negatives (SNM/S2M, negative sampling, sampled/full softmax, NCE, the
adversarial tree sampler), as a `snm_jax.train.core.task.Task` for the loop.

Owns every method-specific piece of a run: the data, the sampler (fitting
Bamler & Mandt's tree when `mining.sampler="tree"`), the train step, the state
(created sharded), the input pipeline and the evaluators (with their Eq. 5
debiasing, log-likelihood and Bayes comparison, `snm_jax.train.core.evaluate`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from snm_jax import sharding
from snm_jax.data import shards
from snm_jax.data.conversions import conversion_fn
from snm_jax.data.device_rows import DeviceRows
from snm_jax.data.pipeline import DenseBatcher, SparseBatcher, process_data_slice
from snm_jax.errors import ConfigError
from snm_jax.mining.samplers import check_strata_fit_mesh, padded_num_labels
from snm_jax.models import precision
from snm_jax.train.config import builders, sample_schedule, validation
from snm_jax.train.config.overrides import json_without, with_overrides
from snm_jax.train.core.diagnostics import make_diagnose, probe_batch
from snm_jax.train.core.evaluate import make_evaluate
from snm_jax.train.core.input_table import input_table_rows, split_params
from snm_jax.train.trainer.run_data import load_run_data
from snm_jax.train.core.step import SparseInputTrainState, TrainState, make_train_step
from snm_jax.train.core.task import Task


# The fields the runs of one candidate group (`snm_jax.train.trainer.group`) may differ in: the
# member step takes them as inputs (the table's learning rate, the step keys of `seed`), or they
# change only which rows are trained on (the validation split), never what the step computes.
GROUPED_FIELDS = ("table.learning_rate", "seed", "dataset.validation_seed")

# Member steps built for equal settings (up to GROUPED_FIELDS), data and mesh shape are one function,
# so a later group of such members (the recipe's other validation splits) reuses the programs an
# earlier one traced, lowered and compiled (`group._serial_programs` caches them per step).
_MEMBER_STEPS: collections.OrderedDict = collections.OrderedDict()
_MEMBER_STEPS_KEPT = 8


def _member_step_key(config, run_data, mesh):
  """What a member step depends on, or None (a fitted tree sampler: built from the data's draw)."""
  if config.mining.sampler == "tree":
    return None
  counts = hashlib.sha1(np.ascontiguousarray(run_data.label_counts).tobytes()).hexdigest()
  return (json_without(config, GROUPED_FIELDS), mesh.abstract_mesh, run_data.num_features,
          run_data.num_labels, counts)


def _lru_get(cache: collections.OrderedDict, kept: int, key, build):
  """cache[key], made by `build()` on a miss (None: built, not kept); the least recently used
  entries go beyond `kept`. (The keys are config JSON and jax objects: no functools.lru_cache.)"""
  if key is None:
    return build()
  if key not in cache:
    cache[key] = build()
    while len(cache) > kept:
      cache.popitem(last=False)
  cache.move_to_end(key)
  return cache[key]


class GlobalBatches:
  """This process's batches of a batcher (`SparseBatcher`, `DenseBatcher`, ...), as global
  arrays sharded over the mesh (rows kept on the devices gathered there: `DeviceRows`)."""

  def __init__(self, batcher: SparseBatcher, mesh):
    self.batcher, self.mesh = batcher, mesh
    self.device_rows = DeviceRows(batcher, mesh)

  def __next__(self) -> dict:
    return self.to_global(next(self.batcher))

  def to_global(self, local_batch: dict) -> dict:
    """One of the batcher's batches (this process's slice) as the step's global arrays."""
    return self.device_rows.to_global(local_batch)

  def to_global_stacked(self, local_batches: list[dict]) -> dict:
    """Several of the batcher's batches stacked on a leading axis (k steps of a scan)."""
    return self.device_rows.to_global_stacked(local_batches, self.batcher.global_batch_size)

  def get_state(self) -> dict:
    return self.batcher.get_state()

  def close(self) -> None:  # the input pipeline's threads and workers, where it has any
    getattr(self.batcher, "close", lambda: None)()

  def set_state(self, state: dict) -> None:
    self.batcher.set_state(state)

  @property
  def stats(self) -> dict:
    return self.batcher.stats


def build(config, mesh) -> Task:
  """Data -> sampler -> step -> pipeline -> state -> evaluators, for `config` on `mesh`."""
  run_data = load_run_data(config)
  num_labels = run_data.num_labels
  validation.validate(config, num_labels)
  logging.info("data: %s%s, %d train / %d validation / %d test points, d=%d, K=%d", run_data.source,
               f" (shards in {config.dataset.shards})" if run_data.sharded else "",
               run_data.train.num_points,
               run_data.validation.features.shape[0] if run_data.validation is not None else 0,
               run_data.test.features.shape[0], run_data.num_features, num_labels)
  check_strata_fit_mesh(config.mining.num_strata, mesh.shape[sharding.MODEL])  # the table init needs it too

  tower, dim = builders.make_tower(config, run_data.num_features)
  table_rows = padded_num_labels(num_labels, config.mining.num_strata)
  schedule = sample_schedule.phases(config)  # ((start_step, B), ...): one phase without a schedule
  tree_info, tree_fit_seconds = {}, 0.0
  if config.mining.sampler == "tree":
    (sampler, reports, tree_fit_seconds, cached), cdf = _fit_tree(config, run_data), None
    tree_info = {"tree_rounds_per_level": [r.iterations for r in reports],
                 "tree_levels_converged": [r.converged for r in reports], "tree_from_cache": cached}
  else:  # B is the first phase's (mining.num_samples_schedule; mining.num_samples without one)
    sampler, cdf = builders.make_sampler(sample_schedule.phase_config(config, schedule[0][1]),
                                         num_labels, run_data.label_counts)
  tx = builders.make_tower_optimizer(config)
  row_opt = builders.make_row_optimizer(config)
  normalize_classes = builders.resolve_normalize_classes(config)
  input_table = builders.make_input_table(config, mesh)  # None: the input table is a flax parameter
  cdf_dev = None if cdf is None else jax.device_put(cdf, sharding.named(mesh, jax.P(sharding.MODEL)))

  def sampler_and_loss(b):
    """The sampler and loss of a phase of B samples, as a fixed-B run builds them (the fitted
    tree and the stratum cdf do not depend on B, only the number of draws does)."""
    b_config = sample_schedule.phase_config(config, b)
    if config.mining.sampler == "tree":
      b_sampler = dataclasses.replace(sampler, num_samples=b)
    else:
      b_sampler = builders.make_sampler(b_config, num_labels, run_data.label_counts)[0]
    return b_sampler, builders.make_loss_spec(b_config, num_labels)

  def train_step_for(b, member=False):
    b_sampler, loss = sampler_and_loss(b)
    # A group member's rate is an input: its schedule at rate 1, scaled (make_train_step's `member`).
    table_lr = builders.make_table_schedule(
        with_overrides(config, {"table.learning_rate": 1.0}) if member else config)
    # A member's step names no device: its shard_maps take the mesh's abstract shape and its
    # constants are host arrays, so the devices come from the arguments. A candidate group then
    # traces and lowers it once for all its one-device slots (`runtime.member_devices`), each slot
    # paying only XLA's compilation (a persistent-cache load when warm).
    step_mesh = mesh.abstract_mesh if member else mesh
    step_table = (input_table if input_table is None or not member
                  else dataclasses.replace(input_table, mesh=step_mesh))
    return make_train_step(tower_apply=tower.apply, tx=tx, row_opt=row_opt,
                           table_lr=table_lr, sampler=b_sampler, loss=loss,
                           mesh=step_mesh, normalize_classes=normalize_classes,
                           stratum_cdf=cdf if member else cdf_dev,
                           table_rows=table_rows, max_traces=1, input_table=step_table,
                           compute_dtype=builders.compute_dtype(config),
                           table_rounding=builders.table_rounding(config), member=member)

  train_step = sample_schedule.phased_step(schedule, train_step_for)
  # One phase (no mining.num_samples_schedule): the step a candidate group vmaps (trainer/group.py).
  member_step = (_lru_get(_MEMBER_STEPS, _MEMBER_STEPS_KEPT, _member_step_key(config, run_data, mesh),
                       lambda: train_step_for(schedule[0][1], member=True))
                 if len(schedule) == 1 else None)

  # This process's block of the global batch under the mesh (not jax.process_index():
  # processes that share a data shard, e.g. a model axis spanning hosts, feed the same rows).
  process_index, process_count = process_data_slice(mesh)
  dense = builders.dense_inputs(config)  # model.kind=mlp: dense rows (N, d), not padded sparse ones
  d = config.dataset
  rows = (run_data.train, None) if run_data.sharded else (run_data.train.features, run_data.train.labels)
  batcher = (DenseBatcher if dense else SparseBatcher)(
      *rows, d.conversion, global_batch_size=config.train.batch_size,
      max_nnz=d.max_nnz or "auto", max_labels=d.max_labels or "auto",
      seed=config.seed, process_index=process_index, process_count=process_count,
      read_threads=d.get("read_threads", 1), prefetch=d.get("prefetch", 2), workers=d.get("workers", 0),
      rows_on_device=True)

  state = create_state(config, tower, table_rows, dim, tx, row_opt, mesh, batcher.example_inputs(),
                       input_table)
  logging.info("state created: table %s (%s) on mesh %s", state.table.shape, state.table.dtype,
               dict(mesh.shape))

  # The evaluators and diagnostics call tower_apply(state.tower_params(), *inputs).
  tower_apply = tower.apply if input_table is None else input_table.apply_fn(tower.apply)
  eval_kwargs = dict(tower_apply=tower_apply, mesh=mesh, normalize_classes=normalize_classes,
                     max_nnz=batcher.max_nnz, max_labels=batcher.max_labels, dense_inputs=dense,
                     tree_sampler=sampler if config.mining.sampler == "tree" else None)
  evaluators = {"test": make_evaluate(config, run_data, "test", **eval_kwargs)}
  if run_data.validation is not None:
    evaluators["validation"] = make_evaluate(config, run_data, "validation", **eval_kwargs)
  diagnose = None
  if config.get("diagnostics") is not None and config.diagnostics.every > 0:
    probe = probe_batch(*_probe_points(config, run_data), config.diagnostics.probe_size,
                        mesh, max_nnz=batcher.max_nnz, max_labels=batcher.max_labels,
                        batcher_cls=type(batcher))

    def diagnose_for(b):  # the sampler and loss of the phase that trains the diagnosed state
      b_sampler, loss = sampler_and_loss(b)
      return make_diagnose(
          tower_apply=tower_apply, sampler=b_sampler, loss=loss, mesh=mesh,
          normalize_classes=normalize_classes, num_labels=num_labels, probe=probe,
          k=config.diagnostics.k or config.mining.k, snr_draws=config.diagnostics.snr_draws,
          seed=config.seed, stratum_cdf=cdf_dev, table_rows=table_rows, row_block=config.eval.row_block,
          compute_dtype=builders.compute_dtype(config))

    diagnose = sample_schedule.phased_diagnose(schedule, diagnose_for)
  return Task(state=state, train_step=train_step, batches=GlobalBatches(batcher, mesh),
              evaluators=evaluators, diagnostics=diagnose, member_step=member_step,
              info={"dataset": run_data.source, "num_labels": num_labels,
                    "tree_fit_seconds": tree_fit_seconds, **tree_info})  # not included in train_seconds


# The state's initialiser, one jitted program per distinct `_init_key`: a recipe's members (and
# a process's runs) that differ only in what the initial state does not depend on -- the seed (an
# argument of the program), the class table's learning rate, the validation split -- trace, lower
# and compile it once (each build otherwise paid two traces and a lowering: ~0.3 s a member).
_INIT_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_INIT_PROGRAMS_KEPT = 16
_INIT_IRRELEVANT = ("seed", "table.learning_rate", "dataset.validation_seed")


def _init_key(config, tower, table_rows, dim, mesh, example_inputs, sparse_input: bool):
  return (json_without(config, _INIT_IRRELEVANT), tower, table_rows, dim, sparse_input,
          tuple(d.id for d in mesh.devices.flat), mesh.axis_names, mesh.devices.shape,
          tuple((np.shape(x), np.asarray(x).dtype.str) for x in example_inputs))


def create_state(config, tower, table_rows, dim, tx, row_opt, mesh, example_inputs, input_table=None):
  """Initialises the state directly with its shardings (no full table on one device).

  example_inputs: the tower's inputs of one row (the batcher's `example_inputs()`).
  input_table: an `InputTable` (model.input_update="sparse"): a `SparseInputTrainState` whose
  input table holds the EmbeddingBag rows `tower.init` draws (the dense path's initial values),
  padded with zero rows to `input_table_rows`, row-sharded over `model` like the class table.
  The class table is stored in table.dtype: its float32 initial values rounded to nearest
  (bfloat16: as uint16 bits, `precision.to_storage`).
  """
  key = _init_key(config, tower, table_rows, dim, mesh, example_inputs, input_table is not None)
  program = _lru_get(_INIT_PROGRAMS, _INIT_PROGRAMS_KEPT, key, lambda: _init_program(
      config, tower, table_rows, dim, tx, row_opt, mesh, example_inputs, input_table))
  # The key's raw bits as a host array: every process passes the same replicated input.
  state = program(np.asarray(jax.random.key_data(jax.random.key(config.seed))))
  sharding.assert_table_sharded(state.table, mesh)
  return state


def _init_program(config, tower, table_rows, dim, tx, row_opt, mesh, example_inputs, input_table):
  """`create_state`'s jitted initialiser: the seed key's data (`jax.random.key_data`) -> the sharded
  initial state."""
  num_model = mesh.shape[sharding.MODEL]
  strata = config.mining.num_strata
  scale = builders.table_init_scale(config)
  dtype = builders.table_dtype(config)

  def init_table_shard(k_table):
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
      values = precision.to_storage(scale * jax.random.normal(key, (block, dim), jnp.float32), dtype)
      return jax.lax.dynamic_update_slice_in_dim(buf, values, local_s * rows + start, 0)

    return jax.lax.fori_loop(0, per_shard * blocks_per_stratum, body,
                             jnp.zeros((per_shard * rows, dim), dtype))

  init_table = jax.shard_map(init_table_shard, mesh=mesh, in_specs=jax.P(),
                             out_specs=sharding.TABLE, check_vma=False)

  def init(key_data):
    k_tower, k_table = jax.random.split(jax.random.wrap_key_data(key_data))
    params = tower.init(k_tower, *map(jnp.asarray, example_inputs))
    table = init_table(k_table)
    if input_table is None:
      return TrainState.create(params=params, opt_state=tx.init(params),
          table=table,
          table_state=row_opt.init(table_rows, dim))
    params, rows = split_params(params)
    num_rows = input_table_rows(rows.shape[0], strata)
    return SparseInputTrainState.create(
        params=params, opt_state=tx.init(params), table=table, table_state=row_opt.init(table_rows, dim),
        input_table=jnp.pad(rows, ((0, num_rows - rows.shape[0]), (0, 0))),
        input_table_state=input_table.row_opt.init(num_rows, rows.shape[1]))

  abstract = jax.eval_shape(init, jax.random.key_data(jax.random.key(0)))
  replicated = sharding.named(mesh, sharding.REPLICATED)
  by_rows = lambda x: sharding.named(mesh, jax.P(sharding.MODEL, *[None] * (x.ndim - 1)))  # noqa: E731
  shardings = jax.tree.map(lambda _: replicated, abstract)
  shardings = shardings.replace(
      table=sharding.named(mesh, sharding.TABLE),
      table_state=jax.tree.map(by_rows, abstract.table_state))
  if input_table is not None:
    shardings = shardings.replace(input_table=by_rows(abstract.input_table),
                                  input_table_state=jax.tree.map(by_rows, abstract.input_table_state))
  return jax.jit(init, out_shardings=shardings)


def tree_fit_sample(num_points: int, max_points: int, seed: int) -> np.ndarray | None:
  """The training points the tree is fitted on: None (every point) when max_points is 0 or >=
  num_points, else a uniform sample of max_points of them without replacement, seeded, sorted
  (numpy's Generator.choice: O(max_points) memory whatever num_points)."""
  if not max_points or max_points >= num_points:
    return None
  return np.sort(np.random.default_rng([seed, 0x7EE]).choice(num_points, max_points, replace=False))


def _tree_fit_points(config, run_data):
  """(features (n, d) CSR, label sets (n, K) CSR) of the points the tree is fitted on
  (`adversarial.fit_max_points`, `tree_fit_sample`): from memory, or read by index from the shards."""
  train = run_data.train
  rows = tree_fit_sample(train.num_points, int(builders.field_or_default(config.adversarial,
                                                                        "fit_max_points", 0)), config.seed)
  if run_data.sharded:
    return shards.read_split(train.path, train.split, meta=train.meta, rows=rows)
  if rows is None:
    return train.features, train.labels
  return train.features[rows], train.labels[rows]


def _probe_points(config, run_data):
  """(features, label sets) holding the diagnostics' probe: the first `diagnostics.probe_size`
  training points, in file order; on shards only those records are read (by index)."""
  train = run_data.train
  if run_data.sharded:
    size = int(config.diagnostics.probe_size)
    return shards.read_split(train.path, train.split, meta=train.meta,
                             rows=np.arange(min(max(size, 0), train.num_points)))
  return train.features, train.labels


def _fit_tree(config, run_data):
  """Fits Bamler & Mandt's tree on the training (point, label) pairs of the conversion, or loads
  the identical fit from the tree cache (`snm_jax.adversarial.cache`); returns (sampler, per-level
  `LevelReport`s, the fit's wall seconds (the original fit's on a cache hit), whether it hit)."""
  from snm_jax.adversarial import cache  # pylint: disable=g-import-not-at-top
  from snm_jax.adversarial.training import TreeTrainingSampler, fit_tree_sampler  # pylint: disable=g-import-not-at-top
  if not 0 < config.adversarial.pca_dim <= run_data.num_features:
    raise ConfigError("adversarial.pca_dim", f"{config.adversarial.pca_dim} must be in "
                      f"[1, num_features={run_data.num_features}]")
  features, labels = _tree_fit_points(config, run_data)
  rows, labels = conversion_fn(config.dataset.conversion, labels, config.seed)(0)
  features = features[rows]
  settings = dict(pca_dim=config.adversarial.pca_dim, reg=config.adversarial.node_reg,
                  max_reassign_iters=config.adversarial.max_reassign_iters)
  key = cache.fit_key(features, labels, run_data.num_labels, **settings) if cache.cache_dir() else None
  hit = cache.load(key) if key else None
  if hit is not None:
    tree, reports, seconds = hit
    logging.info("adversarial tree loaded from the tree cache %s (fitted in %.1fs)",
                 cache.cache_dir() / key, seconds)
    return TreeTrainingSampler(tree=tree, num_samples=config.mining.num_samples), reports, seconds, True
  t0 = time.perf_counter()
  sampler, reports = fit_tree_sampler(features, labels, run_data.num_labels,
                                      num_samples=config.mining.num_samples, **settings)
  seconds = time.perf_counter() - t0
  logging.info("adversarial tree fitted on %d pairs, C=%d, in %.1fs; re-assignment rounds per "
               "level %s", len(labels), run_data.num_labels, seconds, [r.iterations for r in reports])
  if key:
    cache.store(key, sampler.tree, reports, seconds)
  return sampler, reports, seconds, False
