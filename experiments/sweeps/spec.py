"""What a sweep is: a base config, a list of named override points, and seeds.

Every other module in this folder defines `get_sweep() -> Sweep`; this one
holds the data types and the helpers that load a sweep file and apply
dotted overrides ("mining.k") to a locked ConfigDict. `experiments.ablate`
runs a sweep, `experiments.report` reads what it wrote.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from snm_jax.train.config.overrides import apply_overrides  # noqa: F401  (re-exported: sweeps apply them)
from snm_jax.train.runtime.workpath import workdir_path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=+-]*$")
REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Point:
  """One setting of the sweep: `overrides` ({"mining.k": 16}) on the base config.

  `name` is the run's sub-directory (letters, digits, `_.=+-`); `label` the
  name in tables and legends (defaults to `name`).
  """
  name: str
  overrides: dict[str, Any]
  label: str = ""

  def __post_init__(self):
    if not _NAME.match(self.name):
      raise ValueError(f"point name {self.name!r}: use letters, digits and _.=+- only")
    if not self.label:
      object.__setattr__(self, "label", self.name)


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A list of points x seeds, each a full `train_and_evaluate` run.

  Attributes:
    title: heading of the report.
    config: default base config "path[:arg]" (ablate's --config replaces it).
    points: the settings, in table order.
    seeds: run seeds; seed s sets every field of `seed_fields` to s.
    base_overrides: applied to every point before its own overrides (the
      sweep's scaling of steps, B, ... to what runs locally).
    seed_fields: config fields that take the seed; adding e.g.
      "dataset.synthetic.seed" also redraws the data of each seed.
    baseline: name of the point every metric is divided by (Table-2 ratios).
    curve_metric: the metric of the learning curves.
    table_metrics: columns of the metric and ratio tables.
    class_accuracy: also report Head / Tail accuracy (recall@1 of the Head+Torso
      and of the Tail test points: single-label data such as the digits).
    notes: markdown paragraph for the report (set-up, what is scaled down).
  """
  title: str
  config: str
  points: tuple[Point, ...]
  seeds: tuple[int, ...] = (0,)
  base_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
  seed_fields: tuple[str, ...] = ("seed",)
  baseline: str | None = None
  curve_metric: str = "P@1"
  table_metrics: tuple[str, ...] = ("P@1", "P@3", "P@5", "R@1", "R@5", "nDCG@5", "PSP@5")
  class_accuracy: bool = False
  notes: str = ""
  name: str = ""  # Set by load_sweep: the file's stem[:arg].

  def __post_init__(self):
    names = [p.name for p in self.points]
    if len(set(names)) != len(names):
      raise ValueError(f"sweep {self.title!r}: duplicate point names {names}")
    if self.baseline is not None and self.baseline not in names:
      raise ValueError(f"sweep {self.title!r}: baseline {self.baseline!r} is not a point ({names})")
    if not self.seeds:
      raise ValueError(f"sweep {self.title!r}: needs at least one seed")

  def run_overrides(self, point: Point, seed: int) -> dict[str, Any]:
    """Every override of one run, in the order they are applied."""
    return {**self.base_overrides, **point.overrides, **{f: seed for f in self.seed_fields}}

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["points"] = [dataclasses.asdict(p) for p in self.points]
    return d

  @classmethod
  def from_json(cls, d: dict) -> "Sweep":
    d = dict(d)
    d["points"] = tuple(Point(**p) for p in d["points"])
    for key in ("seeds", "seed_fields", "table_metrics"):
      d[key] = tuple(d[key])
    return cls(**d)


