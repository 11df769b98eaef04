"""Config -> the objects of a run (model, samplers, losses, optimisers). Every field is checked
first, by `snm_jax.train.config.validation.validate`."""

from __future__ import annotations

import jax
import numpy as np
import optax

from snm_jax import losses
from snm_jax.errors import ConfigError
from snm_jax.mining.samplers import ExactSampler, StratifiedSampler, padded_num_labels, unigram_stratum_cdf
from snm_jax.models import precision
from snm_jax.models.towers import LinearQuery, MLPTower, SNMTower, WideDeepQuery
from snm_jax.train.core import row_optimizers
from snm_jax.train.core.input_table import InputTable
from snm_jax.train.core.step import LossSpec

LOSS_KINDS = ("bowl", "powl", "sampled_softmax", "mined_softmax", "full_softmax", "logistic_ns",
              "adversarial_ns", "nce")
SAMPLERS = ("uniform", "unigram", "full", "tree", "exact")
VARTHETAS = ("top_k", "negative_sampling", "power_law")
REDUCTIONS = ("mean", "s2m")
MODEL_KINDS = ("snm_tower", "linear", "wide_deep", "mlp")
LINEAR_KINDS = ("linear", "wide_deep")  # class rows hold a linear model [w_y, b_y, ...], start at 0
COSINE_KINDS = ("snm_tower", "mlp")     # L2-normalised queries, scored against normalised class rows
DENSE_KINDS = ("mlp",)                  # towers over dense rows: DenseBatcher batches
FILE_FIELDS = ("train_features", "train_labels", "test_features", "test_labels")  # dataset.files
DECAYS = ("constant", "cosine")
BAG_KINDS = ("snm_tower", "wide_deep")  # models with an EmbeddingBag: an input table to update


def field_or_default(section, name, default):
  """config.<section>.<name>, or its base_config() default for configs that predate it."""
  return section.get(name, default)





def make_vartheta(config, num_labels: int) -> np.ndarray:
  m = config.mining
  try:
    if m.vartheta == "top_k":
      return losses.top_k_vartheta(m.k, m.num_samples, num_labels, scale=m.vartheta_norm, floor=m.floor)
    if m.vartheta == "negative_sampling":
      if m.vartheta_norm == "mean":  # the plain average over all B sampled negatives
        return losses.top_k_vartheta(m.num_samples, m.num_samples, num_labels, scale="mean")
      return losses.negative_sampling_vartheta(m.k, m.num_samples, num_labels)
    return losses.power_law_vartheta(m.power_alpha, m.num_samples, num_labels, k=m.k,
                                     scale=m.vartheta_norm, floor=m.floor)
  except ValueError as e:
    raise ConfigError(f"mining ({m.vartheta} vartheta)", str(e)) from None


def make_loss_spec(config, num_labels: int) -> LossSpec:
  kind = config.loss.kind
  phi = None
  head, tail = (), 0.0
  if kind in ("bowl", "powl"):
    kwargs = {"rho": config.loss.ramp_rho} if config.loss.phi == "ramp" else {}
    phi = losses.get_phi(config.loss.phi, **kwargs)
    head_arr, tail = losses.split_vartheta(make_vartheta(config, num_labels))
    head = tuple(float(h - tail) for h in head_arr)
  mined_k = int(config.mining.k) if kind == "mined_softmax" else 0
  return LossSpec(kind=kind, phi=phi, head_minus_tail=head, tail=float(tail), mined_k=mined_k,
                  logit_scale=float(config.loss.logit_scale), reduction=config.loss.reduction,
                  k_prime=int(config.loss.k_prime), lam=float(config.loss.adv_lambda),
                  mask_accidental_hits=field_or_default(config.loss, "mask_accidental_hits", None),
                  dense_score_grad=dense_score_grad(config, len(head) or mined_k))


# The rescored top-k gradient (`LossSpec.dense_score_grad=False`) pays a gather of N x k rows and a
# scatter-add of their gradients; the dense one two more N x S x h matmuls. Counting each at the
# rate it ran (the step benchmark, N=256, B=4096, h=128, k=16: 0.13 and 0.28 of the matmul peak),
# the rescored one is faster only while S > ~8 k; on Bibtex's SNM tower (S = 64 shared draws, h =
# 512) top-16 took 97 ms a step rescored against 59 ms dense.
RESCORE_MIN_RATIO = 8


