"""The host-side record of a run, saved in every checkpoint so a resumed run continues it.

It holds what the device state does not: the evaluation history, the training
time spent so far (cumulative over restarts), and the model-selection
bookkeeping: the best validation value of `eval.select_metric`, its step, and
how many evaluations have passed without improving it (`train.patience`).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class Progress:
  train_seconds: float = 0.0          # training time so far, evaluations excluded, all restarts summed
  history: list = dataclasses.field(default_factory=list)  # one dict per evaluation
  best_step: int = -1                 # step of the best validation value, -1 before any
  best_value: float | None = None
  evals_since_best: int = 0
  stopped_early: bool = False

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, data: dict | None) -> "Progress":
    """`data` from a checkpoint; None (a checkpoint of an older version) gives a fresh record."""
    return cls(**data) if data else cls()

  def record_selection(self, step: int, value: float) -> bool:
    """Notes the validation value of `step`; True when it is the best so far.

    Ties keep the earlier step (fewer steps, same validation quality). A NaN
    value never improves.
    """
    if not math.isnan(value) and (self.best_value is None or value > self.best_value):
      self.best_step, self.best_value, self.evals_since_best = step, value, 0
      return True
    self.evals_since_best += 1
    return False

  def out_of_patience(self, patience: int) -> bool:
    """True when `patience` > 0 evaluations in a row did not improve the best value."""
    return patience > 0 and self.evals_since_best >= patience
