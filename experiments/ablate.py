r"""Runs a sweep: every point x seed is one full, resumable training run.

  python -m experiments.ablate --sweep=experiments/sweeps/table2_bibtex.py --workdir=/tmp/t2
  python -m experiments.ablate --config=experiments/configs/snm.py:delicious \
      --sweep=experiments/sweeps/table2_delicious.py --workdir=/tmp/t2d --seeds=3
  python -m experiments.ablate --sweep=... --workdir=/tmp/t2 --print_commands | parallel -j 8
  python -m experiments.report /tmp/t2

Run r of point p with seed s lives in WORKDIR/<p>/seed<s>/ (checkpoints,
metrics.jsonl, results.json). A run whose results.json exists is skipped; an
interrupted one resumes from its last checkpoint (the training loop does
this by itself), so repeating the command finishes the sweep. A run that
fails (e.g. a non-finite loss) writes failed.json and is skipped next time
unless --retry_failed. WORKDIR/sweep.json records the sweep for the report.
A sweep can span machines: a report's summary.json (e.g. the committed
results/large_k/1e5/summary.json) copied into a new WORKDIR as archive.json
marks its runs finished ("archived": skipped here, read by the reports), once
the sweep is checked to give them the same overrides.
Runs that fit Bamler & Mandt's tree share the fits through WORKDIR/tree_cache
(`snm_jax.adversarial.cache`: keyed by the fit's inputs, so the tree points of
one seed, and a resumed run, load the identical tree instead of refitting it).

--print_commands prints, for every unfinished run, the equivalent
`python -m experiments.train ...` command line (its config overrides as
--config.<field>=<value>) and trains nothing, so a launch script can run the
lines as independent jobs; the report reads their results the same way.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import shlex
import sys
import time

from absl import app, flags, logging
from etils import epath

from experiments import compile_cache_flag
from experiments.sweeps.spec import (ARCHIVE, Point, Sweep, apply_overrides, load_config, load_sweep, merge_sweeps,
                                     read_archive)
from snm_jax.errors import ConfigError, SnmJaxError
from snm_jax.train.runtime.workpath import workdir_path, write_text

_CONFIG = flags.DEFINE_string("config", None, "Base config path[:arg]; default: the sweep's own.")
_SWEEP = flags.DEFINE_string("sweep", None, "experiments/sweeps/<name>.py[:arg].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Root of the sweep's run directories (local or "
                               "any URI etils.epath reads, e.g. gs://bucket/sweep).")
_SEEDS = flags.DEFINE_integer("seeds", None, "Use seeds 0..N-1 instead of the sweep's list.")
_ONLY = flags.DEFINE_list("only", None, "Run only these point names.")
_SET = flags.DEFINE_multi_string("set", [], "Extra override for every run, field=value "
                                 "(value parsed as a Python literal when possible).")
_PRINT = flags.DEFINE_bool("print_commands", False, "Print one experiments.train command per "
                           "unfinished run and exit.")
_RETRY = flags.DEFINE_bool("retry_failed", False, "Retry runs that left failed.json.")
_CLEAN = flags.DEFINE_bool("clean_checkpoints", False, "Delete a run's checkpoints once it finished.")
_TREE_CACHE = flags.DEFINE_string("tree_cache", "default", "Folder of fitted adversarial trees shared by "
                                  "the runs (snm_jax.adversarial.cache; 'default': WORKDIR/tree_cache; "
                                  "'none': off).")


def run_dir(workdir, point: Point, seed: int) -> epath.Path:
  return workdir_path(workdir) / point.name / f"seed{seed}"


def parse_set(items) -> dict:
  """['train.num_steps=300', 'loss.phi=logistic'] -> {'train.num_steps': 300, ...}."""
  out = {}
  for item in items:
    key, sep, raw = item.partition("=")
    if not sep:
      raise app.UsageError(f"--set {item!r}: expected field=value")
    try:
      out[key] = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      out[key] = raw
  return out


def resolve(sweep: Sweep, config_arg: str | None = None, seeds: int | None = None,
            extra: dict | None = None, only=None) -> Sweep:
  """The sweep as it will run: --config, --seeds, --set and --only folded in."""
  points = sweep.points
  if only:
    unknown = set(only) - {p.name for p in points}
    if unknown:
      raise app.UsageError(f"--only: no points named {sorted(unknown)}")
    points = tuple(p for p in points if p.name in only)
  baseline = sweep.baseline if sweep.baseline in {p.name for p in points} else None
  return dataclasses.replace(
      sweep, config=config_arg or sweep.config, points=points, baseline=baseline,
      seeds=tuple(range(seeds)) if seeds else sweep.seeds,
      base_overrides={**sweep.base_overrides, **(extra or {})})


def run_config(sweep: Sweep, point: Point, seed: int, base=None):
  """The locked ConfigDict of one run (errors name the offending field).

  `base`: the sweep's base config, loaded once so that every run of a long
  sweep sees the same config code even if the files change meanwhile.
  """
  config = copy.deepcopy(base) if base is not None else load_config(sweep.config)
  # The config stays locked: an override of an unknown field fails.
  return apply_overrides(config, sweep.run_overrides(point, seed))


def _flag_value(value) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (tuple, list)):
    return "(" + ",".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def train_command(sweep: Sweep, point: Point, seed: int, workdir, tree_cache=None) -> str:
  """The `python -m experiments.train` line equivalent to one run of the sweep (sharing the
  `tree_cache` folder when the run fits an adversarial tree)."""
  args = ["python", "-m", "experiments.train", f"--config={sweep.config}",
          f"--workdir={run_dir(workdir, point, seed)}"]
  if tree_cache is not None and run_config(sweep, point, seed).mining.sampler == "tree":
    args.append(f"--tree_cache={tree_cache}")
  args += [f"--config.{k}={_flag_value(v)}" for k, v in sweep.run_overrides(point, seed).items()]
  return " ".join(shlex.quote(a) for a in args)


def run_status(rundir: epath.Path, archived: dict | None = None) -> str:
  """"done", "failed", "archived" (no run directory, its results in WORKDIR/archive.json:
  `archived_runs`) or "todo"."""
  if (rundir / "results.json").exists():
    return "done"
  if (rundir / "failed.json").exists():
    return "failed"
  if archived and rundir.name in archived.get(rundir.parent.name, ()):
    return "archived"
  return "todo"


def _normalised(overrides: dict) -> dict:
  return json.loads(json.dumps(overrides, default=str))


def archived_runs(sweep: Sweep, workdir) -> dict:
  """{point: {"seed<s>", ...}} of the sweep's runs held by WORKDIR/archive.json
  (`spec.read_archive`: runs finished on another machine) and without a run directory here.

  Raises ConfigError naming the run and each differing override when the sweep now gives an
  archived run other overrides than the archived sweep did: an edited sweep never silently keeps
  results of the old settings (as `check_finished_runs` for run directories)."""
  old_sweep, runs = read_archive(workdir)
  if old_sweep is None:
    return {}
  old_points = {p.name: p for p in old_sweep.points}
  out = {}
  for point in sweep.points:
    for seed in sweep.seeds:
      if seed not in runs.get(point.name, {}) or run_status(run_dir(workdir, point, seed)) != "todo":
        continue  # not archived, or its run directory takes precedence
      old = _normalised(old_sweep.run_overrides(old_points[point.name], seed))
      new = _normalised(sweep.run_overrides(point, seed))
      diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
      if diff:
        raise ConfigError(diff[0], f"{workdir_path(workdir) / ARCHIVE}: run {point.name}/seed{seed} was "
                          "archived with other overrides: " + "; ".join(
                              f"{k}: {old.get(k, '<unset>')!r} archived, {new.get(k, '<unset>')!r} now"
                              for k in diff))
      out.setdefault(point.name, set()).add(f"seed{seed}")
  return out


def write_sweep_json(sweep: Sweep, workdir) -> None:
  """Records the sweep for the report, keeping points of earlier --only/--seeds calls."""
  path = workdir_path(workdir) / "sweep.json"
  if path.exists():
    old = Sweep.from_json(json.loads(path.read_text()))
    if old.name == sweep.name:
      sweep = merge_sweeps(old, sweep)
  write_text(path, json.dumps(sweep.to_json(), indent=2, default=str))


def run_one(sweep: Sweep, point: Point, seed: int, workdir, clean: bool = False,
            base=None) -> dict:
  """Trains (or resumes) one run; returns its results.json dict or {'error': ...}.

  A bad config raises (the sweep itself is wrong); any other library error
  (e.g. a non-finite loss) is recorded in failed.json and the sweep goes on.
  """
  # JAX is imported only where runs train, so that --print_commands stays instant.
  from snm_jax.train.recipes import runs  # pylint: disable=g-import-not-at-top
  rundir = run_dir(workdir, point, seed)
  config = run_config(sweep, point, seed, base)
  try:
    out = runs.train(config, rundir)
  except ConfigError:
    raise
  except SnmJaxError as e:
    write_text(rundir / "failed.json", json.dumps({"error": type(e).__name__, "message": str(e)}))
    logging.error("run %s/seed%d failed: %s", point.name, seed, e)
    return {"error": str(e)}
  if clean:
    try:
      (rundir / "checkpoints").rmtree(missing_ok=True)
    except OSError as e:  # the run's results are written: a leftover checkpoint is no failure
      logging.warning("could not delete %s: %s", rundir / "checkpoints", e)
  return out


def _tree_cache_dir():
  """--tree_cache as a folder, or None ('none')."""
  value = _TREE_CACHE.value
  if value == "none":
    return None
  return str(workdir_path(_WORKDIR.value) / "tree_cache") if value == "default" else value


def use_compilation_cache(path, min_compile_seconds: float = 0.0) -> tuple:
  """Points JAX's persistent compilation cache at `path` (None: off).

  Runs of one sweep compile the same programs (seeds differ in values only), so
  the second seed of a point skips most of its compilation. Results are
  unaffected: a cache hit loads the executable the compiler would produce.
  Returns the previous (path, min_compile_seconds) so that a caller can restore them.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from snm_jax.train.runtime import compile_cache  # pylint: disable=g-import-not-at-top
  previous = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
  compile_cache.enable("" if path is None else str(path), min_compile_seconds)
  return previous