def dense_score_grad(config, rescored_k: int) -> bool:
  """Whether the ordered weighted losses (and the mined softmax) differentiate all N x S scores
  rather than the k rescored ones: for shared draws (one N x S product) when S < RESCORE_MIN_RATIO
  x k. Per-example and global draws keep the rescored gradient (their scores are N x S x h einsums,
  not one product)."""
  m = config.mining
  shared = m.sampler in ("uniform", "unigram", "full") and not m.per_example
  return bool(rescored_k) and shared and int(m.num_samples) < RESCORE_MIN_RATIO * rescored_k


def make_sampler(config, num_labels: int, label_counts=None):
  """Returns (sampler, stratum_cdf or None): a `StratifiedSampler` (uniform, unigram, full;
  with replacement) or, for "exact", an `ExactSampler` (Algorithm 1: B distinct non-positives)."""
  m = config.mining
  if m.sampler == "tree":
    raise ValueError("the tree sampler is fitted to the data: use snm_jax.adversarial.training")
  if m.sampler == "exact":
    return ExactSampler(num_labels, m.num_samples), None
  if m.sampler == "full":
    # Every label once: K_pad / V rows per stratum, drawn as the identity.
    return StratifiedSampler(num_labels, num_samples=padded_num_labels(num_labels, m.num_strata),
                             num_strata=m.num_strata, full=True), None
  sampler = StratifiedSampler(num_labels, m.num_samples, num_strata=m.num_strata,
                              per_example=m.per_example)
  if m.sampler == "unigram":
    if label_counts is None:
      raise ConfigError("mining.sampler", "unigram sampling needs training label counts")
    return sampler, unigram_stratum_cdf(label_counts, m.num_strata, power=m.unigram_power)
  return sampler, None


def resolve_normalize_classes(config) -> bool:
  """model.normalize_classes with None ("auto") resolved: True for snm_tower and
  mlp (cosine scores), False for linear and wide_deep.

  Raises ConfigError for an explicit True with linear / wide_deep: their class
  rows [w_y, b_y(, e_y)] start at 0 (`table_init_scale`), where the gradient of
  l2_normalize is ~1/sqrt(eps) = 1e6: the first update throws the touched rows
  to norms ~1e5, after which their gradients (~1/norm) barely move them, so the
  table stops learning; normalising would also drop the scale of the linear score.
  """
  value = config.model.normalize_classes
  kind = config.model.kind
  if value is None:
    return kind in COSINE_KINDS
  if value and kind in LINEAR_KINDS:
    raise ConfigError("model.normalize_classes",
                      f"True is not supported with model.kind={kind}: its class rows are a linear "
                      "model [w_y, b_y, ...] initialised to 0, where L2 normalisation is singular "
                      "(gradient ~1/sqrt(eps): the first update blows the rows up and later ones "
                      "barely move them, so the table stops learning), and normalising discards "
                      "the scale of the linear score. Leave it unset (auto: False for linear / "
                      "wide_deep) or set it False.")
  return bool(value)


def table_init_scale(config) -> float:
  """Std of the initial class rows: 0.0 for linear / wide_deep (Bamler & Mandt
  start the linear model at 0), table.init_scale for snm_tower and mlp."""
  return 0.0 if config.model.kind in LINEAR_KINDS else float(config.table.init_scale)


def tower_has_dropout(config) -> bool:
  """True when the tower must be called with train=True and a dropout rng in
  training (make_train_step's `dropout=`)."""
  return bool(field_or_default(config.model, "dropout", 0.0) or field_or_default(config.model, "feature_dropout", 0.0))


def dense_inputs(config) -> bool:
  """True when the tower takes dense rows (model.kind=mlp): the task feeds it
  `DenseBatcher` batches ('features' (N, d)) instead of padded sparse ones."""
  return config.model.kind in DENSE_KINDS


def compute_dtype(config):
  """model.dtype as a jnp dtype: the towers' and the scores' compute dtype (float32 accumulation)."""
  return precision.dtype_of(field_or_default(config.model, "dtype", "float32"))


