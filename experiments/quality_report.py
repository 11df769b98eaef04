r"""Writes results/quality.md: the library's recipes against the peers, with ablations and curves.

  python -m experiments.ablate --sweep=experiments/sweeps/quality.py:bibtex --workdir=/tmp/quality/bibtex
  python -m experiments.ablate --sweep=experiments/sweeps/quality.py:delicious --workdir=/tmp/quality/delicious
  python -m experiments.ablate --sweep=experiments/sweeps/quality_before.py:bibtex --workdir=/tmp/quality/before_bibtex
  python -m experiments.ablate --sweep=experiments/sweeps/quality_before.py:delicious --workdir=/tmp/quality/before_delicious
  python -m experiments.ablate --sweep=experiments/sweeps/quality_default.py:bibtex --workdir=/tmp/quality/default_bibtex
  python -m experiments.quality_report --workdirs=/tmp/quality --out=results/quality.md

Every number is a test-split metric of a state chosen on the validation split (or, for the
"no selection" rows, the last state), mean +- std over the seeds found. Ablation rows re-read
the recipe's own candidates (workdir/candidates/*): "linear only" is the candidate with the best
validation value among the linear ones, "no ensemble" the best candidate of all (what the recipe
reports when its ensemble step chooses m = 1), and so on, so they cost no extra training.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np
from absl import app, flags

from snm_jax.train.runtime import plots
from snm_jax.train.runtime.workpath import workdir_path

_WORKDIRS = flags.DEFINE_string("workdirs", "/tmp/quality", "Root of the quality sweeps' workdirs.")
_OUT = flags.DEFINE_string("out", "results/quality.md", "Markdown file to write (figures beside it).")
_PEERS = flags.DEFINE_string("peers", "results/quality/peers.json", "benchmarks/quality_peers.py output.")

# Every row's rendered cells, seeds, note and date, per dataset, beside the figures: rows whose
# sweeps' workdirs are not on this machine are carried over from it (`render_rows`), so one point
# can be re-run and the report regenerated without the others' run directories.
ROWS_FILE = "rows.json"

DATASETS = ("bibtex", "delicious")
METRICS = ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@5")
PEERS = {"popularity": "popularity (train frequency)", "pecos_xrlinear": "PECOS XR-Linear",
         "napkinxc_plt": "napkinXC PLT", "ovr_linearsvc": "one-vs-rest LinearSVC (C=1)",
         "ovr_logreg": "one-vs-rest LogisticRegression (C=1)",
         "ovr_linearsvc_valC": "one-vs-rest LinearSVC (C on validation)",
         "ovr_logreg_valC": "one-vs-rest LogisticRegression (C on validation)"}


# The row of experiments/configs/default.py (experiments/sweeps/quality_default.py).
DEFAULT_ROW = ("**default.py**: one SNM tower model (`experiments/configs/default.py`: the recipe's tower "
               "settings, its derived learning rate alone, steps chosen on validation nDCG@5, then refit on "
               "the whole training file) (this library)")


DEFAULT_NO_REFIT_ROW = ("default.py without its refit (its candidate: the checkpoint chosen on validation, "
                        "trained on the other 90% of the training file)")


def _seeds(root: Path, point: str) -> list[dict]:
  return [json.loads(p.read_text()) for p in sorted((root / point).glob("seed*/results.json"))]


def _candidates(run_dir: Path) -> list[tuple[str, dict]]:
  return [(p.parent.name, json.loads(p.read_text()))
          for p in sorted((run_dir / "candidates").glob("*/results.json"))]


def _best_candidate(run_dir: Path, keep) -> dict | None:
  """Test metrics of the candidate with the best validation value among those `keep(name)` accepts."""
  cands = [(r["selected"]["value"], r) for name, r in _candidates(run_dir) if keep(name)]
  return max(cands, key=lambda c: c[0])[1]["final"] if cands else None


def _xmc_note(runs: list[dict]) -> str:
  """The best candidates, and with the ensemble step the number of members chosen per seed."""
  note = "candidates chosen: " + ", ".join(sorted({r["recipe"]["chosen"] for r in runs}))
  ens = [r["recipe"]["ensemble"] for r in runs if "ensemble" in r["recipe"]]
  if ens:
    note += ("; ensemble of the top m by validation (m <= " + str(ens[0]["max_members"]) +
             ", chosen on validation): m = " + ", ".join(str(e["m"]) for e in ens) + " per seed")
  splits = {r["recipe"].get("splits", 1) for r in runs}
  if splits != {1}:
    note += "; each member the sum of its models on r = " + "/".join(map(str, sorted(splits))) + " validation splits"
  return note


def _fmt(values: list[float]) -> str:
  v = 100 * np.asarray(values, np.float64)
  return f"{v.mean():.2f} ± {v.std():.2f}" if len(v) > 1 else f"{v.mean():.2f}"


def _row(label: str, finals: list[dict], note: str = "") -> tuple[str, list[dict], str]:
  """A table row to render (`render_rows`): its label, the runs' test metrics and a note."""
  return label, [f for f in finals if f], note


