"""mining.num_samples_schedule (snm_jax/train/config/sample_schedule.py): B grows at phase boundaries,
one compiled step per B, each phase's step exactly the fixed-B step, resume bit-exact inside a
phase and across a boundary, bad schedules refused before anything runs."""

import json

import jax
import numpy as np
import pytest

from experiments.configs import default
from experiments.sweeps.spec import apply_overrides
from snm_jax import sharding
from snm_jax.errors import ConfigError
from snm_jax.train.config import sample_schedule, validation
from snm_jax.train.trainer import classification
from snm_jax.train.core import step as step_lib
from snm_jax.train.trainer.checkpointing import check_resume_config
from snm_jax.train.trainer.loop import train_and_evaluate
from snm_jax.train.core.task import state_fingerprint

SCHEDULE = ((0, 8), (3, 16), (6, 32))  # two boundaries: steps 1-3 B=8, 4-6 B=16, 7-8 B=32
STEPS = 8
K = 256  # accidental hits are rare: the valid negatives of a step are ~B


def config(**overrides):
  c = default.get_config("paper,runlocal")
  base = {"dataset.name": "synthetic", "dataset.synthetic.num_labels": K,
          "dataset.synthetic.num_train": 512, "dataset.synthetic.num_test": 64,
          "dataset.synthetic.dim": 16, "mesh.shape": (1, 2), "mining.num_strata": 8, "mining.k": 4,
          # vartheta = (K-1)/(kB) on the top k: the loss itself changes with B
          "mining.vartheta_norm": "expectation", "mining.num_samples": 64,
          "mining.num_samples_schedule": SCHEDULE, "train.num_steps": STEPS, "train.log_every": 1,
          "train.eval_every": 0, "train.checkpoint_every": 0, "eval.max_examples": 64}
  return apply_overrides(c, {**base, **overrides})


def _rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The scheduled run uninterrupted and the same run stopped at 5 then resumed to 8 in its
  workdir, on a (data 1, model 2) mesh: {name: results}, "traces": {name: the number of traces
  of each train step the run built}, "rows": the uninterrupted run's metrics.jsonl."""
  root = tmp_path_factory.mktemp("schedule")
  traces = {}
  limit = step_lib.limit_traces

  def counting(fn, n):
    count = [0]
    traces[name].append(count)

    def counted(*args):
      count[0] += 1
      return fn(*args)
    return limit(counted, n)

  out = {}
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(step_lib, "limit_traces", counting)
    # full; then 5 steps across 3 into phase 1, resumed inside it and across 6 to the end
    for name, steps, workdir in (("full", STEPS, "full"), ("resumed@5", 5, "resumed"),
                                 (f"resumed@{STEPS}", STEPS, "resumed")):
      traces[name] = []
      out[name] = train_and_evaluate(config(**{"train.num_steps": steps}), root / workdir)
  out["traces"] = {name: [c[0] for c in counts] for name, counts in traces.items()}
  out["rows"] = _rows(root / "full")
  return out


def test_one_compiled_step_per_phase(runs):
  # Three steps built (one per B), each traced once over a run crossing two boundaries (a
  # second trace would also raise: each is built with max_traces=1).
  assert runs["traces"]["full"] == [1, 1, 1]
  assert runs["full"]["steps"] == STEPS


def test_each_phase_draws_its_B(runs):
  # valid_negatives: the step's sampled negatives that are not a positive, ~B of the phase
  # (B - accidental hits; at most a few of B draws hit one of <= 5 positives among 256).
  got = {row["step"]: row["valid_negatives"] for row in runs["rows"] if "valid_negatives" in row}
  assert sorted(got) == list(range(1, STEPS + 1))
  for step, valid in got.items():
    b = sample_schedule.num_samples_at(SCHEDULE, step - 1)
    assert b - 1.0 <= valid <= b, (step, b, valid)


def test_resume_inside_a_phase_and_across_boundaries_is_bit_exact(runs):
  assert [runs[f"resumed@{s}"]["steps"] for s in (5, STEPS)] == [5, STEPS]
  # The second part resumed from step 5: it never ran the B = 8 step.
  assert runs["traces"] == {"full": [1, 1, 1], "resumed@5": [1, 1, 0], f"resumed@{STEPS}": [0, 1, 1]}
  assert runs["resumed@5"]["state_fingerprint"] != runs["full"]["state_fingerprint"]
  assert runs[f"resumed@{STEPS}"]["state_fingerprint"] == runs["full"]["state_fingerprint"]
  assert runs[f"resumed@{STEPS}"]["final"]["P@1"] == runs["full"]["final"]["P@1"]


