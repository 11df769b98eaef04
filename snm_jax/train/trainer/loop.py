"""`train_and_evaluate(config, workdir)`: one loop for every method, resumable from `workdir`.

Sections: task (data, model, step and state: `snm_jax.train.trainer.tasks.build_task`)
-> checkpoint restore -> loop (step, log, eval and model selection,
checkpoint) -> final evaluation of the selected state -> results.json.
What a method needs beyond a train step, a state, batches and evaluators lives
in its task module, not here.
"""

from __future__ import annotations

import contextlib
import json
import time

import jax
from absl import logging

from snm_jax import sharding
from snm_jax.errors import ConfigError, NonFiniteLossError
from snm_jax.train.config import validation
from snm_jax.train.trainer.checkpointing import Checkpointer, abstract_like, check_resume_config, saved_steps
from snm_jax.train.trainer.results import run_results, selection_record
from snm_jax.train.runtime.host import itstime, workdir_lock
from snm_jax.train.runtime.inflight import InFlight
from snm_jax.train.runtime.preemption import Preempted, PreemptionWatch
from snm_jax.train.runtime.progress import Progress
from snm_jax.train.trainer.tasks import build_task
from snm_jax.train.runtime.workpath import workdir_path
from snm_jax.train.runtime.writers import MetricWriter


