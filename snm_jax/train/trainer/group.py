"""Candidate groups: runs of one shape trained together, as one program.

A recipe's candidates differ in a few values -- the class table's learning rate, the seed, the
validation split (`GROUPED_FIELDS`) -- and in nothing that changes a shape. A `CandidateGroup`
trains such runs (its *members*) at once: their states stacked on a leading member axis, the
task's step `jax.vmap`ped over it (`Task.member_step`, the table's learning rate a traced input),
each member fed the next batch of its own data (one pipeline per distinct seed and dataset section:
members that read the same batches share it), so every step of every member is one dispatch of one
compiled program. What each member computes is what its own run computes
(`train_and_evaluate` with its config): the same initial state, batches, step keys
(`fold_in(key(seed + 1), step)`) and learning rate, so the group gives each member's run to float
tolerance (the vmapped matmuls may sum in another order).

Evaluation scores validation only (`eval.select_metric`, the selection of each member's best
state, kept on the device); the test split is read once per finished member, of its selected
state, by `finish`. The caller decides which members stop early (`drop`: successive halving in
`snm_jax.train.recipes.recipe`), so a group never reads the test split to choose.

A finished member leaves what a finished run leaves for the recipe and the ensembles: config.json,
results.json and its selected state in `<workdir>/best`.

Checkpoints: every `train.checkpoint_every` steps, and when `checkpoint` is called (the recipe's
answer to a preemption notice), each member still training saves in `<workdir>/checkpoints` its
state, its selected state so far, its data position, its progress record and its validation
points. A new group of the same members resumes from the newest step all of them saved
(`_resume`), so an interrupted group continues where it stopped rather than from step 0, to the
same bits as an uninterrupted one.
"""

from __future__ import annotations

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from snm_jax import metrics
from snm_jax.sharding import DATA
from snm_jax.data.pipeline import make_stacked_global_batch
from snm_jax.errors import ConfigError
from snm_jax.train.config.overrides import json_without
from snm_jax.train.runtime.host import is_writer, itstime, to_host
from snm_jax.train.runtime.inflight import InFlight
from snm_jax.train.runtime.progress import Progress
from snm_jax.train.trainer.checkpointing import Checkpointer, abstract_like, saved_steps
from snm_jax.train.runtime.workpath import workdir_path, write_text
from snm_jax.train.trainer import loop
from snm_jax.train.trainer.results import run_results, selection_record
from snm_jax.train.trainer.classification import GROUPED_FIELDS  # every other field is equal (`group_key`)
from snm_jax.train.trainer.tasks import build_task



def group_key(config) -> str | None:
  """Runs with equal keys can be one group; None: `config` trains alone (a task without a member
  step, a growing sample size, diagnostics, a tree sampler or no validation split)."""
  if (config.get("task", "classification") != "classification"
      or config.mining.get("num_samples_schedule", "") or config.mining.sampler == "tree"
      or (config.get("diagnostics") is not None and config.diagnostics.every > 0)
      or config.dataset.validation_fraction <= 0):
    return None
  return json_without(config, GROUPED_FIELDS)


MODES = ("vmap", "serial")


def default_mode() -> str:
  """"vmap" on accelerators (the members' small matmuls batched into large ones), "serial" on CPU,
  where XLA's batched matmuls ran slower per member than one member's (Bibtex, 2 cores: the
  wide_deep step 56 ms per member vmapped over 3 against 35 ms alone; the linear one level)."""
  return "serial" if jax.default_backend() == "cpu" else "vmap"


def _stacked_sharding(sharding):
  """The sharding of a member leaf's stack: the member axis unsharded in front."""
  return jax.NamedSharding(sharding.mesh, jax.P(None, *sharding.spec))


def _set_widths(batcher, widths: dict) -> None:
  """The group's batch widths ({"max_nnz": ..., "max_labels": ...}) on one member's batcher."""
  for attr, width in widths.items():
    setattr(batcher, attr, width)


def _keyed(member_step):
  """The member step with its key folded with the state's step (a run's step keys)."""
  def step_one(state, batch, key, lr_scale):
    return member_step(state, batch, jax.random.fold_in(key, state.step), lr_scale)
  return step_one