def test_each_phase_step_is_the_fixed_B_step():
  # The scheduled step equals, before and after the boundary, the step of a fixed-B run with
  # that phase's B (sampler and vartheta = (K-1)/(kB)) from the same state: metrics and new
  # state, bit for bit; mining.num_samples (64) is unused with a schedule. So are the
  # diagnostics of a state the second phase trains.
  mesh = sharding.make_mesh((1, 1))
  small = {"mesh.shape": (1, 1), "diagnostics.every": 1, "diagnostics.probe_size": 32,
           "diagnostics.snr_draws": 0}
  task = classification.build(config(**small, **{"mining.num_samples_schedule": ((0, 8), (1, 16))}), mesh)
  fixed_tasks = {b: classification.build(config(**small, **{"mining.num_samples": b,
                                                            "mining.num_samples_schedule": ()}), mesh)
                 for b in (8, 16)}
  fixed = {b: t.train_step for b, t in fixed_tasks.items()}
  assert isinstance(task.train_step, sample_schedule.PhasedStep)
  key, state = jax.random.key(1), task.state
  for i, b in enumerate((8, 16)):
    batch, rng = next(task.batches), jax.random.fold_in(key, i)
    twin = jax.tree.map(lambda x: jax.device_put(np.asarray(x), x.sharding), state)  # steps donate
    want_state, want = fixed[b](twin, batch, rng)
    state, got = task.train_step(state, batch, rng)
    assert jax.device_get(got) == jax.device_get(want), b
    assert b - 1 <= float(got["valid_negatives"]) <= b
    assert state_fingerprint(state) == state_fingerprint(want_state), b
  assert int(state.step) == 2
  assert task.diagnostics(state, 2) == fixed_tasks[16].diagnostics(state, 2)


def test_changed_schedule_is_refused_on_resume():
  saved = json.loads(config().to_json_best_effort())
  check_resume_config(saved, json.loads(config(**{"train.num_steps": 20}).to_json_best_effort()), "w")
  changed = json.loads(config(**{"mining.num_samples_schedule": ((0, 8), (4, 16))}).to_json_best_effort())
  with pytest.raises(ConfigError, match=r"mining\.num_samples_schedule"):
    check_resume_config(saved, changed, "w")


@pytest.mark.parametrize("overrides,words", [
    ({"mining.num_samples_schedule": ((1, 8), (3, 16))}, "begin at 0"),
    ({"mining.num_samples_schedule": ((0, 8), (3, 16), (3, 32))}, "increase strictly"),
    ({"mining.num_samples_schedule": ((0, 8), (6, 16), (3, 32))}, "increase strictly"),
    ({"mining.num_samples_schedule": ((0, 8), (3, 0))}, r"phase \(3, 0\): B must be >= 1"),
    ({"mining.num_samples_schedule": ((0, 8), (3, 16.0))}, "integer"),
    ({"mining.num_samples_schedule": (0, 8)}, "integer"),
    ({"mining.num_samples_schedule": ((0, 8), (3, 12))}, r"B=12 must be divisible by mining\.num_strata=8"),
    ({"mining.num_samples_schedule": ((0, 8), (3, 16)), "mining.k": 12}, r"B=8 is less than mining\.k=12"),
    ({"mining.num_samples_schedule": ((0, 8),), "mining.sampler": "full",
      "loss.kind": "full_softmax"}, "scores every label"),
])
def test_bad_schedule_is_a_config_error(overrides, words):
  with pytest.raises(ConfigError, match=r"config\.mining\.num_samples_schedule: .*" + words):
    validation.validate(config(**overrides))