def table_dtype(config):
  """The class table's storage dtype for table.dtype: float32, or uint16 (the bits of bfloat16
  values, `precision.STORAGE`)."""
  return precision.storage_of(field_or_default(config.table, "dtype", "float32"))


def table_rounding(config) -> str:
  """table.rounding: how updated rows are written into a bfloat16 table (stochastic | nearest)."""
  return field_or_default(config.table, "rounding", "stochastic")


def make_tower(config, num_features: int):
  """Returns (flax module, query width = class-row width).

  snm_tower: SNMTower, width model.out -- for large d (the table is K x out).
  linear: LinearQuery q = [x, 1], width d + 1 -- a K x (d + 1) table: moderate d only.
  wide_deep: WideDeepQuery q = [x, 1, tower(x)], width d + 1 + out -- the linear
    model plus the tower, summed in the score; also a K x (d + 1 + out) table.
  mlp: MLPTower over dense rows x (N, d), width model.out (`dense_inputs`).
  The modules take `train=True` (and rngs={"dropout": key}) to apply
  model.dropout / model.feature_dropout; their default call is deterministic.
  model.dtype: the towers' compute dtype (`compute_dtype`; linear has no computation: the step's
  scores round its query).
  """
  m = config.model
  dtype = {"dtype": compute_dtype(config)} if precision.is_reduced(compute_dtype(config)) else {}
  dropout = float(field_or_default(m, "dropout", 0.0))
  feature_dropout = float(field_or_default(m, "feature_dropout", 0.0))
  if m.kind == "linear":
    return LinearQuery(num_features=num_features, feature_dropout=feature_dropout), num_features + 1
  if m.kind == "mlp":
    return (MLPTower(hidden=m.hidden, out=m.out, num_hidden_layers=field_or_default(m, "num_hidden_layers", 1),
                     dropout=dropout, feature_dropout=feature_dropout, **dtype), m.out)
  bag_matmul = field_or_default(m, "bag_matmul", "gather")
  if m.kind == "wide_deep":
    return (WideDeepQuery(num_features=num_features, hidden=m.hidden, out=m.out, dropout=dropout,
                          feature_dropout=feature_dropout, bag_matmul=bag_matmul, **dtype),
            num_features + 1 + m.out)
  return SNMTower(num_features=num_features, hidden=m.hidden, out=m.out, dropout=dropout,
                  feature_dropout=feature_dropout, bag_matmul=bag_matmul, **dtype), m.out


def sparse_input_table(config) -> bool:
  """True when the tower's EmbeddingBag table is a row-updated table: model.input_update="sparse"
  with snm_tower or wide_deep and model.bag_matmul="gather", in the classification task. linear
  and mlp have no input table; a dense-matmul bag (bag_matmul="dense", or "auto" before a recipe
  resolves it) is a dense layer whose gradient is the whole table, updated by optax; the
  retrieval task's tower has no EmbeddingBag."""
  return gathered_bag(config) and field_or_default(config.model, "input_update", "dense") == "sparse"


def gathered_bag(config) -> bool:
  """True when the model has a gathered EmbeddingBag (snm_tower or wide_deep, bag_matmul="gather",
  classification): the only models `model.input_update` applies to."""
  m = config.model
  return (field_or_default(config, "task", "classification") == "classification" and m.kind in BAG_KINDS
          and field_or_default(m, "bag_matmul", "gather") == "gather")


def make_input_table(config, mesh) -> InputTable | None:
  """The sparse input table's operations (`snm_jax.train.core.input_table`), or None (dense update,
  or no input table). Its row optimiser is the tower optimiser's row-wise counterpart at the
  tower's learning rate schedule: sgd -> SGD, momentum -> lazy momentum (beta =
  optimizer.momentum), adagrad -> row-wise Adagrad, with optimizer.weight_decay as the row
  optimiser's decoupled, lazy decay (the differences: `snm_jax.train.core.input_table`)."""
  if not sparse_input_table(config):
    return None
  o = config.optimizer
  opt = row_optimizers.get_row_optimizer(o.name, **({"beta": o.momentum} if o.name == "momentum" else {}))
  wd = float(field_or_default(o, "weight_decay", 0.0))
  return InputTable(mesh=mesh, row_opt=opt._replace(weight_decay=wd) if wd else opt,
                    lr=make_schedule(o, config.train.num_steps))


