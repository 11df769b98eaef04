"""Config -> the objects of a run (model, samplers, losses, optimisers), with
validation that fails before any compilation, naming the offending field."""

from __future__ import annotations

import jax
import numpy as np
import optax

from snm_jax import losses
from snm_jax.errors import ConfigError
from snm_jax.mining.samplers import StratifiedSampler, unigram_stratum_cdf
from snm_jax.models.towers import LinearQuery, SNMTower, WideDeepQuery
from snm_jax.train import row_optimizers
from snm_jax.train.step import LossSpec

LOSS_KINDS = ("bowl", "powl", "sampled_softmax", "full_softmax", "logistic_ns", "adversarial_ns", "nce")
SAMPLERS = ("uniform", "unigram", "full", "tree")
VARTHETAS = ("top_k", "negative_sampling", "power_law")
REDUCTIONS = ("mean", "s2m")
MODEL_KINDS = ("snm_tower", "linear", "wide_deep")
LINEAR_KINDS = ("linear", "wide_deep")  # class rows hold a linear model [w_y, b_y, ...], start at 0
DECAYS = ("constant", "cosine")


def _field(section, name, default):
  """config.<section>.<name>, or its base_config() default for configs that predate it."""
  return section.get(name, default)


def _nonnegative(field, value):
  if not value >= 0:
    raise ConfigError(field, f"must be >= 0, got {value!r}")


def _rate(field, value):
  if not 0.0 <= value < 1.0:
    raise ConfigError(field, f"must be a dropout rate in [0, 1), got {value!r}")


def _one_of(field, value, allowed):
  if value not in allowed:
    raise ConfigError(field, f"{value!r} is not one of {list(allowed)}")


def validate(config, num_labels: int) -> None:
  """Checks the fields that do not depend on the data beyond K. Raises ConfigError."""
  _one_of("loss.kind", config.loss.kind, LOSS_KINDS)
  _one_of("loss.reduction", config.loss.reduction, REDUCTIONS)
  _one_of("mining.sampler", config.mining.sampler, SAMPLERS)
  _one_of("mining.vartheta", config.mining.vartheta, VARTHETAS)
  _one_of("model.kind", config.model.kind, MODEL_KINDS)
  resolve_normalize_classes(config)  # explicit True with a linear kind
  _rate("model.dropout", _field(config.model, "dropout", 0.0))
  _rate("model.feature_dropout", _field(config.model, "feature_dropout", 0.0))
  if config.model.kind == "linear" and _field(config.model, "dropout", 0.0):
    raise ConfigError("model.dropout", "model.kind=linear has no hidden layer to drop; "
                      "use model.feature_dropout (or model.kind=snm_tower | wide_deep)")
  _nonnegative("optimizer.weight_decay", _field(config.optimizer, "weight_decay", 0.0))
  _one_of("optimizer.decay", config.optimizer.decay, DECAYS)
  _nonnegative("optimizer.warmup_steps", config.optimizer.warmup_steps)
  t = config.table
  _nonnegative("table.weight_decay", _field(t, "weight_decay", 0.0))
  if _field(t, "weight_decay", 0.0) * t.learning_rate >= 1.0:
    raise ConfigError("table.weight_decay", f"table.learning_rate * table.weight_decay = "
                      f"{t.learning_rate} * {_field(t, 'weight_decay', 0.0)} must be < 1 (each "
                      "touched row is multiplied by 1 - lr * weight_decay)")
  _one_of("table.decay", _field(t, "decay", "constant"), DECAYS)
  _nonnegative("table.warmup_steps", _field(t, "warmup_steps", 0))
  _one_of("train.on_nonfinite", config.train.on_nonfinite, ("stop", "skip"))
  b, k = config.mining.num_samples, config.mining.k
  if b < 1:
    raise ConfigError("mining.num_samples", f"B must be >= 1, got {b}")
  if config.loss.kind in ("bowl", "powl") and not 1 <= k <= b:
    raise ConfigError("mining.k", f"k={k} must be in [1, mining.num_samples={b}]")
  if config.mining.sampler == "full":
    if config.loss.kind != "full_softmax":
      raise ConfigError("mining.sampler", "'full' scores every label; use it with loss.kind=full_softmax")
  elif config.loss.kind == "full_softmax":
    raise ConfigError("loss.kind", "full_softmax needs mining.sampler='full'")
  if config.loss.kind == "adversarial_ns" and config.mining.sampler != "tree":
    raise ConfigError("loss.kind", "adversarial_ns (Eq. 6) needs mining.sampler='tree'")
  if config.loss.kind == "nce" and config.mining.sampler not in ("uniform", "tree"):
    raise ConfigError("loss.kind", "nce needs mining.sampler='uniform' or 'tree'")
  if config.mining.sampler == "tree" and config.loss.kind in ("sampled_softmax", "full_softmax"):
    raise ConfigError("mining.sampler", f"the tree sampler does not support loss.kind={config.loss.kind}")
  if config.loss.kind == "sampled_softmax" and config.mining.sampler == "unigram":
    raise ConfigError("loss.kind", "sampled_softmax's logQ correction of the positive is "
                      "implemented for the uniform sampler only")
  if config.loss.reduction == "s2m" and not 1 <= config.loss.k_prime <= config.train.batch_size:
    raise ConfigError("loss.k_prime",
                      f"k'={config.loss.k_prime} must be in [1, train.batch_size={config.train.batch_size}]")
  if num_labels < 2:
    raise ConfigError("dataset.name", f"needs at least 2 labels, got {num_labels}")
  try:
    losses.get_phi(config.loss.phi)
  except ValueError as e:
    raise ConfigError("loss.phi", str(e)) from None
  make_loss_spec(config, num_labels)  # vartheta construction errors


