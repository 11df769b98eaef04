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
"""

from __future__ import annotations

import json
import math

import numpy as np
from absl import logging

from snm_jax.errors import NonFiniteLossError
from snm_jax.train.recipes import reuse
from snm_jax.train.runtime.host import is_writer
from snm_jax.train.runtime.workpath import write_text
from snm_jax.train.trainer import group as group_lib
from snm_jax.train.trainer import loop


def rung_steps(num_steps: int, eta: int, rungs: int) -> list[int]:
  """The steps at which successive halving ranks the candidates: num_steps / eta^j for
  j = rungs .. 1, rounded, ascending, each >= 1 and < num_steps (none when eta <= 1)."""
  if eta <= 1:
    return []
  steps = {max(int(round(num_steps / eta ** j)), 1) for j in range(rungs, 0, -1)}
  return sorted(s for s in steps if s < num_steps)


def survivors(values: dict[str, float], eta: int, keep_at_least: int) -> list[str]:
  """The candidates that go on past a rung: the best ceil(n / eta) by `values` (higher is better;
  ties: the earlier candidate), at least `keep_at_least`, in the order of `values`."""
  names = list(values)
  keep = min(len(names), max(math.ceil(len(names) / eta), keep_at_least))
  order = sorted(range(len(names)), key=lambda i: (-values[names[i]], i))[:keep]
  return [names[i] for i in sorted(order)]


def finished(config, workdir) -> dict | None:
  """What a finished member left: {"diverged": ...}, {"eliminated": record} or its results.json
  (reused as `reuse.run_or_load` reuses runs); None when it has not finished."""
  for marker, key in (("diverged.json", None), ("eliminated.json", "eliminated")):
    path = workdir / marker
    if path.exists():
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


def train(recipe_config, members, mesh) -> dict:
  """Trains (or reads back) every member [(candidate, split, config, workdir)];
  returns {(candidate, split): results.json, {"diverged": ...} or {"eliminated": record}}."""
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
  built = []
  for group_members in groups.values():
    logging.info("[candidates] training %d as one program: %s", len(group_members),
                 sorted({f"{n} (split {s})" for n, s, _, _ in group_members}))
    mode = recipe_config.recipe.get("group_mode", "auto")
    built.append((group_members, group_lib.CandidateGroup(
        [(f"{n}@{s}", c, w) for n, s, c, w in group_members], mesh, None if mode == "auto" else mode)))
  eta = int(recipe_config.recipe.get("halving", 0))
  ensemble = int(recipe_config.recipe.get("ensemble", 1))
  keep_at_least = max(ensemble, 1) if ensemble > 0 else len(members)
  num_steps = max(g.num_steps for _, g in built)
  for rung in rung_steps(num_steps, eta, int(recipe_config.recipe.get("rungs", 1))):
    for _, g in built:
      g.advance(rung)
    values = {}
    for group_members, g in built:
      for n, s, _, _ in group_members:
        if f"{n}@{s}" in g.alive:
          values.setdefault(n, []).append(g.best_value(f"{n}@{s}"))
    # a candidate with a member that stopped (diverged, out of patience) is not ranked here
    splits_of = {n: sum(1 for m in members if m[0] == n and (m[0], m[1]) not in out) for n in values}
    ranked = {n: float(np.mean(v)) for n, v in values.items()
              if len(v) == splits_of[n] and all(x is not None for x in v)}
    keep = set(survivors(ranked, eta, keep_at_least))
    dropped = [n for n in ranked if n not in keep]
    if dropped:
      logging.info("[candidates] successive halving at step %d: %d of %d go on (%s); stopped: %s",
                   rung, len(keep), len(ranked), sorted(keep), dropped)
    for n in dropped:
      reason = {"rule": f"successive halving, eta={eta}", "rung_step": rung, "kept": sorted(keep),
                "candidates_ranked": len(ranked), "candidate_value": ranked[n]}
      for group_members, g in built:
        g.drop([f"{m}@{s}" for m, s, _, _ in group_members if m == n and f"{m}@{s}" in g.alive], reason)
  for group_members, g in built:
    g.finish()
    for n, s, config, workdir in group_members:
      out[(n, s)] = finished(config, workdir)
  return out
