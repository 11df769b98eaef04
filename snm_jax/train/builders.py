"""Config -> the objects of a run (model, samplers, losses, optimisers), with
validation that fails before any compilation, naming the offending field."""

from __future__ import annotations

import numpy as np
import optax

from snm_jax import losses
from snm_jax.errors import ConfigError
from snm_jax.mining.samplers import StratifiedSampler, unigram_stratum_cdf
from snm_jax.models.towers import LinearQuery, SNMTower
from snm_jax.train import row_optimizers
from snm_jax.train.step import LossSpec

LOSS_KINDS = ("bowl", "powl", "sampled_softmax", "full_softmax", "logistic_ns", "adversarial_ns", "nce")
SAMPLERS = ("uniform", "unigram", "full", "tree")
VARTHETAS = ("top_k", "negative_sampling", "power_law")
REDUCTIONS = ("mean", "s2m")


def _one_of(field, value, allowed):
  if value not in allowed:
    raise ConfigError(field, f"{value!r} is not one of {list(allowed)}")


def validate(config, num_labels: int) -> None:
  """Checks the fields that do not depend on the data beyond K. Raises ConfigError."""
  _one_of("loss.kind", config.loss.kind, LOSS_KINDS)
  _one_of("loss.reduction", config.loss.reduction, REDUCTIONS)
  _one_of("mining.sampler", config.mining.sampler, SAMPLERS)
  _one_of("mining.vartheta", config.mining.vartheta, VARTHETAS)
  _one_of("model.kind", config.model.kind, ("snm_tower", "linear"))
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


def make_tower(config, num_features: int):
  if config.model.kind == "linear":
    return LinearQuery(num_features=num_features), num_features + 1
  return SNMTower(num_features=num_features, hidden=config.model.hidden, out=config.model.out), config.model.out


def make_schedule(opt_config, num_steps: int):
  lr = opt_config.learning_rate
  if opt_config.decay == "cosine":
    sched = optax.cosine_decay_schedule(lr, max(num_steps - opt_config.warmup_steps, 1))
  elif opt_config.decay == "constant":
    sched = optax.constant_schedule(lr)
  else:
    raise ConfigError("optimizer.decay", f"{opt_config.decay!r} is not one of ['constant', 'cosine']")
  if opt_config.warmup_steps:
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, opt_config.warmup_steps), sched], [opt_config.warmup_steps])
  return sched


def make_tower_optimizer(config) -> optax.GradientTransformation:
  o = config.optimizer
  sched = make_schedule(o, config.train.num_steps)
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
  t = config.table
  kwargs = {"beta": t.momentum} if t.optimizer == "momentum" else {}
  return row_optimizers.get_row_optimizer(t.optimizer, **kwargs)
