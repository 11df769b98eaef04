"""Training a recipe's candidates: finished ones reused, the rest together, the clearly worse ones
stopped early.

Every (candidate, validation split) pair is a *member* with its own workdir
(`<split dir>/candidates/<name>`). A member that finished earlier (results.json, diverged.json or
eliminated.json) is read back. The others are trained in candidate groups (`recipe.group`): the
members of one shape -- same config but for the table learning rate, seed and validation split --
as one vmapped program (`snm_jax.train.trainer.group`), one compilation and one dispatch per step
for all of them. Members no group can take (`group.group_key` is None) train one by one.

Successive halving (Jamieson & Talwalkar, AISTATS 2016), `recipe.halving` = eta > 1: at the rungs
train.num_steps / eta^j (j = recipe.rungs .. 1) every group is advanced to the rung, the candidates
still training are ranked by their best validation `eval.select_metric` so far (the mean over
their splits), and only the best ceil(n / eta) -- at least `recipe.ensemble`, so the ensemble step
keeps its choice -- go on; the others stop (eliminated.json) and are never evaluated on test.
With `recipe.drop_behind_z` = z > 0, a rung also stops every candidate that is clearly behind the
leader (`clearly_behind`: a paired z-test on the validation points), even below recipe.ensemble.

Interruptions: the groups checkpoint their members every `train.checkpoint_every` steps, and on a
preemption notice (`train.preemption_signals`, as a run) every group checkpoints its members at
the step it reached and `Preempted` is raised (experiments.train: exit status 75). A rerun reuses
the finished members, resumes each group from its members' newest common checkpoint and replays
the rungs: the same values give the same decisions, so it ends as an uninterrupted recipe.
"""

from __future__ import annotations

import contextlib
import json
import math

import numpy as np
from absl import logging

from snm_jax.errors import NonFiniteLossError
from snm_jax.train.recipes import reuse
from snm_jax.train.trainer import checkpointing
from snm_jax.train.runtime.host import is_writer, workdir_lock
from snm_jax.train.runtime.preemption import Preempted, PreemptionWatch
from snm_jax.train.runtime.workpath import write_text
from snm_jax.train.trainer import group as group_lib
from snm_jax.train.trainer import loop


def rung_steps(num_steps: int, eta: int, rungs: int, eval_every: int = 1) -> list[int]:
  """The steps at which successive halving ranks the candidates: num_steps / eta^j for
  j = rungs .. 1, each rounded to a multiple of `eval_every` (a rung ranks what the evaluation
  at it measured, not an older one), ascending, distinct, >= eval_every and < num_steps (none when
  eta <= 1)."""
  if eta <= 1:
    return []
  every = max(eval_every, 1)
  steps = {max(int(round(num_steps / eta ** j / every)), 1) * every for j in range(rungs, 0, -1)}
  return sorted(s for s in steps if s < num_steps)


def keep_count(num_candidates: int, eta: int, keep_at_least: int) -> int:
  """How many of `num_candidates` go on past a rung: ceil(n / eta), at least `keep_at_least`."""
  return min(num_candidates, max(math.ceil(num_candidates / eta), keep_at_least))


def survivors(values: dict[str, float], keep: int) -> list[str]:
  """The best `keep` candidates by `values` (higher is better; ties: the earlier candidate), in
  the order of `values`."""
  names = list(values)
  order = sorted(range(len(names)), key=lambda i: (-values[names[i]], i))[:keep]
  return [names[i] for i in sorted(order)]


def clearly_behind(points: dict[str, dict], values: dict[str, float], z: float) -> dict[str, float]:
  """The candidates clearly behind the leader, each with its z.

  points: candidate -> {validation split: its selection metric at each validation point of the
  split, at its best state so far}; values: candidate -> its best value (the mean over its
  splits), whose largest is the leader (ties: the earlier). A candidate is behind when the mean
  of the paired differences d_i = leader_i - candidate_i over the points of the splits both have
  exceeds z standard errors (std(d) / sqrt(n)): the points are shared, so the noise of the
  validation sample largely cancels in d, and what remains is measured rather than assumed."""
  names = [n for n in values if n in points]
  if len(names) < 2:
    return {}
  leader = max(names, key=lambda n: (values[n], -names.index(n)))
  out = {}
  for name in names:
    common = sorted(set(points[name]) & set(points[leader]))
    if name == leader or not common:
      continue
    d = np.concatenate([np.asarray(points[leader][s], np.float64) - points[name][s] for s in common])
    if d.size < 2:
      continue
    se = float(np.std(d, ddof=1)) / math.sqrt(d.size)
    mean = float(np.mean(d))
    score = math.inf if se == 0 and mean > 0 else (mean / se if se > 0 else 0.0)
    if score > z:
      out[name] = score
  return out


