"""Class-balanced batches: G classes x M samples each (the paper: 56 x 4 = 224).

Within a batch every item's positives are exactly the other M - 1 items of its
group, so the batch positive rate pi0 = (M - 1) / (B - 1) differs from the prior
of the whole data set, which is the situation SOPRC's estimator corrects for.
"""
from typing import Tuple

import numpy as np

from snm_jax.errors import ConfigError


class ClassBalancedSampler:
  """Deterministic sampler: batch `step` depends only on (seed, step).

  Each batch draws G = batch_size / samples_per_class distinct classes among
  those with at least samples_per_class members (without replacement, with
  probability proportional to class size or uniform), then samples_per_class
  distinct members of each. Items of group g occupy positions
  [g M, (g + 1) M) of the batch. Resuming needs nothing but the step: as an
  iterator (`next`) it yields batch 0, 1, ... and `get_state()` / `set_state()`
  save and restore that position (bit-exact).
  """

  def __init__(self, labels_N, *, samples_per_class: int = 4,
               batch_size: int = 224, seed: int = 0,
               class_weighting: str = "size"):
    """Args:
      labels_N: (N,) int class of every data point.
      samples_per_class: M, positives per class per batch (>= 2).
      batch_size: B, a multiple of M.
      seed: base seed.
      class_weighting: "size" (classes drawn in proportion to their size, so
        every point is seen equally often on average) or "uniform".
    """
    labels_N = np.asarray(labels_N)
    if samples_per_class < 2:
      raise ConfigError("samples_per_class",
                        f"must be >= 2 to form positive pairs, got {samples_per_class}")
    if batch_size <= 0 or batch_size % samples_per_class:
      raise ConfigError("batch_size", f"must be a positive multiple of "
                        f"samples_per_class={samples_per_class}, got {batch_size}")
    if class_weighting not in ("size", "uniform"):
      raise ConfigError("class_weighting",
                        f"must be 'size' or 'uniform', got {class_weighting!r}")
    classes, counts = np.unique(labels_N, return_counts=True)
    keep = counts >= samples_per_class
    self.classes = classes[keep]
    self.num_groups = batch_size // samples_per_class
    if len(self.classes) < self.num_groups:
      raise ConfigError("batch_size", f"needs {self.num_groups} classes with >= "
                        f"{samples_per_class} members, the labels have only "
                        f"{len(self.classes)}")
    order = np.argsort(labels_N, kind="stable")
    starts = np.searchsorted(labels_N[order], self.classes)
    self._members = [order[s:s + c] for s, c in zip(starts, counts[keep])]
    weights = counts[keep].astype(np.float64)
    if class_weighting == "uniform":
      weights = np.ones_like(weights)
    self._p = weights / weights.sum()
    self.samples_per_class = samples_per_class
    self.batch_size = batch_size
    self.seed = seed
    self.position = 0  # the batch `next` returns

  def __iter__(self):
    return self

  def __next__(self) -> Tuple[np.ndarray, np.ndarray]:
    out = self.batch(self.position)
    self.position += 1
    return out

  def get_state(self) -> dict:
    return {"position": self.position, "seed": self.seed}

  def set_state(self, state: dict) -> None:
    """Restores `get_state()`; raises ValueError for another seed or a bad position."""
    if state.get("seed") != self.seed or not (isinstance(state.get("position"), int)
                                              and state["position"] >= 0):
      raise ValueError(f"sampler state {state} does not belong to this sampler (seed {self.seed})")
    self.position = state["position"]

  def batch(self, step: int) -> Tuple[np.ndarray, np.ndarray]:
    """Returns (indices_B int64, classes_G) of batch number `step`."""
    rng = np.random.default_rng([self.seed, step])
    which_G = rng.choice(len(self.classes), self.num_groups, replace=False,
                         p=self._p)
    indices = [rng.choice(self._members[w], self.samples_per_class,
                          replace=False) for w in which_G]
    return np.concatenate(indices).astype(np.int64), self.classes[which_G]

  def batches(self, start_step: int, num_steps: int):
    """Stacked batches start_step .. start_step + num_steps - 1: ((T, B), (T, G))."""
    pairs = [self.batch(s) for s in range(start_step, start_step + num_steps)]
    return (np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]))
