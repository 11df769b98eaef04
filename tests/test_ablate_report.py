"""experiments.ablate and experiments.report: a 2-point x 2-seed sweep end to end
(runs, skip of finished runs, resume from a checkpoint), the printed command
lines, and the report's numbers against the results.json files."""

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from experiments import ablate, report
from experiments.sweeps import spec
from snm_jax.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

SWEEP_FILE = '''
from experiments.sweeps.spec import Point, Sweep

def get_sweep(arg=""):
  return Sweep(
      title="tiny", config="experiments/configs/snm.py:synthetic,runlocal",
      base_overrides={"dataset.synthetic.num_labels": 128, "dataset.synthetic.num_train": 1000,
                      "dataset.synthetic.num_test": 200, "dataset.synthetic.dim": 8,
                      "mining.num_samples": 32, "train.num_steps": 12, "eval.recall_r": 20,
                      "train.eval_every": 6, "train.checkpoint_every": 0, "mesh.shape": (1, 1)},
      points=(Point("k1", {"mining.k": 1}, "SNM top-1"),
              Point("ns", {"mining.vartheta": "negative_sampling"}, "negative sampling")),
      seeds=(0, 1), baseline="ns", curve_metric="R@5")
'''


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("sweepdef") / "tiny.py"
  path.write_text(SWEEP_FILE)
  return path


@pytest.fixture(scope="module")
def finished_sweep(sweep_file, tmp_path_factory):
  """Runs the 2 x 2 sweep once; returns (sweep, workdir, counts)."""
  sweep = ablate.resolve(spec.load_sweep(str(sweep_file)))
  workdir = tmp_path_factory.mktemp("sweep")
  previous = ablate.use_compilation_cache(tmp_path_factory.mktemp("jax_cache"))
  try:
    counts = ablate.run_sweep(sweep, workdir, log=lambda *_: None)
    yield sweep, workdir, counts
  finally:
    ablate.use_compilation_cache(*previous)


def _parse_command(cmd: str):
  """The ConfigDict that `experiments.train` would build from a printed command line."""
  argv = shlex.split(cmd)
  assert argv[:3] == ["python", "-m", "experiments.train"]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                  sys_argv=["train"] + argv[3:])
  flags.DEFINE_string("workdir", None, "", flag_values=fv)
  fv(["train"] + argv[3:])
  return fv.config, fv.workdir


def test_printed_commands_rebuild_the_same_configs(sweep_file, tmp_path):
  sweep = ablate.resolve(spec.load_sweep(str(sweep_file)), seeds=3,
                         extra={"loss.phi": "logistic", "mesh.shape": (1, 1)})
  assert sweep.seeds == (0, 1, 2)
  for point in sweep.points:
    for seed in sweep.seeds:
      config, workdir = _parse_command(ablate.train_command(sweep, point, seed, tmp_path))
      expected = ablate.run_config(sweep, point, seed)
      assert config.to_json() == expected.to_json()
      assert workdir == str(tmp_path / point.name / f"seed{seed}")
      assert config.seed == seed and config.loss.phi == "logistic"
      assert tuple(config.mesh.shape) == (1, 1)