@functools.lru_cache(maxsize=8)  # per member step: groups of one step share its compiled programs
def _serial_programs(member_step):
  """(one step, k steps as a scan over batches stacked on a leading axis), jitted, donating the state."""
  step_one = _keyed(member_step)

  def steps(state, batches, key, lr_scale):  # batches: (k, ...) per array, k steps in order
    return jax.lax.scan(lambda s, b: step_one(s, b, key, lr_scale), state, batches)

  return jax.jit(step_one, donate_argnums=(0,)), jax.jit(steps, donate_argnums=(0,))


def advance_together(groups, until: int, stop=None) -> bool:
  """Advances every group in `groups` to step `until` (each to at most its train.num_steps) as
  `CandidateGroup.advance` does, their dispatches taken in turn: one group's members may then train
  on some devices while another's train on the others (`slots`), where one group at a time would
  leave devices idle. A member's computation does not depend on the order. `stop()` is asked after
  every dispatch; returns False when it ended the advance, else True.

  Training seconds: the span less the compilations, evaluations and checkpoints in it; each group
  counts the whole span (its `seconds["train"]`, steps per second while sharing the devices), each
  member an equal share of it among the members alive at the start."""
  t_start = time.perf_counter()
  aside_before = sum(g._seconds_aside() for g in groups)
  alive_at_start = [(g, list(g.alive)) for g in groups if g._training(until)]
  compile_seconds, stopped = 0.0, False
  active = [g for g, _ in alive_at_start]
  while active and not stopped:
    for g in active:
      compile_seconds += g._advance_chunk(until)
      stopped = stop is not None and stop()
      if stopped:
        break
    active = [g for g in active if g._training(until)]
  for g in groups:
    if g.alive:
      g._block()
  # steps dispatch asynchronously: the training time is the span less what was timed apart in it
  span = (time.perf_counter() - t_start - compile_seconds
          - (sum(g._seconds_aside() for g in groups) - aside_before))
  members = sum(len(names) for _, names in alive_at_start)
  for g, names in alive_at_start:
    g.seconds["train"] += span
    for name in names:
      g.member_seconds[name] += span / members
  return not stopped