def check_finished_runs(sweep: Sweep, workdir, base=None) -> None:
  """Raises ConfigError (naming the run and the field) when a finished run's config.json is not
  the config the sweep now gives it (`checkpointing.check_finished_config`): an edited sweep
  never silently keeps results of the old settings. Checked for every run before any trains."""
  from snm_jax.train.trainer import checkpointing  # pylint: disable=g-import-not-at-top
  for point in sweep.points:
    for seed in sweep.seeds:
      rundir = run_dir(workdir, point, seed)
      if run_status(rundir) == "done" and (rundir / "config.json").exists():
        checkpointing.check_finished_config(
            json.loads((rundir / "config.json").read_text()),
            json.loads(run_config(sweep, point, seed, base).to_json_best_effort()), rundir)


def run_sweep(sweep: Sweep, workdir, retry_failed: bool = False, clean: bool = False,
              log=print) -> dict:
  """Runs every unfinished point x seed in order. Returns {status: count}."""
  write_sweep_json(sweep, workdir)
  base = load_config(sweep.config)
  counts = {"skipped": 0, "ran": 0, "failed": 0}
  runs = [(p, s) for p in sweep.points for s in sweep.seeds]
  check_finished_runs(sweep, workdir, base)
  archived = archived_runs(sweep, workdir)
  for i, (point, seed) in enumerate(runs):
    rundir = run_dir(workdir, point, seed)
    status = run_status(rundir, archived)
    if status in ("done", "archived") or (status == "failed" and not retry_failed):
      log(f"[{i + 1}/{len(runs)}] {point.name} seed {seed}: {status}, skipped")
      counts["skipped"] += 1
      continue
    if status == "failed":
      (rundir / "failed.json").unlink()
    log(f"[{i + 1}/{len(runs)}] {point.name} seed {seed} -> {rundir}")
    t0 = time.time()
    out = run_one(sweep, point, seed, workdir, clean, base)
    if "error" in out:
      counts["failed"] += 1
      log(f"    FAILED: {out['error']}")
      continue
    counts["ran"] += 1
    final = out["final"]
    log(f"    {time.time() - t0:.0f} s | {sweep.curve_metric} {final.get(sweep.curve_metric, float('nan')):.4f}"
        f" | R@5 {final.get('R@5', float('nan')):.4f}")
  return counts