def test_cli_print_commands_lists_unfinished_runs_only(sweep_file, tmp_path):
  (tmp_path / "k1" / "seed1").mkdir(parents=True)
  (tmp_path / "k1" / "seed1" / "results.json").write_text("{}")
  out = subprocess.run(
      [sys.executable, "-m", "experiments.ablate", f"--sweep={sweep_file}",
       f"--workdir={tmp_path}", "--print_commands", "--set=train.num_steps=7"],
      cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
  lines = out.stdout.strip().splitlines()
  assert len(lines) == 3  # 2 points x 2 seeds, one finished
  assert not any("k1/seed1" in l for l in lines)
  assert all("--config.train.num_steps=7" in l for l in lines)
  assert "1 finished run(s) omitted" in out.stderr
  assert json.loads((tmp_path / "sweep.json").read_text())["base_overrides"]["train.num_steps"] == 7


def test_bad_override_names_the_field():
  c = spec.load_config("experiments/configs/snm.py:bibtex,runlocal")
  with pytest.raises(ConfigError, match="mining.kk"):
    spec.apply_overrides(c, {"mining.kk": 3})
  with pytest.raises(ConfigError, match="mining.k"):
    spec.apply_overrides(c, {"mining.k": "many"})
  with pytest.raises(ValueError, match="point name"):
    spec.Point("a b", {})


def test_sweep_runs_skips_and_resumes(finished_sweep):
  sweep, workdir, counts = finished_sweep
  assert counts == {"skipped": 0, "ran": 4, "failed": 0}
  files = sorted(workdir.glob("*/seed*/results.json"))
  assert [f.relative_to(workdir).as_posix() for f in files] == [
      "k1/seed0/results.json", "k1/seed1/results.json", "ns/seed0/results.json",
      "ns/seed1/results.json"]
  mtimes = [f.stat().st_mtime_ns for f in files]
  assert ablate.run_sweep(sweep, workdir, log=lambda *_: None) == {"skipped": 4, "ran": 0, "failed": 0}
  assert [f.stat().st_mtime_ns for f in files] == mtimes
  # An interrupted run (no results.json) resumes from its final checkpoint: same state.
  victim = workdir / "k1" / "seed1" / "results.json"
  before = json.loads(victim.read_text())
  victim.unlink()
  assert ablate.run_sweep(sweep, workdir, log=lambda *_: None)["ran"] == 1
  after = json.loads(victim.read_text())
  assert after["state_fingerprint"] == before["state_fingerprint"]
  assert after["final"]["R@5"] == before["final"]["R@5"]
  # Different seeds are different runs.
  other = json.loads((workdir / "k1" / "seed0" / "results.json").read_text())
  assert other["state_fingerprint"] != after["state_fingerprint"]


def _cell(md: str, section: str, row: str, col: str) -> str:
  """The cell of a markdown table under `## section`."""
  block = md.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
  lines = [l for l in block.splitlines() if l.startswith("|")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  for l in lines[2:]:
    cells = [c.strip() for c in l.strip("|").split("|")]
    if cells[0] == row:
      return cells[header.index(col)]
  raise KeyError(row)


def _mean_std(cell: str):
  m = re.fullmatch(r"([-\d.]+) ± ([-\d.]+)", cell)
  assert m, cell
  return float(m.group(1)), float(m.group(2))


def test_report_numbers_and_figures(finished_sweep, tmp_path):
  _, workdir, _ = finished_sweep
  out = tmp_path / "out"
  md = report.write_report(workdir, out).read_text()
  res = {(p, s): json.loads((workdir / p / f"seed{s}" / "results.json").read_text())
         for p in ("k1", "ns") for s in (0, 1)}
  p1 = np.array([res["k1", s]["final"]["P@1"] for s in (0, 1)])
  m, sd = _mean_std(_cell(md, "Final test metrics", "SNM top-1", "P@1"))
  assert m == pytest.approx(p1.mean(), abs=6e-5) and sd == pytest.approx(p1.std(ddof=1), abs=6e-5)
  ratio = np.array([res["k1", s]["final"]["R@5"] / res["ns", s]["final"]["R@5"] for s in (0, 1)])
  m, sd = _mean_std(_cell(md, "Ratio to negative sampling", "SNM top-1", "R@5"))
  assert m == pytest.approx(ratio.mean(), abs=6e-3) and sd == pytest.approx(ratio.std(ddof=1), abs=6e-3)
  m, _ = _mean_std(_cell(md, "Ratio to negative sampling", "negative sampling", "P@1"))
  assert m == 1.0
  tail10 = np.array([res["ns", s]["final"]["recall@r/tail"][9] for s in (0, 1)])
  section = "Retrieval recall@r per subpopulation"
  block = md.split(f"## {section}\n", 1)[1]
  row = next(l for l in block.splitlines() if l.startswith("| tail | negative sampling |"))
  m, _ = _mean_std(row.strip("|").split("|")[4].strip())  # subpop, point, r=1, r=5, r=10
  assert m == pytest.approx(tail10.mean(), abs=6e-5)
  bayes = np.array([res["k1", s]["final"]["R@5"] / res["k1", s]["final"]["bayes/R@5"] for s in (0, 1)])
  m, _ = _mean_std(_cell(md, "Model vs the Bayes-optimal predictor (synthetic data)", "SNM top-1",
                         "R@5 / Bayes R@5"))
  assert m == pytest.approx(bayes.mean(), abs=6e-4)
  for name in ("learning_curves.png", "recall_curves.png", "ratios.png", "cost_per_step.png"):
    assert f"]({name})" in md
    image = plt.imread(out / name)
    assert image.ndim == 3 and image.shape[0] > 200 and image.std() > 0.01
  # The committed summary alone regenerates the same report.
  again = report.write_report(out, tmp_path / "again").read_text()
  assert again == md


def test_steady_cost_and_class_accuracy_formulas():
  from snm_jax.train.runtime.plots import train_only_curve  # pylint: disable=g-import-not-at-top
  old = {"steps": 300, "seconds_per_step": 1.0, "train_seconds_this_run": 50.0,
         "train_seconds_excludes_eval": False,
         "history": [{"step": 100, "train_seconds": 20.0, "eval_seconds": 4.0, "m": 1.0},
                     {"step": 200, "train_seconds": 36.0, "eval_seconds": 6.0, "m": 2.0}],
         "final": {"m": 3.0}}
  # Clock included evaluations: (50 - 20 - 6) s over the 200 steps after the first one.
  assert report.steady_seconds_per_step(old) == pytest.approx(24.0 / 200)
  steps, secs, vals = train_only_curve(old, "m")
  assert steps == [100, 200, 300] and secs == pytest.approx([16.0, 26.0, 40.0])
  assert vals == [1.0, 2.0, 3.0]
  new = {**old}
  del new["train_seconds_excludes_eval"]  # The current loop: evaluations already left out.
  assert report.steady_seconds_per_step(new) == pytest.approx(30.0 / 200)
  assert train_only_curve(new, "m")[1] == pytest.approx([20.0, 36.0, 50.0])
  final = {"recall@r": [0.6], "recall@r/head": [1.0], "recall@r/torso": [0.5],
           "recall@r/tail": [0.2], "num_pairs/head": 30, "num_pairs/torso": 10}
  assert report.class_accuracy(final) == pytest.approx({"all": 0.6, "head": 0.875, "tail": 0.2})


def test_validation_table_reads_each_seed_at_its_selected_step():
  def run(selected, values):
    return {"selected": {"step": selected},
            "history": [{"step": s, "val/P@1": v, "P@1": 0.0} for s, v in values.items()]}
  runs = {"a": {0: run(20, {10: 0.5, 20: 0.7}), 1: run(10, {10: 0.4, 20: 0.3}),
                2: {"selected": {}, "history": []}}}  # no validation split: no entry
  assert report._validation(runs, "a", "P@1") == [0.7, 0.4]  # pylint: disable=protected-access
  assert report._validation(runs, "a", "R@5") == []  # pylint: disable=protected-access


SHIPPED = ["table2_bibtex.py", "table2_bibtex.py:b16", "table2_bibtex.py:logistic", "table2_delicious.py", "vartheta.py",
           "owl_phi.py", "s2m_table4.py", "s2m_table4.py:synthetic", "digits_s2m.py",
           "num_samples.py", "synthetic_bayes.py", "bf16_rounding.py"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_sweeps_build_valid_configs(name):
  from snm_jax.train.config import validation  # pylint: disable=g-import-not-at-top
  sweep = ablate.resolve(spec.load_sweep(f"experiments/sweeps/{name}"))
  assert len(sweep.points) >= 2 and sweep.seeds
  for point in sweep.points:
    c = ablate.run_config(sweep, point, sweep.seeds[-1])
    for field, value in point.overrides.items():
      section, leaf = field.split(".")
      assert c[section][leaf] == value
    num_labels = {"bibtex": 159, "delicious": 983, "digits_head_tail": 10}.get(
        c.dataset.name, c.dataset.synthetic.num_labels)
    validation.validate(c, num_labels)
    assert c.seed == sweep.seeds[-1]


def test_failed_runs_are_recorded_skipped_and_retried(sweep_file, tmp_path, monkeypatch):
  from snm_jax.errors import NonFiniteLossError  # pylint: disable=g-import-not-at-top
  from snm_jax.train.trainer import loop  # pylint: disable=g-import-not-at-top
  sweep = ablate.resolve(spec.load_sweep(str(sweep_file)), seeds=1, only=["k1"])
  calls = []

  def diverge(config, workdir):
    calls.append(workdir)
    raise NonFiniteLossError("non-finite loss at step 7")

  monkeypatch.setattr(loop, "train_and_evaluate", diverge)
  log = lambda *_: None
  assert ablate.run_sweep(sweep, tmp_path, log=log) == {"skipped": 0, "ran": 0, "failed": 1}
  failed = json.loads((tmp_path / "k1" / "seed0" / "failed.json").read_text())
  assert failed["error"] == "NonFiniteLossError" and "step 7" in failed["message"]
  assert ablate.run_sweep(sweep, tmp_path, log=log) == {"skipped": 1, "ran": 0, "failed": 0}
  assert len(calls) == 1
  assert ablate.run_sweep(sweep, tmp_path, retry_failed=True, log=log)["failed"] == 1
  assert len(calls) == 2

  def bad_config(config, workdir):
    raise ConfigError("mining.k", "k=0 must be in [1, 32]")

  monkeypatch.setattr(loop, "train_and_evaluate", bad_config)
  with pytest.raises(ConfigError):  # A wrong sweep stops, it is not a failed run.
    ablate.run_sweep(sweep, tmp_path / "other", log=log)


def test_sweep_json_keeps_points_of_partial_calls(sweep_file, tmp_path):
  full = ablate.resolve(spec.load_sweep(str(sweep_file)))
  ablate.write_sweep_json(ablate.resolve(full, only=["ns"], seeds=1), tmp_path)
  ablate.write_sweep_json(ablate.resolve(full, only=["k1"], seeds=3), tmp_path)
  merged = spec.Sweep.from_json(json.loads((tmp_path / "sweep.json").read_text()))
  assert [p.name for p in merged.points] == ["ns", "k1"]
  assert merged.seeds == (0, 1, 2) and merged.baseline == "ns"


def test_an_edited_sweep_does_not_reuse_finished_runs(finished_sweep):
  """Every finished run's config.json is checked against the sweep's config for it before any run
  trains: a changed setting is a ConfigError naming the run and the field, a changed log
  interval is not."""
  sweep, workdir, _ = finished_sweep
  ablate.check_finished_runs(sweep, workdir)
  ablate.check_finished_runs(dataclasses.replace(
      sweep, base_overrides={**sweep.base_overrides, "train.log_every": 3}), workdir)
  edited = dataclasses.replace(sweep, base_overrides={**sweep.base_overrides, "mining.num_samples": 16})
  with pytest.raises(ConfigError, match=r"mining\.num_samples: saved 32, now 16: .*k1/seed0"):
    ablate.check_finished_runs(edited, workdir)


def test_a_sweep_spans_machines_through_its_archived_summary(finished_sweep, sweep_file, tmp_path):
  """A new workdir holding only a report's summary.json as archive.json: its runs count as finished
  (skipped, not re-run; omitted from --print_commands), the report reads them next to the new
  machine's runs (a run directory wins over the archive), and an edited sweep refuses them."""
  sweep, workdir, _ = finished_sweep
  report.write_report(workdir, tmp_path / "committed")
  summary = json.loads((tmp_path / "committed" / "summary.json").read_text())
  # The first machine had finished k1 only; the second continues the sweep.
  summary["runs"] = {"k1": summary["runs"]["k1"]}
  new = tmp_path / "second_machine"
  new.mkdir()
  (new / spec.ARCHIVE).write_text(json.dumps(summary))
  assert ablate.archived_runs(sweep, new) == {"k1": {"seed0", "seed1"}}
  assert ablate.run_status(ablate.run_dir(new, sweep.points[0], 0),
                           ablate.archived_runs(sweep, new)) == "archived"
  out = subprocess.run(
      [sys.executable, "-m", "experiments.ablate", f"--sweep={sweep_file}",
       f"--workdir={new}", "--print_commands"],
      cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
  assert sorted(l.split("--workdir=")[1].split()[0] for l in out.stdout.strip().splitlines()) == [
      f"{new}/ns/seed0", f"{new}/ns/seed1"]
  assert "2 finished run(s) omitted" in out.stderr
  # The second machine's runs: ns copied from the finished sweep (what training would write).
  for s in (0, 1):
    (new / "ns" / f"seed{s}").mkdir(parents=True)
    (new / "ns" / f"seed{s}" / "results.json").write_text(
        (workdir / "ns" / f"seed{s}" / "results.json").read_text())
  # The second machine runs only what is left (--only=ns); its sweep.json names ns alone (the one
  # --print_commands wrote above, naming every point, is gone).
  (new / "sweep.json").unlink()
  counts = ablate.run_sweep(ablate.resolve(sweep, only=["ns"]), new, log=lambda *_: None)
  assert counts == {"skipped": 2, "ran": 0, "failed": 0}
  assert not (new / "k1").exists()
  loaded, runs, _ = report.load(new)
  assert [(p.name, p.label) for p in loaded.points] == [(p.name, p.label) for p in sweep.points]
  assert loaded.baseline == sweep.baseline and loaded.seeds == sweep.seeds
  _, original, _ = report.load(workdir)
  assert {p: sorted(s) for p, s in runs.items()} == {"k1": [0, 1], "ns": [0, 1]}
  for p in ("k1", "ns"):
    for s in (0, 1):
      assert runs[p][s]["final"] == original[p][s]["final"]
  # A run directory takes precedence over the archive.
  (new / "k1" / "seed0").mkdir(parents=True)
  (new / "k1" / "seed0" / "results.json").write_text(json.dumps({**original["k1"][0], "marker": 1}))
  assert report.load(new)[1]["k1"][0]["marker"] == 1
  edited = dataclasses.replace(sweep, base_overrides={**sweep.base_overrides, "mining.num_samples": 16})
  with pytest.raises(ConfigError, match=r"k1/seed1 was archived with other overrides: "
                                        r"mining\.num_samples: 32 archived, 16 now"):
    ablate.archived_runs(edited, new)