class CandidateGroup:
  """Members [(name, config, workdir)] of one `group_key`, trained as one program.

  mode: "vmap" -- the members' states stacked, one vmapped step for all; "serial" -- each member
  its own state, the one compiled step called for each in turn (no stacking, nothing recompiles
  when members leave); None: `default_mode()`.
  steps_per_call: serial mode, k > 1: while k steps remain before the next evaluation, checkpoint
  or stop, each member's k steps are one dispatch, a `lax.scan` of its step over k batches (the
  host's per-step work -- dispatch, batch transfer and gather -- paid once per k steps); the
  other steps one by one. The chunks follow from the step and those events alone, so a resumed
  group cuts the same chunks as an uninterrupted one.
  slots: serial mode, a list of meshes (`member_slots`: one CPU device each) the members are dealt
  over in turn, member i on slots[(first_slot + i) % len(slots)], each with its own task and
  compiled step on its slot; their programs run at once, one per device (on CPU, one per core).
  `redeal` deals the members still training again (after others stopped). None: every member on
  `mesh`. A member computes the same on any one-device slot as on a one-device `mesh`.
  min_widths: {"max_nnz", "max_labels"}, the least the members' training batches are padded to
  (`recipe.split_batch_widths`: groups of the recipe's other splits get the shapes of split 0's).
  Their evaluations keep each member's own widths."""

  def __init__(self, members, mesh, mode: str | None = None, steps_per_call: int = 1, slots=None,
               first_slot: int = 0, min_widths: dict | None = None):
    keys = {group_key(c) for _, c, _ in members}
    if None in keys or len(keys) != 1:
      raise ConfigError("recipe", "a candidate group's members must differ only in "
                        f"{list(GROUPED_FIELDS)} and train a classification task with a validation split")
    self.mode = mode or default_mode()
    if self.mode not in MODES:
      raise ConfigError("recipe.group_mode", f"{self.mode!r} is not one of {list(MODES)}")
    t0 = time.perf_counter()
    self.mesh = mesh
    self.names = [n for n, _, _ in members]
    self.configs = {n: c for n, c, _ in members}
    self.workdirs = {n: workdir_path(w) for n, _, w in members}
    slots = list(slots) if slots and self.mode == "serial" else [mesh]
    self._slots = slots
    self._slot = {n: (first_slot + i) % len(slots) for i, n in enumerate(self.names)}
    self.tasks = {n: build_task(c, slots[self._slot[n]]) for n, c, _ in members}
    # "auto" batch widths (dataset.max_nnz / max_labels = 0) follow each member's training part: pad
    # every member's batches to the widest (and to min_widths), so all members' batches have one
    # shape (-1 / zero padding, which no loss reads).
    batchers = [self.tasks[n].batches.batcher for n in self.names]
    self._widths = {attr: max([getattr(b, attr) for b in batchers] + [(min_widths or {}).get(attr, 0)])
                    for attr in ("max_nnz", "max_labels")}
    for b in batchers:
      _set_widths(b, self._widths)
    # Members with the same seed and dataset section (the learning-rate variants of one validation
    # split) read the same batches: each such batch is built once, by the first one's pipeline (the
    # others' pipelines are never started), and fed to all of them.
    first_of = {}
    self._feed = {n: first_of.setdefault((int(self.configs[n].seed),
                                          self.configs[n].dataset.to_json_best_effort(sort_keys=True)), n)
                  for n in self.names}
    # The feeders' pipelines, kept when a member moves to another slot (`_move`: a new task there).
    self._feeders = {n: self.tasks[n].batches for n in set(self._feed.values())}
    first = self.tasks[self.names[0]]
    if first.member_step is None:
      raise ConfigError("mining.num_samples_schedule", "a growing sample size trains alone")
    config = self.configs[self.names[0]]
    self.num_steps, self.eval_every = config.train.num_steps, config.train.eval_every
    self.batch_size = config.train.batch_size
    self.select_metric = config.eval.select_metric
    # The selection metric at each validation point of each member's best state, kept when it is a
    # mean over points (`metrics.per_point_metric`): the recipe's paired test of "clearly behind"
    # (`snm_jax.train.recipes.candidates.clearly_behind`) reads it.
    try:
      metrics.per_point_metric(self.select_metric)
      self._per_point = self.select_metric
    except ValueError:
      self._per_point = None
    self.best_points = {}               # name -> (num validation points,) at its selected state
    self.member_shardings = jax.tree.map(lambda x: x.sharding, first.state)
    self.progress = {n: Progress() for n in self.names}
    self.best = {}                      # name -> its selected state (device)
    self.alive = list(self.names)
    self.step = 0
    self.seconds = {"build": 0.0, "compile": 0.0, "train": 0.0, "evaluate": 0.0, "checkpoint": 0.0}
    self.member_seconds = {n: 0.0 for n in self.names}  # each member's share of the training time
    self.records = {}  # name -> what the member left: results.json, {"diverged"} or {"eliminated"}
    self.t_start = t0
    self._key = {n: jax.random.key(self.configs[n].seed + 1) for n in self.names}
    self._lr = {n: np.float32(self.configs[n].table.learning_rate) for n in self.names}

    if self.mode == "vmap":
      self._vstep = jax.jit(jax.vmap(_keyed(first.member_step)), donate_argnums=(0,))
      # The members' global batches stacked on a leading axis, placed as make_stacked_global_batch's.
      self._stack = jax.jit(lambda bs: jax.tree.map(lambda *x: jnp.stack(x), *bs),
                            out_shardings=jax.NamedSharding(mesh, jax.P(None, DATA)))
      self._take = jax.jit(lambda s, i: jax.tree.map(lambda x: x[i], s),
                           out_shardings=self.member_shardings)
      self._restack([self.tasks[n].state for n in self.names])
    else:
      # One program pair for every member on every slot: a member's learning rate and key are
      # inputs, and the member step names no device (`classification.build`), so it is traced and
      # lowered once; each slot it runs on compiles it once (`_compiled`).
      self._programs = _serial_programs(first.member_step)
      self.states = {n: self.tasks[n].state for n in self.names}
      self._compiled = set()  # the (slot, steps per call) whose program is compiled
    self.steps_per_call = steps_per_call if self.mode == "serial" else 1
    self._checkpointers = {}
    self._in_flight = InFlight()
    self.checkpoint_every = config.train.checkpoint_every
    self._resume()
    self.start_step = self.step
    if is_writer():  # each member's config.json: what a rerun compares before reusing or resuming it
      for name in self.names:
        write_text(self.workdirs[name] / "config.json",
                   json.dumps(json.loads(self.configs[name].to_json_best_effort()), indent=2))
    self.seconds["build"] = time.perf_counter() - t0

  # ---- the members' states ------------------------------------------------------------------
  def _restack(self, states):
    shardings = jax.tree.map(_stacked_sharding, self.member_shardings)
    self.state = jax.jit(lambda *s: jax.tree.map(lambda *x: jnp.stack(x), *s),
                         out_shardings=shardings)(*states)
    self._keys = jnp.stack([self._key[n] for n in self.alive])
    self._lrs = jnp.asarray([self._lr[n] for n in self.alive])
    self._compiled = set()  # a new member count: the vmapped step compiles again

  def _member_state(self, name):
    if self.mode == "vmap":
      return self._take(self.state, self.alive.index(name))
    return self.states[name]

  def _block(self) -> None:
    jax.block_until_ready(self.state if self.mode == "vmap" else self.states)

  def _next_local_batches(self, k: int) -> dict:
    """{feeding member: its pipeline's next k batches (this process's slices)}, for the members
    alive; members reading the same batches share their feeder's."""
    fed = {}
    for n in self.alive:
      if self._feed[n] not in fed:
        batcher = self._feeders[self._feed[n]].batcher
        fed[self._feed[n]] = [next(batcher) for _ in range(k)]
    return fed

  def _placed(self, fed: dict, place) -> dict:
    """{(feeding member, slot): `place(that slot's batches, its feeder's local batches)`}: each
    batch placed once on each slot a member reading it trains on, by the first such member's
    task (members of one feeder hold the same data)."""
    out = {}
    for name in self.alive:
      key = (self._feed[name], self._slot[name])
      if key not in out:
        out[key] = place(self.tasks[name].batches, fed[self._feed[name]])
    return out

  def _serial_dispatch(self, k: int) -> float:
    """k steps of every member alive (serial mode), one dispatch each (k > 1: its k batches stacked
    on a leading axis and its step scanned over them). A program's first use on a slot is compiled
    ahead (`lower(...).compile()`, its seconds returned), then dispatched like the others: the
    devices keep the work already queued meanwhile, and no step's run counts as compilation."""
    fed = self._next_local_batches(k)
    if k == 1:
      on_device = self._placed({src: b[0] for src, b in fed.items()}, lambda b, local: b.to_global(local))
    else:
      on_device = self._placed(fed, lambda b, local: b.to_global_stacked(local))
    program = self._programs[0 if k == 1 else 1]
    compile_seconds = 0.0
    for name in self.alive:  # independent programs: each member's step counts against the bound
      args = (self.states[name], on_device[(self._feed[name], self._slot[name])], self._key[name],
              self._lr[name])
      if (self._slot[name], k) not in self._compiled:
        t0 = time.perf_counter()
        program.lower(*args).compile()  # (cached: the call below runs it)
        compile_seconds += time.perf_counter() - t0
        self._compiled.add((self._slot[name], k))
      self.states[name], metrics = program(*args)
      self._in_flight.add(metrics)
    return compile_seconds

  def _chunk(self, until: int) -> int:
    """How many steps the next dispatch trains: steps_per_call while that many remain before the
    next evaluation, checkpoint or `until`, else 1."""
    k = self.steps_per_call
    if k <= 1:
      return 1
    nxt = min(until, self.num_steps)
    if self.eval_every > 0:
      nxt = min(nxt, (self.step // self.eval_every + 1) * self.eval_every)
    if self.checkpoint_every > 0:
      nxt = min(nxt, (self.step // self.checkpoint_every + 1) * self.checkpoint_every)
    return k if nxt - self.step >= k else 1

  def _vmap_step(self) -> None:
    """One step of every member alive (vmap mode): their batches stacked, one vmapped dispatch."""
    fed = {src: batches[0] for src, batches in self._next_local_batches(1).items()}
    if any("row" in b for b in fed.values()):  # rows gathered on the devices, then stacked there
      on_device = {src: self.tasks[src].batches.to_global(b) for src, b in fed.items()}
      batch = self._stack([on_device[self._feed[n]] for n in self.alive])
    else:
      batch = make_stacked_global_batch([fed[self._feed[n]] for n in self.alive], self.mesh,
                                        self.batch_size)
    self.state, metrics = self._vstep(self.state, batch, self._keys, self._lrs)
    self._in_flight.add(metrics)

  # ---- training ---------------------------------------------------------------------------
  def advance(self, until: int, stop=None) -> bool:
    """Trains the members still alive up to step `until` (at most train.num_steps), evaluating
    validation every train.eval_every steps and checkpointing every train.checkpoint_every; a
    member out of `train.patience` or diverged stops. `stop()`, asked after every dispatch (a
    preemption notice), ends it early: returns False then, else True."""
    return advance_together([self], until, stop)

  def _until(self, until: int) -> int:
    return min(until, self.num_steps)

  def _training(self, until: int) -> bool:
    return bool(self.alive) and self.step < self._until(until)

  def _advance_chunk(self, until: int) -> float:
    """One dispatch of the members alive (`_chunk` steps each), then the evaluation and the
    checkpoint due at the step reached. Returns the seconds spent compiling: serial mode, the
    programs compiled ahead of their first use (`_serial_dispatch`); vmap mode, the vmapped
    step's first call (after a (re)stack), timed apart: it runs to completion before the next."""
    k = self._chunk(self._until(until))
    compile_seconds = 0.0
    if self.mode == "serial":
      compile_seconds = self._serial_dispatch(k)
    elif (0, 1) not in self._compiled:
      t0 = time.perf_counter()
      self._vmap_step()
      self._block()
      compile_seconds = time.perf_counter() - t0
      self._compiled.add((0, 1))
    else:
      self._vmap_step()
    self.seconds["compile"] += compile_seconds
    self.step += k
    if itstime(self.step, self.eval_every, self.num_steps):
      self._evaluate()
    if self.checkpoint_every > 0 and self.step % self.checkpoint_every == 0 and self.step < self.num_steps:
      self.checkpoint()  # (a member at train.num_steps finishes instead)
    return compile_seconds

  def _seconds_aside(self) -> float:
    return self.seconds["evaluate"] + self.seconds["checkpoint"]

  def _evaluate(self) -> None:
    self._block()  # (the steps' time, counted as training by `advance`)
    t0 = time.perf_counter()
    stopped = []
    for name in list(self.alive):
      config, state = self.configs[name], self._member_state(name)
      _, why = loop.nonfinite_verdict(state, config)
      if why is not None:
        self._diverged(name, f"{why} in candidate group member {name}")
        stopped.append(name)
        continue
      if self._per_point is None:
        val, points = self.tasks[name].evaluators["validation"](state), None
      else:
        val, points = self.tasks[name].evaluators["validation"](state, per_point=self._per_point)
      value = loop.selection_value(config, val)
      progress = self.progress[name]
      progress.history.append({"step": self.step, "time": time.time(),  # wall clock, for time-to-quality
                               "train_seconds": self.member_seconds[name],
                               **{f"val/{k}": v for k, v in val.items() if isinstance(v, float)}})
      if progress.record_selection(self.step, value):
        # serial: the state's buffers are donated to the next step, so the best one is a copy
        self.best[name] = state if self.mode == "vmap" else jax.tree.map(jnp.copy, state)
        if points is not None:
          self.best_points[name] = points
      if progress.out_of_patience(config.train.patience):
        progress.stopped_early = True
        stopped.append(name)
        self._finish_member(name)
    if stopped:
      self._keep([n for n in self.alive if n not in stopped])
    self.seconds["evaluate"] += time.perf_counter() - t0

  def best_value(self, name) -> float | None:
    """The member's best validation `eval.select_metric` so far (None before any evaluation)."""
    return self.progress[name].best_value

  # ---- members leaving --------------------------------------------------------------------
  def _keep(self, names) -> None:
    if names == self.alive:
      return
    feeding = {self._feed[n] for n in names}
    for source in {self._feed[n] for n in self.alive} - feeding:  # pipelines no member reads any more
      self._feeders[source].close()  # (their threads; the others' pipelines never started)
    if self.mode == "serial":
      self.states = {n: self.states[n] for n in names}
      self.alive = list(names)
      return
    states = [self._member_state(n) for n in names]
    self.alive = list(names)
    if names:
      self._restack(states)
    else:
      self.state = None

  def drop(self, names, reason: dict) -> None:
    """Stops the named members (successive halving): each leaves `eliminated.json` with `reason`
    and its validation record (and config.json), and is not evaluated on test."""
    for name in names:
      record = {**reason, "step": self.step, "best_value": self.best_value(name),
                "best_step": self.progress[name].best_step, "select_metric": self.select_metric}
      self._leave(name, "eliminated.json", record, {"eliminated": record})
    self._keep([n for n in self.alive if n not in names])

  def redeal(self, first_slot: int = 0) -> int:
    """Serial mode with slots: the members still training dealt over the slots again, so the ones
    a rung kept do not crowd one device: the m members take slots (first_slot + i) % len(slots),
    i < m, those already on one of these slots staying there, the others moving (`_move`).
    Returns m."""
    if self.mode == "serial" and len(self._slots) > 1:
      free = [(first_slot + i) % len(self._slots) for i in range(len(self.alive))]
      movers = []
      for name in self.alive:
        if self._slot[name] in free:
          free.remove(self._slot[name])
        else:
          movers.append(name)
      for name, slot in zip(movers, free):
        self._move(name, slot)
    return len(self.alive)

  def _move(self, name, slot: int) -> None:
    """Member `name` onto slot `slot`: a task of its config built there (its batches as wide as the
    group's), its state and selected state copied there (the group's programs run on any slot). Its
    pipeline, if it feeds members, stays where it is (`_feeders`): the batches are host arrays."""
    t0 = time.perf_counter()
    task = build_task(self.configs[name], self._slots[slot])
    _set_widths(task.batches.batcher, self._widths)
    shardings = jax.tree.map(lambda x: x.sharding, task.state)
    for leaf in jax.tree.leaves(task.state):  # (the new task's initial state: only its shardings count)
      leaf.delete()
    task.state = None
    self.states[name] = jax.device_put(self.states[name], shardings)
    if name in self.best:
      self.best[name] = jax.device_put(self.best[name], shardings)
    self.tasks[name], self._slot[name] = task, slot
    self.seconds["build"] += time.perf_counter() - t0
    logging.info("[candidates] %s moved to %s", name, self._slots[slot].devices.flat[0])

  def _diverged(self, name, message: str) -> None:
    logging.warning("[candidate %s] diverged, left out: %s", name, message)
    self._leave(name, "diverged.json", {"diverged": message}, {"diverged": message})

  def _leave(self, name, marker: str, content: dict, record: dict) -> None:
    """A member stopped without a result: `marker` in its workdir (next to the config.json written
    at build, which a rerun compares: `recipes.candidates.finished`), its record in `records`."""
    self.best.pop(name, None)
    self.records[name] = record
    if is_writer():
      write_text(self.workdirs[name] / marker, json.dumps(content, indent=2, sort_keys=True))

  def finish(self, stop=None) -> bool:
    """Trains the members still alive to train.num_steps and finishes each (`_finish_member`);
    False when `stop()` ended the training first (see `advance`): nothing is finished then."""
    if not self.advance(self.num_steps, stop):
      return False
    for name in list(self.alive):
      self._finish_member(name)
    self._keep([])
    return True

  # ---- checkpoints ------------------------------------------------------------------------
  def _checkpointer(self, name) -> Checkpointer:
    if name not in self._checkpointers:
      self._checkpointers[name] = Checkpointer(self.workdirs[name] / "checkpoints",
                                               keep=self.configs[name].train.keep_checkpoints)
    return self._checkpointers[name]

  def checkpoint(self) -> None:
    """Saves, for every member still training, at the current step (unless saved there already):
    its state and its selected state so far (`{"state", "best"}`), and as JSON its data
    position, progress record (its training seconds included) and validation points."""
    if self.step == 0:
      return
    t0 = time.perf_counter()
    for name in self.alive:
      ckpt = self._checkpointer(name)
      if ckpt.latest_step() == self.step:
        continue
      state = self._member_state(name)
      points = self.best_points.get(name)
      ckpt.save(self.step, {"state": state, "best": self.best.get(name, state)}, {
          "iterator": self._feeders[self._feed[name]].get_state(),
          "progress": {**self.progress[name].to_json(), "train_seconds": self.member_seconds[name]},
          "best_points": None if points is None else {"dtype": np.asarray(points).dtype.str,
                                                      "values": np.asarray(points).tolist()}})
    self.seconds["checkpoint"] += time.perf_counter() - t0

  def wait(self) -> None:
    """Until every checkpoint save in flight is committed."""
    for ckpt in self._checkpointers.values():
      ckpt.wait()

  def close(self) -> None:
    for ckpt in self._checkpointers.values():
      ckpt.close()
    self._checkpointers.clear()

  def _resume(self) -> None:
    """Restores every member from the newest step all of them checkpointed; checkpoints newer than
    it (saved by only some members, or unreadable) are deleted. None in common: from step 0."""
    saved = {n: saved_steps(self.workdirs[n] / "checkpoints") for n in self.names}
    if not any(saved.values()):
      return
    for name in self.names:  # a workdir's checkpoints are resumed only by a compatible config
      if saved[name]:
        loop.check_saved_config(self.configs[name], self.workdirs[name])
    common = sorted(set.intersection(*(set(v) for v in saved.values())), reverse=True)
    step, restored = 0, None
    for candidate in common:
      try:
        restored = {n: self._checkpointer(n).restore(candidate, abstract_like(
            {"state": self.tasks[n].state, "best": self.tasks[n].state})) for n in self.names}
        step = candidate
        break
      except Exception as e:  # pylint: disable=broad-except  # (orbax raises many types)
        logging.warning("candidate group: the members' checkpoints of step %d are not all readable "
                        "(%s: %s); trying an older one", candidate, type(e).__name__, str(e)[:300])
    if restored is None:
      logging.warning("candidate group %s: no step that every member checkpointed is readable "
                      "(saved: %s); the group trains from step 0", self.names, saved)
    for name in self.names:
      if saved[name]:
        self._checkpointer(name).delete_after(step)
    if restored is None:
      return
    for name, (pair, data) in restored.items():
      progress = Progress.from_json(data["progress"])
      self.progress[name] = progress
      self.member_seconds[name] = progress.train_seconds
      if progress.best_step >= 0:
        self.best[name] = pair["best"]
      if data.get("best_points") is not None:
        self.best_points[name] = np.asarray(data["best_points"]["values"],
                                            np.dtype(data["best_points"]["dtype"]))
      if self._feed[name] == name:
        self._feeders[name].set_state(data["iterator"])
      if self.mode == "serial":
        self.states[name] = pair["state"]
    if self.mode == "vmap":
      self._restack([restored[n][0]["state"] for n in self.alive])
    self.step = step
    logging.info("candidate group %s resumed from step %d", self.names, step)

  def _finish_member(self, name) -> None:
    """Test metrics of the member's selected state (and of its last), its selected state in
    `<workdir>/best`, config.json and results.json, as `train_and_evaluate` leaves them."""
    config, workdir, task = self.configs[name], self.workdirs[name], self.tasks[name]
    progress, last_state = self.progress[name], self._member_state(name)
    if name not in self.best:  # no finite validation value was ever recorded
      self._diverged(name, f"no validation {self.select_metric} to select on (NaN) in member {name}")
      return
    t0 = time.perf_counter()
    best = self.best.pop(name)
    final = task.evaluators["test"](best)
    last = final if progress.best_step == self.step else task.evaluators["test"](last_state)
    best_ckpt = Checkpointer(workdir / "best", keep=1)
    try:
      best_ckpt.delete_after(-1)  # a selection left by an interrupted earlier attempt
      best_ckpt.save(progress.best_step, best, {"metric": self.select_metric, "value": progress.best_value})
    finally:
      best_ckpt.close()
    self.seconds["evaluate"] += time.perf_counter() - t0
    train_seconds = self.member_seconds[name]
    # Start-up, compilation and steps per second are the group's: its build (data, states,
    # evaluators), its compilations, and its steps after them (each advancing every member alive).
    results = run_results(
        info=task.info, steps=self.step, train_seconds=train_seconds,
        wall_seconds=time.perf_counter() - self.t_start,
        nonfinite_steps=int(to_host(last_state.nonfinite_steps)),
        truncation=self._feeders[self._feed[name]].stats,  # (the pipeline whose batches it read)
        final=final, selected=selection_record(progress, self.step, self.select_metric, last),
        history=progress.history, mesh=self._slots[self._slot[name]], startup_seconds=self.seconds["build"],
        compile_seconds=self.seconds["compile"],
        steady_steps_per_second=((self.step - self.start_step) / self.seconds["train"]
                                 if self.seconds["train"] > 0 else None),
        state=last_state if config.train.fingerprint else None,
        group={"members": self.names, "mode": self.mode, "devices": len(self._slots),
               "seconds": dict(self.seconds)})
    self.records[name] = results
    if is_writer():
      write_text(workdir / "results.json", json.dumps(results, indent=2, sort_keys=True))