def main(argv):
  try:
    _main(argv)
  except ConfigError as e:  # a bad --set / sweep override or field value: one line, exit status 2
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def _main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if not _SWEEP.value or not _WORKDIR.value:
    raise app.UsageError("--sweep and --workdir are required")
  sweep = resolve(load_sweep(_SWEEP.value), _CONFIG.value, _SEEDS.value, parse_set(_SET.value),
                  _ONLY.value)
  for point in sweep.points:  # Fail on a bad override before any training.
    run_config(sweep, point, sweep.seeds[0])
  if _PRINT.value:
    write_sweep_json(sweep, _WORKDIR.value)
    archived = archived_runs(sweep, _WORKDIR.value)
    done = 0
    for point in sweep.points:
      for seed in sweep.seeds:
        if run_status(run_dir(_WORKDIR.value, point, seed), archived) in ("done", "archived"):
          done += 1
        else:
          print(train_command(sweep, point, seed, _WORKDIR.value, _tree_cache_dir()))
    print(f"# {done} finished run(s) omitted", file=sys.stderr)
    return
  from snm_jax.train.runtime import quiet_logs  # pylint: disable=g-import-not-at-top
  quiet_logs.install()
  # The one --compilation_cache flag (experiments/compile_cache_flag.py); a sweep's default is its own
  # folder, WORKDIR/jax_cache, shared by its runs; '' = off.
  cache = compile_cache_flag.COMPILATION_CACHE.value
  if cache != "":
    use_compilation_cache(workdir_path(_WORKDIR.value) / "jax_cache" if cache is None else cache)
  if _tree_cache_dir() is not None:
    from snm_jax.adversarial import cache as tree_cache  # pylint: disable=g-import-not-at-top
    tree_cache.use_tree_cache(_tree_cache_dir())
  counts = run_sweep(sweep, _WORKDIR.value, _RETRY.value, _CLEAN.value)
  print(f"sweep {sweep.name}: {counts}; report: python -m experiments.report {_WORKDIR.value}")


if __name__ == "__main__":
  app.run(main)