def render_rows(rows: list, archived: dict, today: str) -> tuple[list[str], dict]:
  """Markdown lines of `rows` ((label, finals, note), `_row`) and their records for ROWS_FILE.

  A row whose runs are here is computed from them (mean +- std over the seeds) and recorded with
  today's date; a row without runs (its sweep's workdirs are on another machine) is taken from
  `archived` (the ROWS_FILE records of an earlier report, {label: record}) and marked so; a row
  in neither is left out."""
  lines, records = [], {}
  for label, finals, note in rows:
    if label.startswith("|"):  # a separator line
      lines.append(label)
      continue
    if finals:
      rec = {"cells": [_fmt([f[m] for f in finals]) for m in METRICS], "seeds": len(finals),
             "note": note, "measured": today}
    elif label in archived:
      rec = archived[label]
    else:
      continue
    records[label] = rec
    shown = rec["note"] if finals else "; ".join(
        x for x in (rec["note"], f"archived row, measured by {rec['measured']}") if x)
    lines.append(f"| {label} | " + " | ".join(rec["cells"]) + f" | {rec['seeds']} | {shown} |")
  return lines, records


def dataset_section(name: str, root: Path, before: Path, peers: dict, archived: dict,
                    today: str, default: Path | None = None) -> tuple[list[str], dict]:
  """The dataset's table (markdown lines) and its rows' records for ROWS_FILE."""
  lines = [f"### {name.capitalize()}", "",
           "| method | " + " | ".join(METRICS) + " | seeds | notes |",
           "|" + "---|" * (len(METRICS) + 3)]
  xmc = _seeds(root, "xmc")
  xmc_dirs = sorted((root / "xmc").glob("seed*"))
  tower, tower_nodo = _seeds(root, "tower"), _seeds(root, "tower_nodo")
  tower_recipe = _seeds(root, "tower_recipe")
  tower_recipe_dirs = sorted((root / "tower_recipe").glob("seed*"))
  tower_narrow = _seeds(root, "tower_narrow")
  default_dirs = sorted((default / "default").glob("seed*")) if default else []
  rows = [
      _row("**xmc recipe** (this library)", [r["final"] for r in xmc], _xmc_note(xmc)),
      _row("**SNM tower** alone, through the recipe (`xmc.py:<dataset>,model=snm_tower`) (this library)",
           [r["final"] for r in tower_recipe], _xmc_note(tower_recipe)),
      _row("SNM tower, one model (the recipe's best candidate of split 0, no split or ensemble sum) "
           "(this library)", [_best_candidate(d, lambda n: True) for d in tower_recipe_dirs]),
      _row(DEFAULT_ROW, [r["final"] for r in _seeds(default, "default")] if default else []),
      _row("SNM tower 1024/512, dropout 0.5, scores x20 + selection on P@1 (this library)",
           [r["final"] for r in tower]),
  ]
  for peer, label in PEERS.items():
    res = peers.get(name, {}).get("methods", {}).get(peer, {})
    if res.get("status") == "ok":
      rows.append(_row(f"{label} [peer, v{res['version']}]", [res["metrics"]], "benchmarks/quality_peers.py"))
  rows.append(("| *ablations (each from the runs above)* |" + " |" * (len(METRICS) + 2), [], ""))
  rows += [
      _row("xmc, no ensemble (the best candidate alone)",
           [_best_candidate(d, lambda n: True) for d in xmc_dirs] if any("ensemble" in r["recipe"] for r in xmc)
           else []),
      _row("xmc without the one-vs-rest candidate (the 6 softmax candidates, with their ensemble step)",
           [r["final"] for r in _seeds(root, "xmc_no_ovr")], _xmc_note(_seeds(root, "xmc_no_ovr"))),
      _row("xmc, the one-vs-rest candidate alone", [_best_candidate(d, lambda n: n.startswith("ovr")) for d in xmc_dirs]),
      _row("xmc, linear candidates only (softmax)",
           [_best_candidate(d, lambda n: "kind_linear" in n) for d in xmc_dirs]),
      _row("xmc, wide_deep candidates only",
           [_best_candidate(d, lambda n: "kind_wide_deep" in n) for d in xmc_dirs]),
      _row("xmc, no learning-rate search (x1 only)",
           [_best_candidate(d, lambda n: n.endswith("learning_rate_x1")) for d in xmc_dirs]),
      _row("xmc, no checkpoint selection (last state)", [r["selected"]["last"] for r in xmc]),
      _row("xmc selecting on validation P@1 instead of nDCG@5 (the earlier recipe)",
           [r["final"] for r in _seeds(root, "xmc_select_p1")],
           "candidates chosen: " + ", ".join(sorted({r["recipe"]["chosen"] for r in _seeds(root, "xmc_select_p1")}))),
      _row("SNM tower, no checkpoint selection (last state)", [r["selected"]["last"] for r in tower]),
      _row(DEFAULT_NO_REFIT_ROW, [_best_candidate(d, lambda n: True) for d in default_dirs]),
      _row("SNM tower 256/128, dropout 0.3, x10 (the earlier settings), with selection",
           [r["final"] for r in tower_narrow]),
      _row("SNM tower 256/128, no dropout, x10, with selection", [r["final"] for r in tower_nodo]),
      _row("SNM tower 256/128, no dropout, x10, no selection (last state)",
           [r["selected"]["last"] for r in tower_nodo]),
      _row("before: experiments/configs/default.py (SNM top-1 tower, no validation)",
           [r["final"] for r in _seeds(before, "default")]),
  ]
  table, records = render_rows(rows, archived, today)
  return lines + table + [""], records