def make_schedule(opt_config, num_steps: int, field: str = "optimizer"):
  """learning_rate, linearly warmed up from 0 over warmup_steps, then constant
  or cosine-decayed to 0 at num_steps. `field` names the config section in errors."""
  lr = opt_config.learning_rate
  warmup = field_or_default(opt_config, "warmup_steps", 0)
  decay = field_or_default(opt_config, "decay", "constant")
  if decay == "cosine":
    sched = optax.cosine_decay_schedule(lr, max(num_steps - warmup, 1))
  elif decay == "constant":
    sched = optax.constant_schedule(lr)
  else:
    raise ConfigError(f"{field}.decay", f"{decay!r} is not one of {list(DECAYS)}")
  if warmup:
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), sched], [warmup])
  return sched


def make_table_schedule(config):
  """step -> the class table's learning rate (table.learning_rate with
  table.warmup_steps and table.decay, as make_schedule); make_train_step's
  `table_lr`. The row-wise weight decay uses the same value."""
  return make_schedule(config.table, config.train.num_steps, field="table")


def _decay_mask(params):
  """True on kernels and embeddings, False on biases (and anything else)."""
  def is_weight(path, _):
    last = path[-1] if path else None
    return getattr(last, "key", getattr(last, "name", None)) in ("kernel", "embedding")
  return jax.tree_util.tree_map_with_path(is_weight, params)


def make_tower_optimizer(config) -> optax.GradientTransformation:
  """optax optimiser of the dense tower. optimizer.weight_decay = wd > 0 adds
  decoupled weight decay of the kernels and embeddings (not the biases):
  adam -> optax.adamw; sgd / momentum / adagrad -> chain(their gradient
  statistics, add_decayed_weights(wd), scale_by_learning_rate), i.e.
  p <- p - lr_t (u_t + wd p) with u_t the plain / momentum / Adagrad direction
  (the decay bypasses the momentum and the Adagrad accumulator). wd = 0 builds
  exactly the plain optax optimiser."""
  o = config.optimizer
  sched = make_schedule(o, config.train.num_steps)
  wd = float(field_or_default(o, "weight_decay", 0.0))
  if wd:
    stats = {
        "sgd": optax.identity,
        "momentum": lambda: optax.trace(decay=o.momentum, nesterov=False),
        "adagrad": lambda: optax.scale_by_rss(initial_accumulator_value=0.1, eps=1e-7),  # optax.adagrad's
    }
    table = {name: (lambda f=f: optax.chain(f(), optax.add_decayed_weights(wd, mask=_decay_mask),
                                            optax.scale_by_learning_rate(sched)))
             for name, f in stats.items()}
    table["adam"] = lambda: optax.adamw(sched, weight_decay=wd, mask=_decay_mask)
  else:
    table = {
        "sgd": lambda: optax.sgd(sched),
        "momentum": lambda: optax.sgd(sched, momentum=o.momentum),
        "adam": lambda: optax.adam(sched),
        "adagrad": lambda: optax.adagrad(sched),
    }
  if o.name not in table:
    raise ConfigError("optimizer.name", f"{o.name!r} is not one of {sorted(table)}")
  tx = table[o.name]()
  if config.train.on_nonfinite == "skip":
    # The train step itself drops a non-finite step's whole update (tower and table) and
    # counts it (train.max_skipped_steps bounds them). This wrapper, redundant with that,
    # is kept because it is part of the skip mode's optimiser state: removing it would
    # change the bits of skip-mode runs and make their checkpoints unrestorable.
    tx = optax.apply_if_finite(tx, max_consecutive_errors=1_000_000)
  return tx


def make_row_optimizer(config):
  """The class table's row-wise optimiser, with table.weight_decay (decoupled,
  lazy: only the rows a step touches are decayed, by 1 - lr_t * wd, once)."""
  t = config.table
  kwargs = {"beta": t.momentum} if t.optimizer == "momentum" else {}
  opt = row_optimizers.get_row_optimizer(t.optimizer, **kwargs)
  wd = float(field_or_default(t, "weight_decay", 0.0))
  return opt._replace(weight_decay=wd) if wd else opt
