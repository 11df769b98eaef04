"""Validation of every config field before any data is loaded or anything compiles: each error
is a `ConfigError` naming the field, its value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from snm_jax.errors import ConfigError
from snm_jax.losses import registry as losses_registry
from snm_jax.train.config import sample_schedule
from snm_jax import losses
from snm_jax.metrics import per_point_metric
from snm_jax.models import precision
from snm_jax.train.config.builders import (COSINE_KINDS, DECAYS, DENSE_KINDS, FILE_FIELDS, LOSS_KINDS,
                                           MODEL_KINDS, REDUCTIONS, SAMPLERS, VARTHETAS, field_or_default,
                                           make_loss_spec, resolve_normalize_classes, sparse_input_table)
from snm_jax.train.config.overrides import AUTO, RENAMED_FIELDS, check_renamed, is_auto, parse_search
from snm_jax.train.core import logit_adjust
from snm_jax.train.runtime.member_devices import ONE_DEVICE_SHAPES



# Fields a recipe (recipe.name, snm_jax/train/recipes/recipe.py `derive`) may leave at "auto" / -1 and
# resolves from the data before training; a plain run must set them. Allowed values for the message.
RECIPE_FIELDS = {
    "model.kind": f"one of {list(MODEL_KINDS)}",
    "loss.kind": f"one of {list(LOSS_KINDS)}",
    "mining.sampler": f"one of {list(SAMPLERS)}",
    "mining.num_samples": "an integer >= 1",
    "loss.logit_scale": "a number > 0",
    "train.batch_size": "an integer >= 1",
    "train.num_steps": "an integer >= 1",
    "train.eval_every": "an integer >= 0 (0 = only at the end)",
    "table.learning_rate": "a number > 0",
    "model.bag_matmul": "one of ['gather', 'dense']",
    "model.hidden": "an integer >= 1",
    "model.out": "an integer >= 1",
    "model.dropout": "a rate in [0, 1)",
}
TABLE_OPTIMIZERS = ("sgd", "momentum", "adagrad")
TOWER_OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad")
VARTHETA_NORMS = ("mean", "expectation")  # mining.vartheta_norm
ON_NONFINITE = ("stop", "skip")
ON_UNREADABLE = ("restart", "fail")
DISTRIBUTED_MODES = ("auto", "yes", "no")
BAG_MATMULS = ("gather", "dense")  # models.towers.EmbeddingBag.matmul
INPUT_UPDATES = ("sparse", "dense")  # model.input_update
INPUT_ROW_OPTIMIZERS = ("sgd", "momentum", "adagrad")  # optimizer.name with a row-wise counterpart
DTYPES = tuple(precision.DTYPES)  # model.dtype, table.dtype


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
      value, (bool, np.bool_)) and bool(np.isfinite(value))


def _int(field, value, lo, hi=None, note=""):
  """An integer in [lo, hi]; `note` says what the bound means."""
  if not (_is_int(value) and value >= lo and (hi is None or value <= hi)):
    bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ConfigError(field, f"must be an integer {bounds}{note}, got {value!r}")


def _real(field, value, lo, lo_open=False, note=""):
  """A finite number >= lo (> lo with lo_open)."""
  if not (_is_real(value) and (value > lo if lo_open else value >= lo)):
    raise ConfigError(field, f"must be a finite number {'>' if lo_open else '>='} {lo}{note}, "
                      f"got {value!r}")


def _bool(field, value):
  if not isinstance(value, (bool, np.bool_)):
    raise ConfigError(field, f"must be True or False, got {value!r}")


def _nonnegative(field, value):
  if not value >= 0:
    raise ConfigError(field, f"must be >= 0, got {value!r}")


def _rate(field, value):
  if not 0.0 <= value < 1.0:
    raise ConfigError(field, f"must be a dropout rate in [0, 1), got {value!r}")


def _one_of(field, value, allowed):
  if value not in allowed:
    raise ConfigError(field, f"{value!r} is not one of {list(allowed)}")


def _recipe_placeholders(config) -> set:
  """The RECIPE_FIELDS left at "auto" / -1. Raises ConfigError for one in a plain run."""
  recipe = field_or_default(config, "recipe", None)
  in_recipe = bool(recipe is not None and recipe.get("name", ""))
  out = set()
  for field, allowed in RECIPE_FIELDS.items():
    section, name = field.split(".")
    value = config[section].get(name)
    if is_auto(value):
      if not in_recipe:
        raise ConfigError(field, f"{value!r} is a placeholder that only a recipe resolves from the "
                          "data (recipe.name set, e.g. experiments/configs/xmc.py); a plain run "
                          f"needs {allowed}")
      out.add(field)
  return out


def _validate_recipe(config) -> None:
  r = config.recipe
  grid = {} if r.search == AUTO else parse_search(r.search)  # "auto": derived from the data
  for field in grid:
    section, _, name = field.partition(".")
    if field in RENAMED_FIELDS:
      raise ConfigError("recipe.search", f"{field} was renamed to {RENAMED_FIELDS[field]}")
    if section not in config or not hasattr(config[section], "keys") or name not in config[section]:
      raise ConfigError("recipe.search", f"no config field {field!r} (a search entry is "
                        "section.field=v1,v2 or section.field*=m1,m2)")
  _real("recipe.epochs", r.epochs, 0, lo_open=True)
  _int("recipe.min_steps", r.min_steps, 1)
  _int("recipe.max_steps", r.max_steps, r.min_steps, note=" (recipe.min_steps)")
  _int("recipe.evaluations", r.evaluations, 1)
  members = field_or_default(r, "ensemble", 1)
  _int("recipe.ensemble", members, 0, note=" (the most members; 0 = every candidate, 1 = no ensemble)")
  splits = field_or_default(r, "splits", 1)
  if splits != -1:
    _int("recipe.splits", splits, 1, note=" (validation splits; -1 = from the validation size)")
  _int("recipe.min_validation", field_or_default(r, "min_validation", 0), 0)
  _one_of("recipe.split_search", field_or_default(r, "split_search", "all"), ("all", "first"))
  _bool("recipe.group", field_or_default(r, "group", True))
  _one_of("recipe.group_mode", field_or_default(r, "group_mode", "auto"), ("auto", "vmap", "serial"))
  _int("recipe.steps_per_call", field_or_default(r, "steps_per_call", 1), 1)
  member_devices = field_or_default(r, "member_devices", 0)
  _int("recipe.member_devices", member_devices, -1, note=" (-1 = one per CPU core, 0 = off)")
  if member_devices > 0 and tuple(config.mesh.shape) not in ONE_DEVICE_SHAPES:
    raise ConfigError("recipe.member_devices", f"{member_devices} puts each member on one device, "
                      f"which mesh.shape={tuple(config.mesh.shape)} does not: set mesh.shape=(1, 1) "
                      "or recipe.member_devices=0")
  if member_devices > 0 and (not field_or_default(r, "group", True)
                             or field_or_default(r, "group_mode", "auto") == "vmap"):
    raise ConfigError("recipe.member_devices", f"{member_devices} devices are dealt to the members of "
                      "serial candidate groups, which recipe.group=False / recipe.group_mode=vmap do "
                      "not have: set recipe.member_devices=0 or -1")
  halving = field_or_default(r, "halving", 0)
  _int("recipe.halving", halving, 0, note=" (0 = no successive halving; else > 1)")
  if halving == 1:
    raise ConfigError("recipe.halving", "1 would keep every candidate: set 0 (off) or an integer > 1")
  _int("recipe.rungs", field_or_default(r, "rungs", 1), 1)
  drop_z = field_or_default(r, "drop_behind_z", 0.0)
  _real("recipe.drop_behind_z", drop_z, 0)
  if drop_z > 0:
    select = field_or_default(config.eval, "select_metric", "P@1")
    try:
      per_point_metric(select)
    except ValueError as e:
      raise ConfigError("recipe.drop_behind_z", f"the paired test needs eval.select_metric to be a mean "
                        f"over points: {e}") from None
  if members != 1 and r.refit:
    raise ConfigError("recipe.ensemble", "an ensemble of candidates cannot be refit on the whole "
                      "training file (recipe.refit=True): set recipe.ensemble=1 or recipe.refit=False")
  if len(logit_adjust.parse_grid(field_or_default(r, "logit_adjust", ""))) > 1 and r.refit:
    raise ConfigError("recipe.logit_adjust", "tau is chosen on validation, which a refit on the whole "
                      "training file does not have (recipe.refit=True): set recipe.logit_adjust=\"\" "
                      "or recipe.refit=False")
  if not config.dataset.validation_fraction > 0:
    raise ConfigError("dataset.validation_fraction", "a recipe chooses on a validation split: "
                      f"must be in (0, 1), got {config.dataset.validation_fraction!r}")


def validate(config, num_labels: int | None = None) -> None:
  """Checks every config field. Raises ConfigError naming the first bad one.

  Without `num_labels` only what needs no data is checked (run before
  loading anything); with it, also the checks that depend on K (vartheta
  construction, K >= 2). A recipe config (recipe.name set) may leave the
  RECIPE_FIELDS at "auto" / -1 (their checks are skipped; the candidates
  the recipe trains are validated resolved); a plain run may not.
  """
  check_renamed(config)  # e.g. loss.scale, now loss.logit_scale (RENAMED_FIELDS)
  auto = _recipe_placeholders(config)

  def given(*fields) -> bool:
    return not any(f in auto for f in fields)

  _int("seed", config.seed, 0, 2**31 - 2)
  # ---- dataset
  d = config.dataset
  if not (isinstance(d.name, str) and d.name):
    raise ConfigError("dataset.name", f"must be a dataset name or 'synthetic', got {d.name!r}")
  from snm_jax.data.conversions import CONVERSIONS  # pylint: disable=g-import-not-at-top
  _one_of("dataset.conversion", d.conversion, sorted(CONVERSIONS))
  _int("dataset.max_nnz", d.max_nnz, 0, note=" (0 = the largest row)")
  _int("dataset.max_labels", d.max_labels, 0, note=" (0 = the largest label set)")
  _bool("dataset.normalize_rows", d.normalize_rows)
  fraction = field_or_default(d, "validation_fraction", 0.0)
  if not (_is_real(fraction) and 0 <= fraction < 1):
    raise ConfigError("dataset.validation_fraction", f"must be in [0, 1) (0 = no validation "
                      f"split), got {fraction!r}")
  _int("dataset.validation_seed", field_or_default(d, "validation_seed", 0), 0)
  _validate_files(d)
  _validate_format(config)
  from snm_jax.train.runtime.preemption import parse_signals  # pylint: disable=g-import-not-at-top
  if not isinstance(field_or_default(config.train, "preemption_signals", "SIGTERM"), str):
    raise ConfigError("train.preemption_signals", "must be a comma-separated string of signal names")
  parse_signals(field_or_default(config.train, "preemption_signals", "SIGTERM"))
  if d.name == "synthetic":
    s = d.synthetic
    _int("dataset.synthetic.num_labels", s.num_labels, 2)
    _int("dataset.synthetic.num_train", s.num_train, 1)
    _int("dataset.synthetic.num_test", s.num_test, 1)
    _int("dataset.synthetic.dim", s.dim, 1)
    _int("dataset.synthetic.seed", s.seed, 0)
  # ---- model
  m = config.model
  if given("model.kind"):
    _one_of("model.kind", m.kind, MODEL_KINDS)
    resolve_normalize_classes(config)  # explicit True with a linear kind
    if m.kind == "linear" and given("model.dropout") and field_or_default(m, "dropout", 0.0):
      raise ConfigError("model.dropout", "model.kind=linear has no hidden layer to drop; "
                        "use model.feature_dropout (or model.kind=snm_tower | wide_deep)")
    if (m.kind == "mlp" and given("model.dropout") and field_or_default(m, "dropout", 0.0)
        and field_or_default(m, "num_hidden_layers", 1) == 0):
      raise ConfigError("model.dropout", "model.kind=mlp with model.num_hidden_layers=0 has no "
                        "hidden layer to drop; use model.feature_dropout")
  if given("model.hidden"):
    _int("model.hidden", m.hidden, 1)
  if given("model.out"):
    _int("model.out", m.out, 1)
  _int("model.num_hidden_layers", field_or_default(m, "num_hidden_layers", 1), 0,
       note=" (model.kind=mlp; 0 = a linear map, then L2)")
  if m.normalize_classes is not None:
    _bool("model.normalize_classes", m.normalize_classes)
  if given("model.dropout"):
    _rate("model.dropout", field_or_default(m, "dropout", 0.0))
  _rate("model.feature_dropout", field_or_default(m, "feature_dropout", 0.0))
  if given("model.bag_matmul"):
    _one_of("model.bag_matmul", field_or_default(m, "bag_matmul", "gather"), BAG_MATMULS)
  _one_of("model.input_update", field_or_default(m, "input_update", "dense"), INPUT_UPDATES)
  _one_of("model.dtype", field_or_default(m, "dtype", "float32"), DTYPES)
  # ---- optimisers
  o = config.optimizer
  _one_of("optimizer.name", o.name, TOWER_OPTIMIZERS)
  _real("optimizer.learning_rate", o.learning_rate, 0, lo_open=True)
  if o.name == "momentum":
    _real("optimizer.momentum", o.momentum, 0)
    if not o.momentum < 1:
      raise ConfigError("optimizer.momentum", f"must be in [0, 1), got {o.momentum!r}")
  _real("optimizer.weight_decay", field_or_default(o, "weight_decay", 0.0), 0)
  _one_of("optimizer.decay", field_or_default(o, "decay", "constant"), DECAYS)
  _int("optimizer.warmup_steps", field_or_default(o, "warmup_steps", 0), 0)
  if given("model.kind") and sparse_input_table(config):
    _validate_sparse_input(config)
  t = config.table
  _one_of("table.optimizer", t.optimizer, TABLE_OPTIMIZERS)
  if given("table.learning_rate"):
    _real("table.learning_rate", t.learning_rate, 0, lo_open=True)
  if t.optimizer == "momentum":
    if not (_is_real(t.momentum) and 0 <= t.momentum < 1):
      raise ConfigError("table.momentum", f"must be in [0, 1), got {t.momentum!r}")
  if given("model.kind") and m.kind in COSINE_KINDS:
    _real("table.init_scale", t.init_scale, 0, lo_open=True,
          note=f" (model.kind={m.kind} normalises the rows: zero rows are singular)")
  _real("table.weight_decay", field_or_default(t, "weight_decay", 0.0), 0)
  if given("table.learning_rate") and field_or_default(t, "weight_decay", 0.0) * t.learning_rate >= 1.0:
    raise ConfigError("table.weight_decay", f"table.learning_rate * table.weight_decay = "
                      f"{t.learning_rate} * {field_or_default(t, 'weight_decay', 0.0)} must be < 1 (each "
                      "touched row is multiplied by 1 - lr * weight_decay)")
  _one_of("table.decay", field_or_default(t, "decay", "constant"), DECAYS)
  _one_of("table.dtype", field_or_default(t, "dtype", "float32"), DTYPES)
  _one_of("table.rounding", field_or_default(t, "rounding", "stochastic"), precision.ROUNDINGS)
  _int("table.warmup_steps", field_or_default(t, "warmup_steps", 0), 0)
  # ---- loss and mining
  lo, mi = config.loss, config.mining
  if given("loss.kind"):
    _one_of("loss.kind", lo.kind, LOSS_KINDS)
  _one_of("loss.reduction", lo.reduction, REDUCTIONS)
  try:
    losses.get_phi(lo.phi)
  except ValueError as e:
    raise ConfigError("loss.phi", str(e)) from None
  if lo.phi == "ramp":
    _real("loss.ramp_rho", lo.ramp_rho, 0, lo_open=True)
  if given("loss.logit_scale"):
    _real("loss.logit_scale", lo.logit_scale, 0, lo_open=True, note=" (scores are multiplied by it)")
  _real("loss.adv_lambda", lo.adv_lambda, 0)
  mask_hits = field_or_default(lo, "mask_accidental_hits", None)
  if mask_hits is not None:
    _bool("loss.mask_accidental_hits", mask_hits)
    if given("loss.kind"):
      try:
        losses_registry.masks_accidental_hits(lo.kind, mask_hits)
      except ValueError as e:
        raise ConfigError("loss.mask_accidental_hits", f"{e} (None: the loss's own convention)") from None
  if given("mining.sampler"):
    _one_of("mining.sampler", mi.sampler, SAMPLERS)
  _one_of("mining.vartheta", mi.vartheta, VARTHETAS)
  _one_of("mining.vartheta_norm", mi.vartheta_norm, VARTHETA_NORMS)
  _bool("mining.per_example", mi.per_example)
  _int("mining.num_strata", mi.num_strata, 1, note=" (sampling strata V)")
  if given("mining.sampler") and mi.sampler == "unigram":
    _real("mining.unigram_power", mi.unigram_power, 0)
  _real("mining.floor", mi.floor, 0)
  if mi.vartheta == "power_law":
    _real("mining.power_alpha", mi.power_alpha, 0)
  schedule = field_or_default(mi, "num_samples_schedule", ())
  if schedule:  # B per phase; mining.num_samples is unused
    _validate_num_samples_schedule(config, schedule, given)
  elif given("mining.num_samples"):
    b = mi.num_samples
    if not (_is_int(b) and b >= 1):
      raise ConfigError("mining.num_samples", f"B must be an integer >= 1, got {b!r}")
    if (given("loss.kind") and lo.kind in ("bowl", "powl", "mined_softmax")
        and not (_is_int(mi.k) and 1 <= mi.k <= b)):
      raise ConfigError("mining.k", f"k={mi.k!r} must be in [1, mining.num_samples={b}]")
  if given("mining.sampler", "loss.kind"):
    if mi.sampler == "full":
      # Every label once: the exact softmax, or an ordered weighted loss over all K-1 negatives (its
      # log q is unused; with a constant vartheta, one-vs-rest).
      if lo.kind not in ("full_softmax", "bowl", "powl"):
        raise ConfigError("mining.sampler", "'full' scores every label; use it with loss.kind="
                          "full_softmax, bowl or powl")
    elif lo.kind == "full_softmax":
      raise ConfigError("loss.kind", "full_softmax needs mining.sampler='full'")
    if lo.kind == "adversarial_ns" and mi.sampler != "tree":
      raise ConfigError("loss.kind", "adversarial_ns (Eq. 6) needs mining.sampler='tree'")
    if lo.kind == "nce" and mi.sampler not in ("uniform", "tree"):
      raise ConfigError("loss.kind", "nce needs mining.sampler='uniform' or 'tree'")
    if mi.sampler == "tree" and lo.kind in ("sampled_softmax", "mined_softmax", "full_softmax"):
      raise ConfigError("mining.sampler", f"the tree sampler does not support loss.kind={lo.kind}")
    if lo.kind in ("sampled_softmax", "mined_softmax") and mi.sampler == "unigram":
      raise ConfigError("loss.kind", f"{lo.kind}'s logQ correction of the positive is "
                        "implemented for the uniform sampler only")
  if given("mining.sampler", "model.kind") and mi.sampler == "tree" and m.kind in DENSE_KINDS:
    raise ConfigError("mining.sampler", f"the tree sampler projects sparse batches (feat_ids, "
                      f"feat_vals); model.kind={m.kind} trains on dense rows")
  if given("mining.sampler") and mi.sampler == "tree":
    a = config.adversarial
    _int("adversarial.pca_dim", a.pca_dim, 1)
    _real("adversarial.node_reg", a.node_reg, 0)
    _int("adversarial.max_reassign_iters", a.max_reassign_iters, 0)
    _bool("adversarial.debias_eval", a.debias_eval)
    _int("adversarial.fit_max_points", field_or_default(a, "fit_max_points", 0), 0,
         note=" (0 = every training point)")
  # ---- mesh
  shape = tuple(config.mesh.shape) if isinstance(config.mesh.shape, (tuple, list)) else None
  if (shape is None or len(shape) != 2 or not all(_is_int(v) and (v >= 1 or v == -1) for v in shape)
      or shape.count(-1) > 1):
    raise ConfigError("mesh.shape", f"must be (data, model) with integers >= 1 and at most one -1 "
                      f"(the remaining devices), got {config.mesh.shape!r}")
  # ---- train
  tr = config.train
  if given("train.batch_size"):
    _int("train.batch_size", tr.batch_size, 1, note=" (the global minibatch)")
    if lo.reduction == "s2m" and not (_is_int(lo.k_prime) and 1 <= lo.k_prime <= tr.batch_size):
      raise ConfigError("loss.k_prime",
                        f"k'={lo.k_prime!r} must be in [1, train.batch_size={tr.batch_size}]")
  if given("train.num_steps"):
    _int("train.num_steps", tr.num_steps, 1)
  _int("train.log_every", tr.log_every, 1)
  if given("train.eval_every"):
    _int("train.eval_every", tr.eval_every, 0, note=" (0 = only at the end)")
  _int("train.checkpoint_every", tr.checkpoint_every, -1, note=" (0 = only at the end, -1 = never)")
  _int("train.keep_checkpoints", tr.keep_checkpoints, 1)
  _bool("train.fingerprint", tr.fingerprint)
  _one_of("train.on_nonfinite", tr.on_nonfinite, ON_NONFINITE)
  _int("train.max_skipped_steps", field_or_default(tr, "max_skipped_steps", 10), 0)
  _one_of("train.on_unreadable_checkpoints", field_or_default(tr, "on_unreadable_checkpoints", "restart"),
          ON_UNREADABLE)
  _int("train.patience", field_or_default(tr, "patience", 0), 0, note=" (0 = never stop early)")
  if field_or_default(tr, "patience", 0) and not fraction > 0:
    raise ConfigError("train.patience", f"{tr.patience} needs a validation split to watch "
                      "(dataset.validation_fraction > 0); 0 = never stop early")
  # ---- eval
  e = config.eval
  _int("eval.k_max", e.k_max, 1, note=" (P@k etc. for k = 1..k_max)")
  _int("eval.recall_r", e.recall_r, 1)
  _int("eval.query_chunk", e.query_chunk, 1)
  _int("eval.row_block", e.row_block, 1)
  _int("eval.max_examples", e.max_examples, 0, note=" (0 = all)")
  _bool("eval.log_likelihood", e.log_likelihood)
  for name in ("psp_a", "psp_b"):
    if e[name] is not None:
      _real(f"eval.{name}", e[name], 0, lo_open=True)
  select = field_or_default(e, "select_metric", "P@1")
  if not (isinstance(select, str) and select):
    raise ConfigError("eval.select_metric", f"must be a metric name such as 'P@1', got {select!r}")
  # ---- diagnostics
  diag = field_or_default(config, "diagnostics", None)
  if diag is not None:
    _int("diagnostics.every", diag.every, 0, note=" (0 = off)")
    _int("diagnostics.probe_size", diag.probe_size, 1)
    _int("diagnostics.k", diag.k, 0, note=" (0 = mining.k)")
    snr = diag.snr_draws
    if not (isinstance(snr, int) and not isinstance(snr, bool) and (snr == 0 or snr >= 2)):
      raise ConfigError("diagnostics.snr_draws", f"must be 0 (off) or an integer >= 2, got {snr!r}")
  # ---- recipe, distributed
  if field_or_default(config, "recipe", None) is not None and config.recipe.get("name", ""):
    _validate_recipe(config)
  dist = field_or_default(config, "distributed", None)
  if dist is not None:
    _one_of("distributed.initialize", dist.initialize, DISTRIBUTED_MODES)
    _int("distributed.num_processes", dist.num_processes, 0, note=" (0 = from the environment)")
    _int("distributed.process_id", dist.process_id, -1, note=" (-1 = from the environment)")
  _validate_task(config)
  # ---- with the data: K
  if num_labels is None or auto:
    return
  if num_labels < 2:
    raise ConfigError("dataset.name", f"needs at least 2 labels, got {num_labels}")
  if schedule:
    _validate_schedule_with_labels(config, num_labels)
    return
  if config.mining.sampler == "exact" and not config.mining.num_samples < num_labels:
    raise ConfigError("mining.num_samples", f"the exact sampler draws B distinct negatives: "
                      f"B={config.mining.num_samples} must be < K={num_labels}")
  make_loss_spec(config, num_labels)  # vartheta construction errors


# mining.sampler values that take mining.num_samples_schedule: every sampler that draws B (the
# stratified ones need B divisible by mining.num_strata in every phase); "full" scores all K.
SCHEDULE_SAMPLERS = ("uniform", "unigram", "exact", "tree")


def _validate_num_samples_schedule(config, schedule, given) -> None:
  """mining.num_samples_schedule ((start_step, B), ...), without the data: the form (sorted
  pairs of integers, the first at step 0), the sampler, B divisible by the strata of a
  stratified sampler, and k <= B for the losses that mine the top k."""
  field, mi = sample_schedule.FIELD, config.mining
  form = ("((start_step, B), ...) with integer start steps increasing from 0 and B >= 1, e.g. "
          "((0, 1024), (4000, 2048)); () = mining.num_samples throughout")
  pairs = tuple(schedule) if isinstance(schedule, (tuple, list)) else None
  if pairs is None or not all(isinstance(p, (tuple, list)) and len(p) == 2 and _is_int(p[0])
                              and _is_int(p[1]) for p in pairs):
    raise ConfigError(field, f"must be {form}, got {schedule!r}")
  starts = [p[0] for p in pairs]
  if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
    raise ConfigError(field, f"start steps {starts} must begin at 0 and increase strictly: {form}")
  for start, b in pairs:
    if b < 1:
      raise ConfigError(field, f"phase ({start}, {b}): B must be >= 1")
  if field_or_default(config, "task", "classification") != "classification":
    raise ConfigError(field, f"task={config.task} samples no negatives: must be ()")
  if given("mining.sampler"):
    if mi.sampler not in SCHEDULE_SAMPLERS:
      raise ConfigError(field, f"mining.sampler={mi.sampler!r} scores every label (no B to "
                        f"schedule): must be (); samplers that take one: {list(SCHEDULE_SAMPLERS)}")
    if mi.sampler in ("uniform", "unigram"):
      for start, b in pairs:
        if b % mi.num_strata:
          raise ConfigError(field, f"phase ({start}, {b}): B={b} must be divisible by "
                            f"mining.num_strata={mi.num_strata} (each stratum draws B / V)")
  if given("loss.kind") and config.loss.kind in ("bowl", "powl", "mined_softmax"):
    _int("mining.k", mi.k, 1)
    for start, b in pairs:
      if mi.k > b:
        raise ConfigError(field, f"phase ({start}, {b}): B={b} is less than mining.k={mi.k} "
                          f"({config.loss.kind} keeps the k hardest of the B negatives)")


def _validate_schedule_with_labels(config, num_labels: int) -> None:
  """The schedule's checks that need K: B < K for the exact sampler, and each phase's loss
  (its vartheta) built as a fixed-B run with that B builds it."""
  for start, b in sample_schedule.phases(config):
    if config.mining.sampler == "exact" and not b < num_labels:
      raise ConfigError(sample_schedule.FIELD, f"phase ({start}, {b}): the exact sampler draws B "
                        f"distinct negatives: B={b} must be < K={num_labels}")
    try:
      make_loss_spec(sample_schedule.phase_config(config, b), num_labels)
    except ConfigError as e:
      raise ConfigError(sample_schedule.FIELD, f"phase ({start}, {b}): {e}") from None


def _validate_sparse_input(config) -> None:
  """model.input_update="sparse" with a gathered input table: a tower optimiser with a row-wise
  counterpart (`make_input_table`)."""
  o = config.optimizer
  if o.name not in INPUT_ROW_OPTIMIZERS:
    raise ConfigError("model.input_update", f"'sparse' updates the input table with the row-wise "
                      f"counterpart of optimizer.name, and {o.name!r} has none (one of "
                      f"{list(INPUT_ROW_OPTIMIZERS)}): change optimizer.name or set "
                      "model.input_update=dense")
  wd = field_or_default(o, "weight_decay", 0.0)
  if wd and o.learning_rate * wd >= 1.0:
    raise ConfigError("optimizer.weight_decay", f"optimizer.learning_rate * optimizer.weight_decay "
                      f"= {o.learning_rate} * {wd} must be < 1 with model.input_update=sparse (each "
                      "touched input row is multiplied by 1 - lr * weight_decay)")


def _validate_format(config) -> None:
  """dataset.format and the input-pipeline fields; with format=sharded, what the sharded training
  split cannot serve (each needs the whole training matrix in memory) is refused here."""
  d = config.dataset
  fmt = field_or_default(d, "format", "memory")
  _one_of("dataset.format", fmt, ("memory", "sharded"))
  _int("dataset.read_threads", field_or_default(d, "read_threads", 1), 0)
  _int("dataset.prefetch", field_or_default(d, "prefetch", 2), 0)
  _int("dataset.workers", field_or_default(d, "workers", 0), 0)
  shards_dir = field_or_default(d, "shards", "")
  if fmt == "memory":
    if shards_dir:
      raise ConfigError("dataset.shards", f"{shards_dir!r} is set but dataset.format is 'memory': set "
                        "dataset.format=sharded to read the shards")
    return
  if not shards_dir:
    raise ConfigError("dataset.shards", "dataset.format=sharded needs the converted dataset's "
                      "directory (`python -m experiments.convert --out=...`)")
  from snm_jax.data.conversions import PER_ROW  # pylint: disable=g-import-not-at-top
  if d.conversion not in PER_ROW:
    raise ConfigError("dataset.conversion", f"{d.conversion!r} lists every example up front; the "
                      f"sharded path takes the per-row conversions {PER_ROW}")
  refused = (("adversarial.fit_max_points", config.mining.get("sampler") == "tree"
              and not config.adversarial.get("fit_max_points", 0),
              "the tree sampler is fitted on a bounded sample of the training split read from the "
              "shards: set adversarial.fit_max_points > 0 (e.g. 1000000)"),
             ("recipe.splits", bool(config.get("recipe") and config.recipe.get("name", "")
                                    and int(config.recipe.get("splits", 1)) > 1),
              "the converted dataset holds one validation carve (-1 takes it)"),
             ("recipe.refit", bool(config.get("recipe") and config.recipe.get("name", "")
                                   and config.recipe.get("refit", False)),
              "the refit trains on the whole training file, which the converter split in two"),
             ("task", config.get("task", "classification") != "classification",
              "only the classification task reads sharded data"))
  for field, bad, why in refused:
    if bad:
      raise ConfigError(field, f"not available with dataset.format=sharded: {why}")


def _validate_files(d) -> None:
  """dataset.files: four existing files when dataset.name="files", else none set (a set path
  with another dataset.name would be silently ignored)."""
  files = field_or_default(d, "files", None)
  if d.name != "files":
    given = [f for f in FILE_FIELDS if files is not None and files.get(f)]
    if given:
      raise ConfigError("dataset.name", f"dataset.files.{given[0]} is set but dataset.name is "
                        f"{d.name!r}: set dataset.name=files to train on the files")
    return
  if files is None:
    raise ConfigError("dataset.files", "dataset.name=files needs the dataset.files section "
                      f"({', '.join(FILE_FIELDS)}; experiments/configs/common.py)")
  for name in FILE_FIELDS:
    path = files.get(name)
    if not (isinstance(path, str) and path):
      raise ConfigError(f"dataset.files.{name}", f"dataset.name=files needs the path of a file, "
                        f"got {path!r}")
    if not Path(path).expanduser().is_file():
      raise ConfigError(f"dataset.files.{name}", f"no such file: {path}")


def _validate_task(config) -> None:
  """`task` and, for task="retrieval", its fields (the auprc section; snm_jax/train/trainer/retrieval.py)."""
  from snm_jax.train.core.task import TASKS  # pylint: disable=g-import-not-at-top
  kind = field_or_default(config, "task", "classification")
  _one_of("task", kind, TASKS)
  if kind != "retrieval":
    return
  for field in ("model.dtype", "table.dtype"):  # the retrieval task has its own float32 tower, no class table
    section, name = field.split(".")
    if field_or_default(config[section], name, "float32") != "float32":
      raise ConfigError(field, f"task=retrieval trains in float32 only: must be 'float32', got "
                        f"{config[section][name]!r}")
  from snm_jax.auprc.losses import METHODS  # pylint: disable=g-import-not-at-top
  from snm_jax.data import retrieval_tasks  # pylint: disable=g-import-not-at-top
  a = config.auprc
  _one_of("dataset.name", config.dataset.name, retrieval_tasks.TASKS)
  if config.get("diagnostics") is not None and config.diagnostics.every:
    raise ConfigError("diagnostics.every", "the sampler diagnostics are the classification task's "
                      f"(task=retrieval samples no negatives): must be 0, got {config.diagnostics.every!r}")
  if config.dataset.get("validation_fraction", 0.0):
    raise ConfigError("dataset.validation_fraction", "task=retrieval has no validation split "
                      f"(queries and gallery are the test points): must be 0, got "
                      f"{config.dataset.validation_fraction!r}")
  _one_of("auprc.method", a.method, METHODS)
  _int("auprc.samples_per_class", a.samples_per_class, 2, note=" (positive pairs need two)")
  if config.train.batch_size % a.samples_per_class:
    raise ConfigError("train.batch_size", f"{config.train.batch_size} must be a multiple of "
                      f"auprc.samples_per_class={a.samples_per_class} (G classes x M items)")
  _one_of("auprc.class_weighting", a.class_weighting, ("size", "uniform"))
  ks = a.recall_ks
  if not (isinstance(ks, (tuple, list)) and ks and all(_is_int(k) and k >= 1 for k in ks)):
    raise ConfigError("auprc.recall_ks", f"must be a non-empty tuple of integers >= 1, got {ks!r}")
  _one_of("auprc.category_rule", a.category_rule, retrieval_tasks.CATEGORY_RULES)
  _bool("auprc.tfidf", a.tfidf)
  sy = a.synthetic
  for name in ("num_train_classes", "num_test_classes", "max_class_size", "min_class_size",
               "signal_dim"):
    _int(f"auprc.synthetic.{name}", sy[name], 1)
  _int("auprc.synthetic.nuisance_dim", sy.nuisance_dim, 0)
  _int("auprc.synthetic.seed", sy.seed, 0)
  for name in ("zipf_exponent", "within_class_std", "nuisance_std"):
    _real(f"auprc.synthetic.{name}", sy[name], 0)
  so = a.soprc
  for field, value in (("auprc.soprc.tau1", so.tau1), ("auprc.soprc.tau2", so.tau2),
                       ("auprc.ap_loss.tau1", a.ap_loss.tau1), ("auprc.ap_loss.tau2", a.ap_loss.tau2),
                       ("auprc.smooth_ap.temperature", a.smooth_ap.temperature)):
    _real(field, value, 0, lo_open=True)
  if not (_is_real(so.beta) and 0 < so.beta <= 1):
    raise ConfigError("auprc.soprc.beta", f"must be an EMA rate in (0, 1], got {so.beta!r}")
  _int("auprc.soprc.num_aux", so.num_aux, 1)
  _bool("auprc.soprc.init_from_first_batch", so.init_from_first_batch)
  _one_of("auprc.soprc.aux_update", so.aux_update, ("before_gradient", "after_gradient"))
  if not (_is_real(so.prior_mul) and 0 <= so.prior_mul <= 1):
    raise ConfigError("auprc.soprc.prior_mul", f"must be in [0, 1] (0 = the true prior), "
                      f"got {so.prior_mul!r}")
  _real("auprc.soprc.lambda_pos", so.lambda_pos, 0)
  _real("auprc.soprc.lambda_neg", so.lambda_neg, 0)
  _real("auprc.triplet.margin", a.triplet.margin, 0)
  _real("auprc.contrastive.margin", a.contrastive.margin, 0)