def finished(config, workdir) -> dict | None:
  """What a finished member left: {"diverged": ...}, {"eliminated": record} or its results.json
  (reused as `reuse.run_or_load` reuses runs); None when it has not finished."""
  for marker, key in (("diverged.json", None), ("eliminated.json", "eliminated")):
    path = workdir / marker
    if path.exists():
      if (workdir / "config.json").exists():  # a marker of other settings is not reused
        checkpointing.check_finished_config(json.loads((workdir / "config.json").read_text()),
                                            json.loads(config.to_json_best_effort()), workdir)
      record = json.loads(path.read_text())
      logging.info("[candidate %s] %s earlier (%s)", workdir.name, marker.split(".")[0], path)
      return record if key is None else {key: record}
  if (workdir / "results.json").exists():
    return reuse.run_or_load(workdir, lambda: None, f"candidate {workdir.name}", log=logging.info,
                             config=config)
  return None


def train_alone(config, workdir) -> dict:
  """One member as a plain run; a non-finite loss (`train.on_nonfinite`) leaves diverged.json
  and returns {"diverged": message} instead of stopping the recipe."""
  try:
    return loop.train_and_evaluate(config, workdir)
  except NonFiniteLossError as e:
    logging.warning("[candidate %s] diverged, left out: %s", workdir.name, e)
    out = {"diverged": str(e)}
    if is_writer():
      write_text(workdir / "diverged.json", json.dumps(out))
    return out


def train(recipe_config, members, mesh, slots=None, min_widths=None) -> dict:
  """Trains (or reads back) every member [(candidate, split, config, workdir)];
  returns {(candidate, split): results.json, {"diverged": ...} or {"eliminated": record}}.
  slots: the one-device meshes a serial group deals its members over (`member_devices`).
  min_widths: {"max_nnz", "max_labels"} the groups pad their batches to at least
  (`recipe.split_batch_widths`)."""
  out, pending = {}, []
  for name, split, config, workdir in members:
    done = finished(config, workdir)
    if done is None:
      pending.append((name, split, config, workdir))
    else:
      out[(name, split)] = done
  groups: dict[str, list] = {}
  for member in pending:
    key = group_lib.group_key(member[2]) if recipe_config.recipe.get("group", True) else None
    if key is None:
      logging.info("[candidate %s] training -> %s", member[0], member[3])
      out[(member[0], member[1])] = train_alone(member[2], member[3])
    else:
      groups.setdefault(key, []).append(member)
  if not groups:
    return out
  # Each member's workdir is locked while its group trains, as `train_and_evaluate` locks a run's.
  with contextlib.ExitStack() as stack:
    for member in (m for ms in groups.values() for m in ms):
      stack.enter_context(workdir_lock(member[3]))
    built = []
    for group_members, g in build_groups(recipe_config, groups.values(), mesh, slots, min_widths):
      stack.callback(g.close)  # (commits the checkpoint saves in flight, on errors too)
      built.append((group_members, g))
    watch = stack.enter_context(PreemptionWatch(recipe_config.train.get("preemption_signals", "SIGTERM")))
    _train_groups(recipe_config, members, built, out, watch.reached, side_by_side=bool(slots))
  return out


def build_groups(recipe_config, groups, mesh, slots=None, min_widths=None):
  """Yields (members, CandidateGroup) for each list of members [(candidate, split, config,
  workdir)] in `groups`, built as `recipe_config` asks (recipe.group_mode, recipe.steps_per_call).
  With `slots`, the members are dealt over them in turn across the groups (which then train side by
  side: `group.advance_together`), each group starting where the previous one ended."""
  mode = recipe_config.recipe.get("group_mode", "auto")
  dealt = 0
  for group_members in groups:
    logging.info("[candidates] training %d as one program: %s", len(group_members),
                 sorted({f"{n} (split {s})" for n, s, _, _ in group_members}))
    yield group_members, group_lib.CandidateGroup(
        [(f"{n}@{s}", c, w) for n, s, c, w in group_members], mesh, None if mode == "auto" else mode,
        steps_per_call=recipe_config.recipe.get("steps_per_call", 1), slots=slots, first_slot=dealt,
        min_widths=min_widths)
    dealt += len(group_members)


def _preempted(built, where) -> None:
  """A preemption notice: every group checkpoints its members where it stands; raises Preempted."""
  for _, g in built:
    g.checkpoint()
  for _, g in built:
    g.wait()
  step = max(g.step for _, g in built)
  logging.warning("preempted: every candidate group checkpointed its members (the furthest at step %d)", step)
  raise Preempted(step, where)


def _advance(groups, until: int, stop, side_by_side: bool) -> bool:
  """Every group to step `until`: side by side (`group.advance_together`: their members on
  several devices) or one group after the other (on one device, where nothing would overlap and
  each group's training seconds stay its own). False when `stop()` ended it."""
  if side_by_side:
    return group_lib.advance_together(groups, until, stop)
  return all(g.advance(until, stop) for g in groups)  # (all() stops at the first False)