def merge_sweeps(old: Sweep, new: Sweep) -> Sweep:
  """One sweep run piecewise (`experiments.ablate --only/--seeds` calls, or an archive and the runs
  added to it): `old`'s points in their order, then `new`'s others; a point of both as `new` has it;
  the union of the seeds; `new`'s baseline, else `old`'s unless `new` has that point without it."""
  mine, theirs = {p.name for p in new.points}, {p.name for p in old.points}
  by_name = {**{p.name: p for p in old.points}, **{p.name: p for p in new.points}}
  order = [p.name for p in old.points] + [p.name for p in new.points if p.name not in theirs]
  return dataclasses.replace(
      new, points=tuple(by_name[n] for n in order), seeds=tuple(sorted(set(old.seeds) | set(new.seeds))),
      baseline=new.baseline or (old.baseline if old.baseline not in mine else None))


# ---- blocks the sweep files share

# The committed sweeps scored raw cosines (logit scale 1), measured before the configs' default
# became 8 (common.configure_dataset); pinned so their numbers stay reproducible.
RAW_COSINES = {"loss.logit_scale": 1.0}
NEGATIVE_SAMPLING = {"mining.vartheta": "negative_sampling"}  # vartheta_j = 1/B: the Table 2 baseline


def schedule(num_steps: int, eval_every: int, checkpoint_every: int) -> dict[str, int]:
  """A sweep's run length and cadences as overrides."""
  return {"train.num_steps": num_steps, "train.eval_every": eval_every,
          "train.checkpoint_every": checkpoint_every}


def top_k_points(ks, label: str = "SNM top-{k}") -> tuple[Point, ...]:
  """Point `k<k>` ({"mining.k": k}) for each k, labelled `label.format(k=k)`."""
  return tuple(Point(f"k{k}", {"mining.k": k}, label.format(k=k)) for k in ks)


def negative_sampling_point(label: str = "negative sampling") -> Point:
  """The negative sampling baseline, point `ns`."""
  return Point("ns", dict(NEGATIVE_SAMPLING), label)


def k_prime_points(ks, label) -> tuple[Point, ...]:
  """Point `kprime<k>` ({"loss.k_prime": k}) for each k', labelled `label(k)`."""
  return tuple(Point(f"kprime{k}", {"loss.k_prime": k}, label(k)) for k in ks)


# ---- loading

def _import_file(path: str, what: str):
  file = Path(path)
  if not file.is_absolute() and not file.exists():
    file = REPO / path
  if not file.is_file():
    raise FileNotFoundError(f"{what} file {path!r} not found")
  spec = importlib.util.spec_from_file_location(f"_{what}_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_sweep(path: str) -> Sweep:
  """experiments/sweeps/<name>.py[:arg] -> its Sweep, named after the file."""
  file, _, arg = path.partition(":")
  module = _import_file(file, "sweep")
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"{file} defines no get_sweep()")
  sweep = module.get_sweep(arg) if arg else module.get_sweep()
  return dataclasses.replace(sweep, name=sweep.name or Path(file).stem + (f":{arg}" if arg else ""))


def load_config(config_arg: str):
  """'experiments/configs/x.py[:arg]' -> get_config(arg) (locked ConfigDict)."""
  file, _, arg = config_arg.partition(":")
  return _import_file(file, "config").get_config(arg)


ARCHIVE = "archive.json"


def read_archive(root) -> tuple[Sweep | None, dict]:
  """(the archived sweep or None, {point: {seed: results}}) from root/archive.json.

  A sweep can span machines: its runs' results outlive their run directories in the report's
  summary.json (committed with the report). Copied into a new workdir as archive.json, its runs
  count as finished there: `experiments.ablate` skips them (after checking that the sweep still
  gives them the same overrides) and the reports read them, while a run directory of the same
  (point, seed) takes precedence. Run directories never write this file: deleting a run's folder
  re-runs it unless the archive names it.
  """
  path = workdir_path(root) / ARCHIVE
  if not path.exists():
    return None, {}
  s = json.loads(path.read_text())
  return Sweep.from_json(s["sweep"]), summary_runs(s, "runs")


def summary_runs(summary: dict, key: str) -> dict:
  """{point: {seed: value}} of a report summary's `key` ("runs" or "failed"; JSON keys are strings)."""
  return {p: {int(k): v for k, v in seeds.items()} for p, seeds in summary.get(key, {}).items()}