def train_and_evaluate(config, workdir, *, return_state: bool = False):
  """Trains, evaluates and writes config.json, metrics.jsonl, results.json (process 0).

  With a validation split (`dataset.validation_fraction` > 0) every evaluation
  also scores it, the state with the best `eval.select_metric` on it is kept
  in `workdir/best`, training stops after `train.patience` evaluations without
  improvement (if > 0), and `results["final"]` is the test evaluation of that
  selected state; without one it is the last state's.

  Before anything runs: every config field is validated (ConfigError), the
  workdir is locked for the whole run (WorkdirInUseError if another run holds
  it; released at the end, on errors too), and a workdir with checkpoints is
  resumed only by a config whose shape- and trajectory-changing fields equal
  its saved config.json (`checkpointing.check_resume_config`).

  `workdir`: local or any URI etils.epath reads (gs://..., `snm_jax/train/runtime/workpath.py`).
  Returns the results dict, or (results, last train state) if `return_state`."""
  t_start = time.time()
  validation.validate(config)  # every field the data is not needed for, before any loading
  workdir = workdir_path(workdir)  # local: absolute; a URI (gs://...): as it is
  with workdir_lock(workdir), contextlib.ExitStack() as cleanup:
    check_saved_config(config, workdir)

    # ---- task: data, model, sampler, step, state (method-specific) ------------
    mesh = sharding.make_mesh(config.mesh.shape)
    sharding.check_divisible("train.batch_size", config.train.batch_size, mesh, sharding.DATA)
    task = build_task(config, mesh)
    state, batches = task.state, task.batches
    cleanup.callback(getattr(batches, "close", lambda: None))  # the input pipeline's threads, workers
    selecting = "validation" in task.evaluators

    # ---- writers, checkpoints, restore ------------------------------------------
    writer, ckpt, best_ckpt = _open_run_files(config, workdir, cleanup, selecting)
    restored_step, state, progress = _restore(config, ckpt, state, batches)
    # Whatever an earlier attempt logged or selected after the starting step (0 when it was killed
    # before its first checkpoint or every checkpoint was unreadable) is redone by this run.
    writer.truncate_after(restored_step)
    if best_ckpt is not None:
      best_ckpt.delete_after(restored_step)
    writer.write_json("config.json", json.loads(config.to_json_best_effort()))
    evaluate = _selecting_evaluate(config, task.evaluators, progress, best_ckpt)

    # ---- loop ------------------------------------------------------------------
    t_loop, first_step_seconds = time.time(), None
    base_key = jax.random.key(config.seed + 1)
    num_steps = config.train.num_steps
    step = int(jax.device_get(state.step))
    t_segment, eval_seconds_segment = time.perf_counter(), 0.0
    last_eval = None  # (step, every metric) of the newest evaluation of this process
    writer.progress(step, {})

    def train_seconds() -> float:  # all restarts, evaluations excluded
      return progress.train_seconds + time.perf_counter() - t_segment - eval_seconds_segment

    def save_checkpoint():  # every metrics row up to this step is stored before the checkpoint of it
      _check_finite(state, config, ckpt)
      writer.sync()
      ckpt.save(step, state, {"iterator": batches.get_state(),
                              "progress": {**progress.to_json(), "train_seconds": train_seconds()}})
    in_flight = InFlight()
    preemption = cleanup.enter_context(PreemptionWatch(config.train.get("preemption_signals", "SIGTERM")))
    while step < num_steps and not progress.stopped_early:
      state, metrics_dev = task.train_step(state, next(batches), jax.random.fold_in(base_key, step))
      in_flight.add(metrics_dev)
      step += 1
      if step == restored_step + 1:
        jax.block_until_ready(metrics_dev)
        first_step_seconds = time.perf_counter() - t_segment
        logging.info("first step compiled and run in %.1fs", first_step_seconds)
      if itstime(step, config.train.log_every, num_steps):
        scalars = writer.progress(step, {k: float(v) for k, v in jax.device_get(metrics_dev).items()})
        scalars["nonfinite_steps"] = _check_finite(state, config, ckpt)
        scalars["train_seconds"] = train_seconds()
        writer.write_scalars(step, scalars, time.time() - t_start)
      if itstime(step, config.train.eval_every, num_steps):
        jax.block_until_ready(state)
        trained_so_far, t_eval = train_seconds(), time.perf_counter()
        eval_out = evaluate(state, step)
        last_eval = (step, eval_out)
        eval_seconds_segment += time.perf_counter() - t_eval
        floats = {k: v for k, v in eval_out.items() if isinstance(v, float)}
        writer.write_scalars(step, {f"eval/{k}": v for k, v in floats.items()}, time.time() - t_start)
        progress.history.append({"step": step, "train_seconds": trained_so_far, **floats})
        logging.info("eval @%d: %s", step, {k: round(v, 4) for k, v in floats.items()})
        if selecting and progress.out_of_patience(config.train.patience):
          progress.stopped_early = True
          logging.info("early stop at step %d: %d evaluations without a better validation %s "
                       "(best %.4f at step %d)", step, progress.evals_since_best,
                       config.eval.select_metric, progress.best_value, progress.best_step)
      if task.diagnostics is not None and itstime(step, config.diagnostics.every, num_steps):
        t_diag = time.perf_counter()
        diag = task.diagnostics(state, step)
        eval_seconds_segment += time.perf_counter() - t_diag  # not training time either
        writer.write_scalars(step, {f"diag/{k}": v for k, v in diag.items()}, time.time() - t_start)
      if config.train.checkpoint_every >= 0 and (
          itstime(step, config.train.checkpoint_every, num_steps) or progress.stopped_early):
        save_checkpoint()
      if preemption.reached():  # after the step every process agreed on: save, then stop
        _stop_preempted(step, ckpt, save_checkpoint)
    jax.block_until_ready(state)
    segment_seconds = train_seconds() - progress.train_seconds
    progress.train_seconds = train_seconds()
    ckpt.wait()

    # ---- final evaluation: the selected state on test ---------------------------
    last = last_eval[1] if last_eval is not None and last_eval[0] == step else None
    final, selected = _final_evaluation(state, step, last, evaluate, task.evaluators["test"], best_ckpt,
                                        progress, config.eval.select_metric)
    steady = segment_seconds - (first_step_seconds or 0.0)
    segment_steps = step - restored_step
    results = run_results(
        info=task.info, steps=step, train_seconds=progress.train_seconds,
        wall_seconds=time.time() - t_start, nonfinite_steps=_check_finite(state, config, ckpt),
        truncation=batches.stats, final=final, selected=selected, history=progress.history, mesh=mesh,
        startup_seconds=t_loop - t_start, compile_seconds=first_step_seconds,
        steady_steps_per_second=(segment_steps - 1) / steady if segment_steps > 1 and steady > 0 else None,
        state=state if config.train.fingerprint else None)
    writer.write_json("results.json", results)
  return (results, state) if return_state else results


def _open_run_files(config, workdir, cleanup: contextlib.ExitStack, selecting: bool):
  """(metric writer, checkpointer, best-state checkpointer or None), each closed by `cleanup`."""
  writer = MetricWriter(workdir, config.train.num_steps, config.train.batch_size)
  cleanup.callback(writer.close)
  ckpt = Checkpointer(workdir / "checkpoints", keep=config.train.keep_checkpoints)
  cleanup.callback(ckpt.close)  # an error still commits (or waits for) the in-flight save
  best_ckpt = Checkpointer(workdir / "best", keep=1) if selecting else None
  if best_ckpt is not None:
    cleanup.callback(best_ckpt.close)
  return writer, ckpt, best_ckpt


def _stop_preempted(step: int, ckpt: Checkpointer, save_checkpoint) -> None:
  """Checkpoints `step` (unless its periodic checkpoint was just saved), waits for the commit and
  raises Preempted (experiments.train: exit status 75)."""
  if ckpt.latest_step() != step:
    save_checkpoint()
  ckpt.wait()
  logging.warning("preempted at step %d: checkpoint saved in %s", step, ckpt.directory)
  raise Preempted(step, ckpt.directory)