def _train_groups(recipe_config, members, built, out: dict, stop, side_by_side: bool = False) -> None:
  """Advances the groups `built` [(members, CandidateGroup)] rung by rung, halving at each, then
  finishes them; their members' records go into `out`."""
  where = built[0][1].workdirs[built[0][1].names[0]].parent
  eta = int(recipe_config.recipe.get("halving", 0))
  ensemble = int(recipe_config.recipe.get("ensemble", 1))
  keep_at_least = max(ensemble, 1) if ensemble > 0 else len(members)
  candidates = list(dict.fromkeys(m[0] for m in members))
  _, longest = max(((g.num_steps, g) for _, g in built), key=lambda x: x[0])
  # A group resumed from a checkpoint past a rung was saved after that rung was ranked (every group
  # reaches a rung before it is ranked, and none trains past it before): its members' values now
  # are not the rung's, and its decisions stand (the members it stopped left eliminated.json).
  ranked_before = max(g.start_step for _, g in built)
  groups = [g for _, g in built]
  for rung in rung_steps(longest.num_steps, eta, int(recipe_config.recipe.get("rungs", 1)), longest.eval_every):
    if not _advance(groups, rung, stop, side_by_side):
      _preempted(built, where)
    records = {**out, **{(n, s): g.records[f"{n}@{s}"] for ms, g in built for n, s, _, _ in ms
                         if f"{n}@{s}" in g.records}}
    _stop_diverged_siblings(built, records)
    if rung < ranked_before:
      continue
    values, done_elsewhere = {}, 0
    for name in candidates:
      mine = [(s, g) for ms, g in built for n, s, _, _ in ms if n == name and f"{n}@{s}" in g.alive]
      if mine and all(g.best_value(f"{name}@{s}") is not None for s, g in mine) and not any(
          (name, s) in records for ms, _ in built for n, s, _, _ in ms if n == name):
        values[name] = float(np.mean([g.best_value(f"{name}@{s}") for s, g in mine]))
      elif any("diverged" not in r and r.get("eliminated", {}).get("rung_step", rung + 1) > rung
               for (n, _), r in records.items() if n == name):
        done_elsewhere += 1  # passed this rung in an earlier attempt (finished, or stopped later)
    # An earlier, interrupted attempt already ranked this rung: the candidates it let through count
    # among the kept, those it stopped here among the ranked, so a rerun keeps the same ones.
    stopped_here = {n for (n, _), r in records.items()
                    if r.get("eliminated", {}).get("rung_step") == rung}
    keep = keep_count(len(values) + done_elsewhere + len(stopped_here), eta, keep_at_least) - done_elsewhere
    keep_names = set(survivors(values, max(keep, 0)))
    dropped = [n for n in values if n not in keep_names]
    if dropped:
      logging.info("[candidates] successive halving at step %d: %d of %d go on (%s); stopped: %s",
                   rung, len(keep_names), len(values), sorted(keep_names), dropped)
    reasons = {n: {"rule": f"successive halving, eta={eta}", "rung_step": rung, "kept": sorted(keep_names),
                   "candidates_ranked": len(values), "candidate_value": values[n]} for n in dropped}
    z = float(recipe_config.recipe.get("drop_behind_z", 0.0))
    if z > 0:
      points = {n: {s: g.best_points[f"{n}@{s}"] for ms, g in built for m, s, _, _ in ms
                    if m == n and f"{m}@{s}" in g.best_points} for n in keep_names}
      behind = clearly_behind(points, {n: values[n] for n in values if n in keep_names}, z)
      if behind:
        logging.info("[candidates] at step %d, clearly behind the leader (paired z > %g): %s", rung, z,
                     {n: round(v, 2) for n, v in behind.items()})
      for n, score in behind.items():
        reasons[n] = {"rule": f"clearly behind the leader: paired z = {score:.2f} > recipe.drop_behind_z = {z:g}",
                      "rung_step": rung, "kept": sorted(set(keep_names) - set(behind)),
                      "candidates_ranked": len(values), "candidate_value": values[n], "z": score}
    for n, reason in reasons.items():
      for group_members, g in built:
        g.drop([f"{m}@{s}" for m, s, _, _ in group_members if m == n and f"{m}@{s}" in g.alive], reason)
    dealt = 0  # the members the rung kept dealt over the devices again, in turn across the groups
    for _, g in built:
      dealt += g.redeal(dealt)
  if not _advance(groups, longest.num_steps, stop, side_by_side):
    _preempted(built, where)
  for group_members, g in built:
    if not g.finish(stop):  # (trained to its train.num_steps above: its members finish)
      _preempted(built, where)
    for n, s, _, _ in group_members:
      out[(n, s)] = g.records[f"{n}@{s}"]


def _stop_diverged_siblings(built, records) -> None:
  """A candidate with a diverged split is left out of the choice: its other splits stop now."""
  bad = {n for (n, _), r in records.items() if "diverged" in r}
  for group_members, g in built:
    names = [f"{n}@{s}" for n, s, _, _ in group_members if n in bad and f"{n}@{s}" in g.alive]
    if names:
      g.drop(names, {"rule": "another validation split of this candidate diverged"})