def test_schedule_checks_that_need_K():
  # The exact sampler draws B < K distinct negatives, in every phase; K = 256 here.
  exact = config(**{"mining.sampler": "exact", "mining.num_samples_schedule": ((0, 64), (3, 256))})
  validation.validate(exact)  # without K: nothing to refuse
  with pytest.raises(ConfigError, match=r"mining\.num_samples_schedule: phase \(3, 256\).*B=256 must be < K=256"):
    validation.validate(exact, K)
  # The exact sampler and B not divisible by the strata: fine (it does not stratify).
  validation.validate(config(**{"mining.sampler": "exact", "mining.num_samples_schedule": ((0, 12), (3, 20))}), K)
  # The schedule replaces mining.num_samples: a k above it but not above any phase's B is fine.
  validation.validate(config(**{"mining.num_samples": 2, "mining.num_samples_schedule": ((0, 8),)}), K)
  # Each phase's vartheta: the floor 1.0 is below (K-1)/(kB) = 255/32 at B = 8, above 255/512 at B = 128.
  floored = config(**{"mining.floor": 1.0, "mining.num_samples_schedule": ((0, 8), (3, 128))})
  with pytest.raises(ConfigError, match=r"mining\.num_samples_schedule: phase \(3, 128\): .*floor"):
    validation.validate(floored, K)
  validation.validate(config(**{"mining.floor": 1.0, "mining.num_samples_schedule": ((0, 8), (3, 16))}), K)


def test_schedule_from_the_command_line():
  # What `python -m experiments.train --config.mining.num_samples_schedule=...` and the sweeps'
  # printed commands (experiments.ablate) pass: a tuple literal, parsed by ml_collections.
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  argv = ["prog", "--config.mining.num_samples_schedule=((0, 8),(3, 16))"]
  values = flags.FlagValues()
  config_flags.DEFINE_config_dict("config", config(), flag_values=values, sys_argv=argv)
  values(argv)
  assert values.config.mining.num_samples_schedule == ((0, 8), (3, 16))
  assert sample_schedule.phases(values.config) == ((0, 8), (3, 16))
  validation.validate(values.config)


class _FakeState:
  def __init__(self, step):
    self.step = jax.numpy.asarray(step, jax.numpy.int32)


def test_phased_step_follows_state_step_on_the_host():
  calls = []

  def fake_step(b):
    def step(state, batch, rng):
      calls.append((int(state.step), b))
      return _FakeState(int(state.step) + 1), {}
    return step

  phased = sample_schedule.phased_step(SCHEDULE, fake_step)
  assert isinstance(phased, sample_schedule.PhasedStep) and sorted(phased.steps) == [8, 16, 32]
  state = _FakeState(2)  # a restored state: its step is read once
  for _ in range(5):
    state, _ = phased(state, None, None)
  assert calls == [(2, 8), (3, 16), (4, 16), (5, 16), (6, 32)]
  phased(_FakeState(0), None, None)  # another state (not the one last returned): read again
  assert calls[-1] == (0, 8)
  # One B: the step itself, no wrapper (a fixed-B run is unchanged).
  assert sample_schedule.phased_step(((0, 8),), fake_step).__name__ == "step"
  diagnose = sample_schedule.phased_diagnose(SCHEDULE, lambda b: (lambda state, step: {"B": b}))
  assert [diagnose(None, s)["B"] for s in (0, 2, 3, 5, 6, STEPS)] == [8, 8, 16, 16, 32, 32]


def test_tree_sampler_takes_the_schedule(tmp_path):
  # Bamler & Mandt's tree (Eq. 6 loss): the fitted tree draws the phase's B per example, not
  # mining.num_samples (1 in this config). Eq. 6 masks no accidental hit, so every draw is a
  # valid negative: exactly B per step. (One phase: a tree step compiles slowly; the switch
  # between phases does not depend on the sampler.)
  c = apply_overrides(default_adversarial(), {
      "dataset.synthetic.num_labels": 64, "dataset.synthetic.num_train": 256,
      "dataset.synthetic.num_test": 32, "dataset.synthetic.dim": 16, "adversarial.pca_dim": 4,
      "mesh.shape": (1, 1), "train.num_steps": 3, "train.log_every": 1, "train.eval_every": 0,
      "train.checkpoint_every": -1, "eval.max_examples": 32,
      "mining.num_samples_schedule": ((0, 4),)})
  assert c.mining.num_samples == 1
  train_and_evaluate(c, tmp_path)
  valid = [row["valid_negatives"] for row in _rows(tmp_path) if "valid_negatives" in row]
  assert valid == [4.0, 4.0, 4.0]


def default_adversarial():
  from experiments.configs import adversarial  # pylint: disable=g-import-not-at-top
  return adversarial.get_config("synthetic,method=adversarial,runlocal")