def _restore(config, ckpt: Checkpointer, state, batches):
  """(step restored from or 0, state, progress record); `batches` is set to the checkpoint's
  position. A checkpoint whose iterator position or progress record is invalid is unreadable too."""

  def accept(step, restored_state, data_state):
    del step, restored_state
    Progress.from_json(data_state.get("progress"))
    batches.set_state(data_state["iterator"])

  restored = ckpt.restore_latest(abstract_like(state), accept=accept,
                                 on_unreadable=config.train.get("on_unreadable_checkpoints", "restart"))
  if restored is None:
    return 0, state, Progress()
  step, state, data_state = restored
  logging.info("resumed from step %d", step)
  return step, state, Progress.from_json(data_state.get("progress"))


def _selecting_evaluate(config, evaluators: dict, progress: Progress, best_ckpt):
  """`evaluate(state, step)`: test (and validation, as `val/...`) metrics of `state`; with a
  validation split it records the selection and saves a new best state in `best_ckpt`."""
  select_metric = config.eval.select_metric

  def evaluate(state, step) -> dict:
    out = evaluators["test"](state)
    if "validation" in evaluators:
      val = evaluators["validation"](state)
      value = selection_value(config, val)
      out.update({f"val/{k}": v for k, v in val.items()})
      if progress.record_selection(step, value):
        best_ckpt.save(step, state, {"metric": select_metric, "value": value})
    return out

  return evaluate


def selection_value(config, val: dict) -> float:
  """`eval.select_metric` of validation metrics `val` (ConfigError when it is not one of them)."""
  select_metric = config.eval.select_metric
  if select_metric not in val:
    raise ConfigError("eval.select_metric", f"{select_metric!r} is not one of the evaluated "
                      f"metrics {sorted(k for k, v in val.items() if isinstance(v, float))}")
  return val[select_metric]


def nonfinite_verdict(state, config) -> tuple[int, str | None]:
  """(non-finite steps so far, why the run must stop or None): it stops under
  train.on_nonfinite="stop", or under "skip" once more than train.max_skipped_steps were skipped."""
  bad = int(jax.device_get(state.nonfinite_steps))
  max_skipped = config.train.get("max_skipped_steps", 10)
  stop = config.train.on_nonfinite == "stop"
  if not bad or not (stop or bad > max_skipped):
    return bad, None
  first = int(jax.device_get(state.first_nonfinite_step))
  why = ("train.on_nonfinite='stop'" if stop else
         f"{bad} steps skipped so far, more than train.max_skipped_steps={max_skipped}")
  return bad, f"non-finite loss or gradient at step {first} of {config.train.num_steps} ({why})"


def _check_finite(state, config, ckpt: Checkpointer) -> int:
  """The number of non-finite steps so far; raises NonFiniteLossError when `nonfinite_verdict`
  says stop (after the in-flight save, of a finite state, is committed)."""
  bad, why = nonfinite_verdict(state, config)
  if why is not None:
    ckpt.wait()
    latest = ckpt.latest_step()
    kept = (f"the last good checkpoint (step {latest}) in {ckpt.directory} is kept"
            if latest is not None else f"no checkpoint was saved yet in {ckpt.directory}")
    raise NonFiniteLossError(f"{why}; {kept}; the run stops without saving")
  return bad


def check_saved_config(config, workdir) -> None:
  """A workdir with checkpoints may be resumed only by a compatible config (before restoring)."""
  ckpt_dir = workdir / "checkpoints"
  saved = workdir / "config.json"
  if not (saved.is_file() and saved_steps(ckpt_dir)):
    return
  try:
    saved_config = json.loads(saved.read_text())
  except (OSError, ValueError) as e:
    logging.warning("cannot read %s (%s): the resumed config is not compared with it", saved, e)
    return
  check_resume_config(saved_config, json.loads(config.to_json_best_effort()), workdir)


def _final_evaluation(state, step, last_eval, evaluate, evaluate_test, best_ckpt, progress,
                      select_metric):
  """(test metrics of the selected state, the selection record).

  Without a validation split the selected state is the last one. With one, the
  last state is evaluated (if the loop did not just do it) so it is a
  candidate too, and the best validation state is restored from `best_ckpt`
  and evaluated on test.
  """
  if last_eval is None:
    last_eval = evaluate(state, step)
  last_test = {k: v for k, v in last_eval.items() if not k.startswith("val/")}
  if best_ckpt is None:
    return last_test, {"step": step, "metric": None, "value": None}
  selected = selection_record(progress, step, select_metric, last_test)
  if progress.best_step == step:
    return last_test, selected
  best_ckpt.wait()
  _, best_state, _ = best_ckpt.restore_latest(abstract_like(state), on_unreadable="fail")
  return evaluate_test(best_state), selected
