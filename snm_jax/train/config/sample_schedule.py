"""A sample size B that grows during training: `mining.num_samples_schedule`.

Reddi et al. (2019, Sec. 7) leave open growing the number B of sampled
negatives as training proceeds: early on the model is poor and few samples
hold a hard negative anyway; later the hard negatives are rarer, and a larger
B finds them (the top-k of B samples approaches the top-k of all K, Sec. 4).

A schedule is a tuple of (start_step, B) pairs sorted by start_step, the
first at 0, e.g. ((0, 1024), (4000, 2048), (8000, 4096)). Phase p trains the
states with start_p <= state.step < start_{p+1} (the steps the logs number
start_p + 1 ... start_{p+1}) with B_p negatives and with the loss B_p defines:
vartheta over B_p ((K-1)/(kB) with vartheta_norm="expectation", 1/B for
negative sampling's "mean"; `losses.vartheta`), S = B in Eq. 6's log S, the
logQ counts log(B q) of the softmaxes and NCE, mined_softmax's k of B. An
empty schedule is B = `mining.num_samples` at every step; with a schedule,
`mining.num_samples` is not used.

Shapes stay static: a train step is built per distinct B before training
(`phased_step`), each compiled once (`max_traces=1`), and `PhasedStep` picks
the current phase's on the host. The train state does not depend on B (the
tower, the class table and its row-optimiser state have no B axis), so one
state flows through every phase. Phase p's step is exactly the step a fixed
`mining.num_samples = B_p` run builds (`phase_config`). Resuming is bit-exact
inside a phase and across a boundary: the phase is a function of state.step
and the loop's key of a step is fold_in(base_key, step).
"""

from __future__ import annotations

import bisect
from typing import Any, Callable

import jax
from absl import logging

from snm_jax.train.config.overrides import with_overrides

FIELD = "mining.num_samples_schedule"


def phases(config) -> tuple[tuple[int, int], ...]:
  """The run's ((start_step, B), ...): the schedule as ints, or ((0, mining.num_samples),)
  when it is empty (a config may predate the field). Validated by `validation.validate`."""
  schedule = config.mining.get("num_samples_schedule", ())
  if not schedule:
    return ((0, int(config.mining.num_samples)),)
  return tuple((int(start), int(b)) for start, b in schedule)


def phase_config(config, num_samples: int):
  """A locked copy of `config` with B = `num_samples` fixed (`mining.num_samples`, no
  schedule): the config a phase's sampler and loss are built from (`builders.make_sampler`,
  `builders.make_loss_spec`), so a phase trains exactly as a fixed-B run would."""
  overrides = {"mining.num_samples": int(num_samples)}
  if "num_samples_schedule" in config.mining:
    overrides[FIELD] = ()
  return with_overrides(config, overrides)


def num_samples_at(schedule, step: int) -> int:
  """B of the phase that trains the state at `step` (steps done so far)."""
  starts = [start for start, _ in schedule]
  return schedule[bisect.bisect_right(starts, step) - 1][1]


class PhasedStep:
  """`step(state, batch, rng) -> (state, metrics)`: the train step of the phase state.step is in.

  steps: {B: a jitted `train_step(state, batch, rng)` for that B} (`step.make_train_step`).
  The step number is tracked on the host, without a device sync per step: the
  first call, and any call with a state other than the one the previous call
  returned, reads state.step (one device-to-host copy of a scalar, as the loop
  does after restoring); otherwise it is the previous call's plus one (every
  step advances state.step by one, a skipped non-finite step too).
  """

  def __init__(self, schedule, steps: dict[int, Callable]):
    self.schedule = tuple(schedule)
    self.steps = steps
    self._last = None  # (the state.step array the last call returned, its value)
    self._current_b = None

  def __call__(self, state, batch, rng):
    if self._last is not None and state.step is self._last[0]:
      step = self._last[1]
    else:
      step = int(jax.device_get(state.step))
    b = num_samples_at(self.schedule, step)
    if b != self._current_b:
      logging.info("step %d: B = %d sampled negatives (%s %s)", step + 1, b, FIELD, self.schedule)
      self._current_b = b
    new_state, metrics = self.steps[b](state, batch, rng)
    self._last = (new_state.step, step + 1)
    return new_state, metrics


def per_size(schedule, build: Callable[[int], Any]) -> dict[int, Any]:
  """{B: build(B)} for every distinct B of the schedule (in schedule order)."""
  return {b: build(b) for b in dict.fromkeys(b for _, b in schedule)}


def phased_step(schedule, build_step: Callable[[int], Callable]) -> Callable:
  """The run's train step: `build_step(B)` itself for a single B (a fixed-B run is
  unchanged), else a `PhasedStep` over one `build_step(B)` per distinct B."""
  steps = per_size(schedule, build_step)
  return next(iter(steps.values())) if len(steps) == 1 else PhasedStep(schedule, steps)


def phased_diagnose(schedule, build_diagnose: Callable[[int], Callable]) -> Callable:
  """`diagnose(state, step)` (`snm_jax.train.core.diagnostics`) with the sampler and loss of the
  phase that trains the state at `step`, i.e. of the next step (the last phase's at the end)."""
  diagnoses = per_size(schedule, build_diagnose)
  if len(diagnoses) == 1:
    return next(iter(diagnoses.values()))

  def diagnose(state, step: int) -> dict:
    return diagnoses[num_samples_at(schedule, step)](state, step)

  return diagnose