def learning_curves(name: str, root: Path, out_dir: Path) -> str | None:
  """Train loss, validation and test P@1 against steps, seed 0's chosen tower candidate, with and
  without dropout."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  runs = {}
  for point, label in (("tower_nodo", "SNM tower 256/128, no dropout, x10"),
                       ("tower_narrow", "SNM tower 256/128, dropout 0.3, x10"),
                       ("tower", "SNM tower 1024/512, dropout 0.5, x20")):
    res_path = root / point / "seed0" / "results.json"
    if not res_path.exists():
      continue
    chosen = json.loads(res_path.read_text())["recipe"]["chosen"]
    cand = root / point / "seed0" / "candidates" / chosen
    rows = [json.loads(line) for line in (cand / "metrics.jsonl").read_text().splitlines()]
    runs[label] = (rows, json.loads((cand / "results.json").read_text()))
  if not runs:
    return None
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for label, (rows, res) in runs.items():
    loss = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    axes[0].plot(*zip(*loss), label=label)
    hist = res["history"]
    for ax, key in ((axes[1], "val/P@1"), (axes[2], "P@1")):
      ax.plot([h["step"] for h in hist], [h[key] for h in hist], label=label)
    axes[1].axvline(res["selected"]["step"], ls=":", color=axes[1].lines[-1].get_color())
  for ax, title in zip(axes, ("training loss", "validation P@1 (dotted: selected step)", "test P@1")):
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.suptitle(f"{name}: the SNM tower before and after regularisation (seed 0, chosen learning rate)")
  path = out_dir / f"tower_curves_{name}.png"
  plots._save(fig, path)  # pylint: disable=protected-access
  return path.name


def main(argv):
  del argv
  root, out = workdir_path(_WORKDIRS.value), Path(_OUT.value)  # the sweeps' runs may be remote
  fig_dir = out.parent / "quality"
  fig_dir.mkdir(parents=True, exist_ok=True)
  peers_json = json.loads(Path(_PEERS.value).read_text())
  lines = [
      "# Quality: the library's recipes against the linear extreme-classification tools", "",
      "Test-split metrics in percent (PSP normalised, Jain et al. propensities from the training "
      "file), mean ± std over seeds 0, 1, 2. Every library choice (recipe candidate, checkpoint) "
      "was made on a validation split of 10% of the training file (seed 0); the test split was "
      "never read to choose. Peers: `benchmarks/quality_peers.py` on the whole training file, "
      f"measured {peers_json['date'][:10]} ({peers_json['results'] and 'see results/quality/peers.md'}).",
      "Generated by `python -m experiments.quality_report` from the sweeps named in its docstring.", "",
      "The xmc recipe ends with an ensemble step (`recipe.ensemble=3`, snm_jax/train/recipes/ensemble.py): the "
      "top m = 1..3 candidates by validation, scored by the sum of their logits, m chosen on validation "
      "nDCG@5; its \"no ensemble\" row is the best candidate alone. Adopted on 90/10 carves of the "
      "training files (real test splits unread): Delicious (2 seeds) P@1 / P@5 / PSP@5 70.67 / 59.61 / "
      "35.81 with it against 70.39 / 59.03 / 35.73 without, Bibtex (3 seeds) 62.02 / 28.31 / 57.80 "
      "against 62.02 / 28.25 / 57.71; up to all 6 candidates was worse on Bibtex (61.41 / 28.20 / 57.40).",
      "",
      "While the validation split is small (fewer than `recipe.min_validation` = 1000 points: Bibtex's "
      "488, not Delicious's 1,292) the recipe repeats its candidates on r = ceil(1000 / M) <= 5 random "
      "validation splits, chooses on the mean over them and sums the chosen members' models of every "
      "split (`recipe.splits`, recipes.num_splits). On the Bibtex carve (5 seeds) 62.83 / 28.58 / 58.53 "
      "against 62.66 / 28.30 / 57.90 with one split; on the real Bibtex test the one-split recipe had "
      "63.53 / 28.95 / 58.62 (3 seeds). The ablation rows of single candidates read split 0's runs.",
      "",
      "Its candidates include one one-vs-rest linear model (`ovr_pairs`, while K <= 2^14: squared-hinge "
      "BOWL with a constant theta over every label, trained on every (point, positive label) pair so that "
      "each positive weighs 1 as in LinearSVC; recipes.ovr_settings) next to the 6 softmax ones; the "
      "\"without the one-vs-rest candidate\" row is the recipe before it (same softmax runs). On the "
      "90/10 carves of the training files (real test splits unread): Bibtex (5 seeds) P@1 / P@5 / PSP@5 "
      "62.62 / 28.30 / 57.90 with it against 62.34 / 28.25 / 57.71 with the earlier one-vs-rest candidate "
      "(one drawn positive per point, so each positive weighed 1 / |Y_i|; it was within 0.5 of LinearSVC "
      "only after that change: alone 63.46 / 28.13 / 57.68 against LinearSVC(C on validation) 63.52 / "
      "28.20 / 57.43 on the same carve) and 62.09 / 28.22 / 57.62 without any; Delicious (2 seeds) "
      "unchanged, 70.67 / 59.61 / 35.81 (never in the top 3). LinearSVC's L2 penalty, as the row decay "
      "table.weight_decay = 1 / (C x pairs), did not help on the carves (C in 0.125..1). On the real "
      "Bibtex test split the earlier candidate's recipe had 63.47 / 28.81 / 58.31 (3 seeds). Summing the "
      "members' logits raw beat standardising each by its validation logit std (Bibtex, 3 seeds: 62.16 "
      "/ 28.39 / 58.00 against 62.16 / 28.13 / 57.44).",
      "",
      "The **SNM tower** row is the papers' model alone through the recipe as shipped "
      "(`xmc.py:<dataset>,model=snm_tower`: the tower settings of recipes.KIND_SETTINGS, three table "
      "learning rates, candidates and checkpoints chosen on validation nDCG@5, the ensemble step, and on "
      "Bibtex the sum of its models over r = 3 validation splits). Its \"one model\" row is the best "
      "candidate of split 0 alone. The earlier tower rows (one split, selection on P@1, no ensemble) "
      "are kept below. What the splits contribute to the tower was measured on 90/10 carves of the "
      "Bibtex training file (`experiments/carve.py`, seeds 0-2; real test split unread), the recipe "
      "with model=snm_tower and recipe.ensemble=1: P@1 / P@5 / PSP@5 62.64 / 28.52 / 58.52 with its "
      "r = 3 splits summed against 60.45 / 27.80 / 57.08 with one split (+2.2 P@1, up on every "
      "carve); PECOS XR-Linear on the same carves 63.18 / 28.54 / 58.93, so there the tower stayed 0.54 P@1 "
      "behind it (per carve -1.43, +0.20, -0.41; results/quality/tower_carves.json). Tried there and not adopted: "
      "every (point, positive) pair as an example (60.86 / 27.94 / 57.19, one split) and unnormalised "
      "class rows with scores x1 (+1.2 and +1.4 P@1 on the two carves that finished, not combined with "
      "the splits, not adopted in the time left).",
      "",
      "The **default.py** row is `experiments/configs/default.py` as shipped (Bibtex only so far): one SNM "
      "tower model with the recipe's tower settings, its derived table learning rate alone (no search), the "
      "number of steps chosen on validation nDCG@5 and the model then retrained on the whole training file "
      "for that many steps (`recipe.refit`). The refit was adopted on 90/10 carves of the Bibtex training "
      "file (`experiments/carve.py` seeds 0, 1; real test split unread): P@1 60.66 and 62.09 against 60.66 "
      "and 59.84 without; on the same carves the derived learning rate x2 instead of x1 was level (60.04 / "
      "60.86 against 60.66 / 59.84, validation nDCG@5 within 0.15), so the recipe's rule was kept. Its "
      "\"before\" row is what default.py trained until then (the papers' SNM top-1 settings, now "
      "`default.py:paper`). Popularity (train frequency) has P@1 13.96 on Bibtex: the default is 4.5x it. "
      "On Delicious (seed 0 only, not in the table) it gets P@1 / P@5 / PSP@5 67.35 / 56.02 / 33.73 (its "
      "candidate before the refit 67.76 / 56.58 / 34.07), 1.65x popularity's 40.75, against 39.24 before.",
      ""]
  rows_path = fig_dir / ROWS_FILE
  archived = json.loads(rows_path.read_text()) if rows_path.exists() else {}
  today = datetime.date.today().isoformat()
  records = {}
  for name in DATASETS:
    section, records[name] = dataset_section(name, root / name, root / f"before_{name}",
                                             peers_json["results"], archived.get(name, {}), today,
                                             root / f"default_{name}")
    lines += section
    # Without the tower runs here, the committed figure (same file name) stays as it is.
    fig = learning_curves(name, root / name, fig_dir) or (
        f"tower_curves_{name}.png" if (fig_dir / f"tower_curves_{name}.png").exists() else None)
    if fig:
      lines += [f"![{name} tower curves](quality/{fig})", ""]
  rows_path.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
  out.write_text("\n".join(lines) + "\n")
  print(out.read_text())


if __name__ == "__main__":
  app.run(main)