def make_vartheta(config, num_labels: int) -> np.ndarray:
  m = config.mining
  try:
    if m.vartheta == "top_k":
      return losses.top_k_vartheta(m.k, m.num_samples, num_labels, scale=m.scale, floor=m.floor)
    if m.vartheta == "negative_sampling":
      if m.scale == "mean":  # the plain average over all B sampled negatives
        return losses.top_k_vartheta(m.num_samples, m.num_samples, num_labels, scale="mean")
      return losses.negative_sampling_vartheta(m.k, m.num_samples, num_labels)
    return losses.power_law_vartheta(m.power_alpha, m.num_samples, num_labels, k=m.k,
                                     scale=m.scale, floor=m.floor)
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
  return LossSpec(kind=kind, phi=phi, head_minus_tail=head, tail=float(tail),
                  scale=float(config.loss.scale), reduction=config.loss.reduction,
                  k_prime=int(config.loss.k_prime), lam=float(config.loss.adv_lambda))


def make_sampler(config, num_labels: int, label_counts=None):
  """Returns (StratifiedSampler, stratum_cdf or None)."""
  m = config.mining
  if m.sampler == "tree":
    raise ValueError("the tree sampler is fitted to the data: use snm_jax.adversarial.training")
  if m.sampler == "full":
    # Every label once: K_pad / V rows per stratum, drawn as the identity.
    return StratifiedSampler(num_labels, num_samples=_full_samples(num_labels, m.num_strata),
                             num_strata=m.num_strata, full=True), None
  sampler = StratifiedSampler(num_labels, m.num_samples, num_strata=m.num_strata,
                              per_example=m.per_example)
  if m.sampler == "unigram":
    if label_counts is None:
      raise ConfigError("mining.sampler", "unigram sampling needs training label counts")
    return sampler, unigram_stratum_cdf(label_counts, m.num_strata, power=m.unigram_power)
  return sampler, None


def _full_samples(num_labels, num_strata):
  return -(-num_labels // num_strata) * num_strata


def resolve_normalize_classes(config) -> bool:
  """model.normalize_classes with None ("auto") resolved: True for snm_tower
  (cosine scores), False for linear and wide_deep.

  Raises ConfigError for an explicit True with linear / wide_deep: their class
  rows [w_y, b_y(, e_y)] start at 0 (`table_init_scale`), where the gradient of
  l2_normalize is ~1/sqrt(eps) = 1e6: the first update throws the touched rows
  to norms ~1e5, after which their gradients (~1/norm) barely move them, so the
  table stops learning; normalising would also drop the scale of the linear score.
  """
  value = config.model.normalize_classes
  kind = config.model.kind
  if value is None:
    return kind == "snm_tower"
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
  start the linear model at 0), table.init_scale for snm_tower."""
  return 0.0 if config.model.kind in LINEAR_KINDS else float(config.table.init_scale)


def tower_has_dropout(config) -> bool:
  """True when the tower must be called with train=True and a dropout rng in
  training (make_train_step's `dropout=`)."""
  return bool(_field(config.model, "dropout", 0.0) or _field(config.model, "feature_dropout", 0.0))


def make_tower(config, num_features: int):
  """Returns (flax module, query width = class-row width).

  snm_tower: SNMTower, width model.out -- for large d (the table is K x out).
  linear: LinearQuery q = [x, 1], width d + 1 -- a K x (d + 1) table: moderate d only.
  wide_deep: WideDeepQuery q = [x, 1, tower(x)], width d + 1 + out -- the linear
    model plus the tower, summed in the score; also a K x (d + 1 + out) table.
  The modules take `train=True` (and rngs={"dropout": key}) to apply
  model.dropout / model.feature_dropout; their default call is deterministic.
  """
  m = config.model
  dropout = float(_field(m, "dropout", 0.0))
  feature_dropout = float(_field(m, "feature_dropout", 0.0))
  if m.kind == "linear":
    return LinearQuery(num_features=num_features, feature_dropout=feature_dropout), num_features + 1
  if m.kind == "wide_deep":
    return (WideDeepQuery(num_features=num_features, hidden=m.hidden, out=m.out, dropout=dropout,
                          feature_dropout=feature_dropout),
            num_features + 1 + m.out)
  return SNMTower(num_features=num_features, hidden=m.hidden, out=m.out, dropout=dropout,
                  feature_dropout=feature_dropout), m.out


def make_schedule(opt_config, num_steps: int, field: str = "optimizer"):
  """learning_rate, linearly warmed up from 0 over warmup_steps, then constant
  or cosine-decayed to 0 at num_steps. `field` names the config section in errors."""
  lr = opt_config.learning_rate
  warmup = _field(opt_config, "warmup_steps", 0)
  decay = _field(opt_config, "decay", "constant")
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
  wd = float(_field(o, "weight_decay", 0.0))
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
    # Drops updates whose gradients are not finite (the table does the same in the step).
    tx = optax.apply_if_finite(tx, max_consecutive_errors=1_000_000)
  return tx


def make_row_optimizer(config):
  """The class table's row-wise optimiser, with table.weight_decay (decoupled,
  lazy: only the rows a step touches are decayed, by 1 - lr_t * wd, once)."""
  t = config.table
  kwargs = {"beta": t.momentum} if t.optimizer == "momentum" else {}
  opt = row_optimizers.get_row_optimizer(t.optimizer, **kwargs)
  wd = float(_field(t, "weight_decay", 0.0))
  return opt._replace(weight_decay=wd) if wd else opt
