"""Recipes: configs whose settings are derived from the data, then chosen on validation.

A recipe config (`recipe.name`, e.g. experiments/configs/xmc.py) leaves some
fields at "auto" (strings) or -1 (numbers). `run` reads the dataset once,
fills those fields from its statistics (`DataStats`), and trains one
candidate per point of a small grid (`recipe.search`) in
`workdir/candidates/<name>/`, each with validation-based checkpoint selection;
the "auto" search adds a one-vs-rest candidate ("ovr_pairs", `ovr_settings`) while
every label can be scored exactly. A candidate whose loss turns non-finite is
left out of the choice (`recipe.diverged`), not fatal.
The candidate with the best validation `eval.select_metric` is the result:
its results.json, plus a `recipe` record of the statistics, the derived
fields and every candidate's validation value, is written to
`workdir/results.json`. With `recipe.ensemble` M > 1, the ensembles of the
top m = 1..M candidates by validation (the sum of their logits,
`snm_jax/train/recipes/ensemble.py`) are scored on validation, the best m is kept
(m = 1: the best candidate alone) and only its ensemble is scored on test;
`recipe.ensemble` in results.json records the members, the validation value
per m and the test metrics (also in workdir/ensemble.json, reused on a rerun). With a
`recipe.logit_adjust` grid, the result (ensemble or best candidate) is then re-scored by
z(x, y) - tau log pi_y for each tau on validation and the best tau kept (`choose_logit_adjust`;
workdir/logit_adjust.json). The test split is evaluated by every candidate but
never read to choose. Finished candidates are reused and interrupted ones
resume, so the recipe resumes like a single run.

With `recipe.splits` r > 1 (-1: derived from the validation size, `num_splits`) and
`recipe.split_search` "all", every candidate is trained once per validation split (repeated random
splits of the same size, seeds dataset.validation_seed + i; split 0 in `workdir/candidates/`, split i in
`workdir/splits/<i>/candidates/`), each run keeping its best checkpoint on its own split; the
candidates are ranked, and the ensemble size chosen, on the mean over the splits, and the result
sums the chosen members' models of every split (so even m = 1 is an ensemble, scored on test).
With `recipe.split_search` "first" the candidates are trained, halved and chosen (and the ensemble
size m) on split 0 alone, and only the chosen members are then trained on splits 1..r-1 and summed
the same way: the r-fold cost is paid by the chosen members only.

A field the user sets explicitly (anything but "auto"/-1) is kept as given.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import scipy.sparse as sp
from absl import logging

from snm_jax.data.datasets import num_nonzero
from snm_jax.data.pipeline import choose_max_nnz
from snm_jax.errors import ConfigError, NonFiniteLossError
from snm_jax import sharding
from snm_jax.train.recipes import candidates as candidates_lib
from snm_jax.train.recipes import ensemble
from snm_jax.train.core import logit_adjust
from snm_jax.train.runtime.host import is_writer
from snm_jax.train.runtime import member_devices
# AUTO, the placeholder test and the `recipe.search` parser live with the overrides (builders validates
# recipe.search with them); parse_search is re-exported here.
from snm_jax.train.config.overrides import AUTO, parse_search, with_overrides  # noqa: F401
from snm_jax.train.config.overrides import is_auto as _is_auto
from snm_jax.train.trainer.run_data import RunData, load_run_data
from snm_jax.train.runtime.workpath import workdir_path, write_text

@dataclasses.dataclass(frozen=True)
class DataStats:
  num_train: int            # training points after the validation split
  num_features: int         # d
  num_labels: int           # K
  labels_per_point: float
  nnz_per_point: float

  @classmethod
  def of(cls, run_data: RunData) -> "DataStats":
    train = run_data.train
    if run_data.sharded:  # from the histograms the converter streamed (metadata.json), nothing read
      nnz, labels = train.histograms()
      n = train.num_points
      mean = lambda h: float(np.dot(np.arange(h.size), h) / max(n, 1))  # noqa: E731
      return cls(num_train=n, num_features=run_data.num_features, num_labels=run_data.num_labels,
                 labels_per_point=mean(labels), nnz_per_point=mean(nnz))
    n = train.features.shape[0]
    return cls(num_train=n, num_features=run_data.num_features, num_labels=run_data.num_labels,
               labels_per_point=float(train.labels.nnz / max(n, 1)),
               nnz_per_point=float(num_nonzero(train.features) / max(n, 1)))


# The linear / wide models hold a K x (d + 1) table: use them up to this many entries (1 GiB of float32).
MAX_LINEAR_TABLE = 1 << 28
# Exact softmax over every label while scoring all K per step stays cheap next to the rest of the step.
MAX_FULL_SOFTMAX_LABELS = 1 << 14
# The tower's input layer as a dense matmul (EmbeddingBag matmul="dense") up to this many features.
MAX_DENSE_BAG_FEATURES = 1 << 14
# Per-example step size of the class table under SGD on the mean loss of a batch: the table's
# learning rate is this times the batch size (measured stable on Bibtex and Delicious validation splits).
TABLE_LR_PER_EXAMPLE = {"linear": 0.16, "wide_deep": 0.16, "snm_tower": 0.004}
# Per model kind, the query tower and the factor on the scores. The linear model has no tower (its
# hidden / out are unused). wide_deep: a narrow tower with dropout next to the linear path. The SNM
# tower alone (cosine scores): wide, dropout 0.5 and scores x20; measured on 90/10 carves of the
# Bibtex and Delicious training files, never their test splits (results/quality.md): 1024/512 wide
# with x20 gained 4.1 (Bibtex) and 2.9 (Delicious) P@1 over 256/128 with x10.
KIND_SETTINGS = {
    "linear": {"model.hidden": 256, "model.out": 128, "model.dropout": 0.0, "loss.logit_scale": 1.0},
    "wide_deep": {"model.hidden": 256, "model.out": 128, "model.dropout": 0.3, "loss.logit_scale": 1.0},
    "snm_tower": {"model.hidden": 1024, "model.out": 512, "model.dropout": 0.5, "loss.logit_scale": 20.0},
}


# One-vs-rest candidates (issue 14): the linear model trained with a per-label binary loss over every
# label, i.e. BOWL (Reddi et al. 2019, Sec. 3: phi(v_y) + sum_j theta_j phi(-v_j)) with a constant
# theta (Lee et al.'s binary loss) and the squared hinge, scored exactly over all K (the full sampler)
# -- the squared-hinge one-vs-rest of LinearSVC, through the library's own loss layer. With
# vartheta = negative_sampling and the "expectation" norm every negative weighs c = (K-1)/(k B) ~ 1/k
# (B = K_pad draws), k = the mean number of labels per point (rounded). Every (point, positive label)
# pair is an example (dataset.conversion = expand_all_positives; the point's other positives are
# masked from its negatives), so a point's loss summed over its |Y_i| pairs is
# sum_{y in Y_i} phi(v_y) + |Y_i| c sum_{j not in Y_i} phi(-v_j): every positive weighs 1, as in
# LinearSVC's per-label sums. With one positive drawn per point and epoch (sample_one_positive, the
# library's default) a point's expected loss is (1/|Y_i|) sum_{y in Y_i} phi(v_y) + c sum_{j not in
# Y_i} phi(-v_j): each positive weighs 1/|Y_i|, the labels of points with many labels too little.
# Measured on the 90/10 carves of the training files (held-out 10% as the test, the real test splits
# unread), the candidate alone, P@1 / P@5 / PSP@5 (validation nDCG@5):
#   Bibtex (3 seeds): one drawn positive 62.70 / 27.38 / 56.22 (62.27), the pairs 63.46 / 28.13 /
#   57.68 (62.99), level with scikit-learn's OvR LinearSVC fitted on the same part with C chosen on
#   the same validation (C = 0.25: 63.52 / 28.20 / 57.43); LinearSVC fitted per label with the
#   one-positive weights (positives k B / ((K-1) |Y_i|), negatives 1) reproduces the gap (62.70 /
#   27.50 / 55.95).
#   Delicious (2 seeds): one drawn positive 69.93 / 58.32 / 34.37 (57.87), the pairs 68.34 / 57.80 /
#   33.42 (57.21), neither near the top 3 candidates (>= 58.2); the pairs train faster (26-28 s, the
#   one-drawn-positive candidate 38-54 s in earlier runs on the same 2 shared cores).
#   The whole recipe: Bibtex (5 seeds) 62.66 / 28.30 / 57.90 with the pairs against 62.34 / 28.25 /
#   57.71 with one drawn positive (validation nDCG@5 of the result 63.18 against 62.84; the pairs
#   candidate was in the chosen ensemble on every seed, alone on one); Delicious (2 seeds)
#   unchanged, 70.67 / 59.61 / 35.81. Both candidates side by side (a grid over the conversion)
#   gave Bibtex 62.62 / 28.30 / 57.90, nothing for the time.
# No weight decay: LinearSVC's L2 penalty as table.weight_decay = 1 / (C N |Y|) (N |Y| pairs; c /
# (C N) with one drawn positive) -- the decoupled decay of SGD on the mean loss that matches
# 0.5 ||w||^2 + C x the per-label losses, exact here as every row is touched each step -- lowered
# validation nDCG@5 on the Bibtex carve for C <= 0.5 and left it level at C = 1 (the pairs, 3 seeds:
# C = 1 / 0.5 / 0.25 63.02 / 62.91 / 62.71 against 62.99 without; held-out 63.18 / 28.04 / 57.39,
# 63.04 / 28.05 / 57.30, 62.64 / 28.03 / 57.12). Checkpoint selection on validation from a zero
# table already regularises.
OVR_LOSS_SETTINGS = {"loss.kind": "bowl", "loss.phi": "squared_hinge", "mining.sampler": "full",
                     "mining.vartheta": "negative_sampling", "mining.vartheta_norm": "expectation",
                     "dataset.conversion": "expand_all_positives"}
# The table's learning rate, NOT scaled with the batch size as the softmax's is: the squared hinge's
# curvature does not saturate (the softmax's is <= 1/4), and SGD on a mean loss is stable below
# 2 / (the mean loss's largest curvature), which the batch size does not change. Measured: 10.24
# diverged on Bibtex with batches of 256 (the 90/10 carve of the training file) and of 512 (the real
# training file; the recipe left it out), and 81.92 on Delicious; 5.12 was stable on both (Bibtex
# with k = 1 too). Validation nDCG@5 on the carves: of {1.28, 2.56, 5.12}, 5.12 was the best on
# Bibtex seeds 0, 1 and tied on seed 2; on Delicious 10.24 and 20.48 were slightly better (57.98,
# 57.76 and 58.03 against 57.58, 57.50), not enough to reach the top 3 candidates either way.
OVR_TABLE_LEARNING_RATE = 5.12
# Their grid (`recipe.search` syntax; "": one candidate). A learning-rate grid x {0.25, 0.5, 1} added
# nothing on the carves (its other points never entered the top 3 candidates), only time.
OVR_SEARCH = ""
# "ovr_pairs": not the name of the earlier one-drawn-positive candidate ("ovr"), whose finished
# workdirs a rerun would otherwise reuse as they are.
OVR_NAME = "ovr_pairs"


# Repeated validation splits (issue 14): while the validation split is small, the candidates and the
# ensemble size are chosen on the mean over `num_splits` random splits (each model trained without
# its split's held-out part and keeping its best checkpoint on it), and the result sums the models of
# every split. At most this many splits (the candidates' training cost is multiplied by it).
MAX_SPLITS = 5


def fits_linear_table(stats: DataStats, width: int = 0) -> bool:
  """Whether a K x (d + 1 + width) class table (linear / wide_deep models) is small enough."""
  return stats.num_labels * (stats.num_features + 1 + width) <= MAX_LINEAR_TABLE


def derive(config, stats: DataStats) -> dict:
  """{field: value} for every "auto" / -1 field of `config`, from the data statistics."""
  r = config.recipe
  kind = config.model.kind
  if _is_auto(kind):
    kind = "linear" if fits_linear_table(stats) else "snm_tower"
  full = stats.num_labels <= MAX_FULL_SOFTMAX_LABELS
  batch = config.train.batch_size
  if _is_auto(batch):  # a power of two, at most 512 and at most 1/8 of the data
    batch = int(2 ** np.clip(np.floor(np.log2(max(stats.num_train // 8, 1))), 5, 9))
  steps = config.train.num_steps
  if _is_auto(steps):
    steps = int(np.clip(round(r.epochs * stats.num_train / batch), r.min_steps, r.max_steps))
  wanted = {
      "model.kind": kind,
      "model.bag_matmul": "dense" if stats.num_features <= MAX_DENSE_BAG_FEATURES else "gather",
      "loss.kind": "full_softmax" if full else "sampled_softmax",
      "mining.sampler": "full" if full else "uniform",
      "mining.num_samples": (-(-stats.num_labels // config.mining.num_strata) * config.mining.num_strata
                             if full else min(8192, stats.num_labels)),
      "train.batch_size": batch,
      "train.num_steps": steps,
      "train.eval_every": max(steps // r.evaluations, 1),
      "table.learning_rate": TABLE_LR_PER_EXAMPLE[kind] * batch,
  }
  return {**_unset(config, wanted), **kind_settings(config, kind)}


def _unset(config, wanted: dict) -> dict:
  """The entries of `wanted` whose config field is left at "auto" / -1."""
  return {f: v for f, v in wanted.items() if _is_auto(config[f.split(".")[0]][f.split(".")[1]])}


def kind_settings(config, kind: str) -> dict:
  """The model kind's query-tower width, dropout and logit scale (KIND_SETTINGS), for the fields
  left at "auto" / -1."""
  return _unset(config, KIND_SETTINGS[kind])


def search_spec(config, stats: DataStats) -> str:
  """`recipe.search`, or for "auto": the table's learning rate x {0.5, 1, 2}, and the model
  among linear and wide_deep when their table fits and model.kind is "auto"."""
  if config.recipe.search != AUTO:
    return config.recipe.search
  spec = "table.learning_rate*=0.5,1,2"
  wide_out = KIND_SETTINGS["wide_deep"]["model.out"] if _is_auto(config.model.out) else config.model.out
  if _is_auto(config.model.kind) and fits_linear_table(stats, wide_out):
    spec = "model.kind=linear,wide_deep;" + spec
  return spec


def ovr_settings(config, stats: DataStats, derived: dict) -> dict | None:
  """The fields of the one-vs-rest candidates (OVR_LOSS_SETTINGS -- the squared-hinge BOWL over every
  label, trained on every (point, positive) pair --, mining.k, and the table learning rate when it
  is derived), or None when the recipe has none: only with `recipe.search` and
  `loss.kind` left at "auto", K <= MAX_FULL_SOFTMAX_LABELS (every label scored exactly) and the
  linear model (model.kind auto with a table that fits, or linear)."""
  if config.recipe.search != AUTO or not _is_auto(config.loss.kind):
    return None
  if config.dataset.get("format", "memory") == "sharded":
    return None  # its examples are every (point, positive) pair, listed up front from the whole matrix
  if stats.num_labels > MAX_FULL_SOFTMAX_LABELS or derived.get("model.kind", config.model.kind) != "linear":
    return None
  k = max(int(round(stats.labels_per_point)), 1)
  out = {**OVR_LOSS_SETTINGS, "mining.k": k,
         "mining.num_samples": (-(-stats.num_labels // config.mining.num_strata)
                                * config.mining.num_strata)}
  if _is_auto(config.table.learning_rate):
    out["table.learning_rate"] = OVR_TABLE_LEARNING_RATE
  return out


def candidate_list(config, stats: DataStats, derived: dict) -> list[tuple[str, dict, dict]]:
  """Every candidate as (name, its grid point's overrides, every field it sets): the points of
  `search_spec`, then those of OVR_SEARCH with `ovr_settings` (named OVR_NAME, or
  "<OVR_NAME>-<point>" for a grid), when it applies.
  Raises ConfigError for a search field the config does not have."""
  resolved = {**{f: config[f.split(".")[0]][f.split(".")[1]] for f in _fields(config)}, **derived}
  out = []
  groups = [(parse_search(search_spec(config, stats)), {}, "")]
  ovr = ovr_settings(config, stats, derived)
  if ovr is not None:
    groups.append((parse_search(OVR_SEARCH), ovr, OVR_NAME))
  for grid, extra, group in groups:
    for field in grid:
      if field not in resolved:
        raise ConfigError("recipe.search", f"unknown field {field!r}")
    for name, over in candidates({**resolved, **extra}, grid):
      kind = over.get("model.kind", derived.get("model.kind", config.model.kind))
      name = "-".join(filter(None, (group, name)))
      out.append((name, {**extra, **over},
                  {**derived, **kind_settings(config, kind), **extra, **over}))
  return out


def candidates(base: dict, grid: dict) -> list[tuple[str, dict]]:
  """Every point of the grid as (name, overrides), overrides applied on top of `base`."""
  points = [("", {})]
  for field, (op, values) in grid.items():
    nxt = []
    for name, over in points:
      for v in values:
        value = base[field] * v if op == "*=" else v
        label = f"{field.split('.')[-1]}_{'x' if op == '*=' else ''}{v}"
        nxt.append((f"{name}-{label}" if name else label, {**over, field: value}))
    points = nxt
  return points


def _apply(config, overrides: dict):
  """A candidate: `config` with `overrides`, as a plain run (recipe.name cleared)."""
  return with_overrides(config, {**overrides, "recipe.name": ""})


def num_splits(config, num_validation: int) -> int:
  """How many validation splits the candidates are trained and chosen on: `recipe.splits`, or for
  -1 (auto) ceil(recipe.min_validation / M), at most MAX_SPLITS, while the validation split holds
  M < recipe.min_validation points, else 1 (one split, no extra cost)."""
  r = int(config.recipe.get("splits", 1))
  if r != -1:
    return r
  wanted = int(config.recipe.get("min_validation", 0))
  if num_validation >= wanted:
    return 1
  return int(min(-(-wanted // max(num_validation, 1)), MAX_SPLITS))


def split_fields(config, i: int) -> dict:
  """The fields of validation split i: dataset.validation_seed + i (split 0: the config's own)."""
  return {"dataset.validation_seed": int(config.dataset.validation_seed) + i}


def split_batch_widths(config, run_datas) -> dict:
  """{"max_nnz", "max_labels"}: of the batch widths left "auto" (dataset.max_nnz / max_labels = 0),
  the widest of the validation splits' training parts, each found as the input pipeline's "auto"
  finds it. The recipe's candidate groups pad their training batches at least this wide (a group
  of every split's members would; padding changes no value), so the chosen candidates trained on
  the other splits after the search on split 0 (recipe.split_search "first") have split 0's batch
  shapes and run the programs split 0's groups compiled. The members' configs stay "auto" (their
  evaluations, and the reuse of their workdirs, as before)."""
  out = {}
  if not int(config.dataset.max_nnz) and all(sp.issparse(rd.train.features) for rd in run_datas):
    out["max_nnz"] = max(choose_max_nnz(np.diff(rd.train.features.indptr)) for rd in run_datas)
  if not int(config.dataset.max_labels):
    out["max_labels"] = max(choose_max_nnz(np.diff(sp.csr_matrix(rd.train.labels).indptr))
                            for rd in run_datas)
  return out


def split_dir(workdir, i: int):
  """Where split i's candidates live: workdir itself for split 0 (the one-split layout, so a
  single-split recipe's candidates are reused as split 0), workdir/splits/<i> for the others."""
  return workdir if i == 0 else workdir / "splits" / str(i)


def run(config, workdir) -> dict:
  """Derives the recipe's fields, trains every candidate, returns (and writes) the chosen one's results."""
  workdir = workdir_path(workdir)
  if config.dataset.validation_fraction <= 0:
    raise ConfigError("dataset.validation_fraction", "a recipe chooses on a validation split: set it > 0")
  run_data = load_run_data(config)
  stats = DataStats.of(run_data)
  derived = derive(config, stats)
  points = candidate_list(config, stats, derived)
  r = num_splits(config, run_data.validation.num_points)
  if run_data.sharded and r > 1:  # (an explicit recipe.splits > 1 is refused by validation)
    logging.info("recipe.splits=-1 would take %d validation splits; a sharded dataset holds the one "
                 "carved when it was converted", r)
    r = 1
  # Split i > 0 holds out as many points, drawn with the next permutation seed (repeated random
  # splits; the training part's size, hence every derived field, is the same on each).
  run_datas = [run_data] + [load_run_data(with_overrides(config, split_fields(config, i)))
                            for i in range(1, r)]
  logging.info("recipe %s on %s: %s; derived %s; %d validation split(s)", config.recipe.name,
               run_data.source, stats, derived, r)
  min_widths = split_batch_widths(config, run_datas) if r > 1 else None
  # recipe.split_search "first": the candidates are trained, halved and chosen on split 0 only; the
  # chosen ones are trained on the other splits afterwards (`_train_other_splits`).
  searched = r if config.recipe.get("split_search", "all") == "all" else 1
  slots = member_devices.member_slots(config)
  if slots:  # one device per member: the members' (and the ensembles') mesh is one device
    config = with_overrides(config, {"mesh.shape": (1, 1)})
    logging.info("recipe: group members dealt over %d devices, one each: %s", len(slots),
                 [str(m.devices.flat[0]) for m in slots])
  mesh = sharding.make_mesh(config.mesh.shape)
  members = [(name, i, _apply(config, {**fields, **split_fields(config, i)}),
              split_dir(workdir, i) / "candidates" / name) for name, _, fields in points
             for i in range(searched)]
  trained = candidates_lib.train(config, members, mesh, slots, min_widths)
  table, fields_of, diverged, eliminated = [], {}, [], []
  for name, over, fields in points:
    per_split = [trained[(name, i)] for i in range(searched)]
    bad = next(((i, s) for i, s in enumerate(per_split) if "diverged" in s), None)
    if bad is not None:  # no state to choose: left out of the choice and the ensembles
      diverged.append({"name": name, "overrides": over, "error": bad[1]["diverged"], "split": bad[0]})
    elif any("eliminated" in s for s in per_split):  # stopped by successive halving: no test metrics
      eliminated.append({"name": name, "overrides": over,
                         **next(s["eliminated"] for s in per_split if "eliminated" in s)})
    else:
      fields_of[name] = fields
      row = {"name": name, "overrides": over,
             # one split: its value; several: the mean over the splits (what the choice reads)
             "selected_step": int(round(np.mean([s["selected"]["step"] for s in per_split]))),
             "validation": float(np.mean([s["selected"]["value"] for s in per_split])),
             "steps": per_split[0]["steps"],
             "train_seconds": sum(s["train_seconds"] for s in per_split)}
      if searched > 1:
        row["splits"] = [{"validation": s["selected"]["value"], "selected_step": s["selected"]["step"]}
                         for s in per_split]
      table.append(row)
  if not table:
    raise NonFiniteLossError(f"every recipe candidate diverged: {diverged}")
  best = table[max(range(len(table)), key=lambda i: (table[i]["validation"], -i))]
  chosen = json.loads((workdir / "candidates" / best["name"] / "results.json").read_text())
  record = {"name": config.recipe.name, "stats": dataclasses.asdict(stats), "derived": derived,
            "select_metric": config.eval.select_metric, "candidates": table, "chosen": best["name"],
            "splits": r, "train_seconds_all_candidates": sum(t["train_seconds"] for t in table)}
  if diverged:
    record["diverged"] = diverged
  if eliminated:
    record["eliminated"] = eliminated
  max_members = ensemble_size(config, len(table))
  configs = {n: _apply(config, f) for n, f in fields_of.items()}
  # Several splits: the result is the sum of the chosen members' models over the splits (each
  # trained without its own held-out part), so even m = 1 is scored as an ensemble.
  if searched < r:
    ens = _ensemble_or_load(config, run_datas[:1], table, configs, workdir, max_members)
    ens = _train_other_splits(config, run_datas, ens, fields_of, configs, workdir, mesh, record, slots,
                              min_widths)
    record["ensemble"] = ens
    chosen = {**chosen, "final": ens["test"]}
  elif max_members > 1 or r > 1:
    ens = _ensemble_or_load(config, run_datas, table, configs, workdir, max_members)
    record["ensemble"] = ens
    if "test" in ens:  # else the best candidate alone on one split, its results as they are
      chosen = {**chosen, "final": ens["test"]}
  taus = logit_adjust_grid(config)
  if len(taus) > 1:
    members = record["ensemble"]["members"] if "ensemble" in record else [best["name"]]
    adjust = _logit_adjust_or_load(config, run_datas, members, {n: configs[n] for n in members},
                                   workdir, taus)
    record["logit_adjust"] = adjust
    if adjust["tau"] > 0:  # else the model / ensemble unadjusted, its test metrics as they are
      chosen = {**chosen, "final": adjust["test"]}
  if config.recipe.refit:  # (validation.validate refuses it with an ensemble or a logit adjustment)
    # The chosen settings retrained on the whole training file (validation part included) for the
    # selected number of steps (several splits: their mean), the schedule ending there
    # (scikit-learn's GridSearchCV(refit=True)). Nothing is chosen from this run: it is decided
    # before any result is seen.
    refit_fields = {**fields_of[best["name"]], "dataset.validation_fraction": 0.0,
                    "train.num_steps": max(best["selected_step"], 1), "train.eval_every": 0}
    refit_config = _apply(config, refit_fields)
    refit = (candidates_lib.finished(refit_config, workdir / "refit")
             or candidates_lib.train_alone(refit_config, workdir / "refit"))
    record["refit"] = {"steps": refit["steps"], "train_seconds": refit["train_seconds"],
                       "candidate_final": chosen["final"]}
    chosen = {**refit, "selected": chosen["selected"]}
  chosen["recipe"] = record
  if is_writer():
    write_text(workdir / "results.json", json.dumps(chosen, indent=2, sort_keys=True))
  return chosen


def _train_other_splits(config, run_datas, ens: dict, fields_of: dict, configs: dict, workdir, mesh,
                        record: dict, slots=None, min_widths=None) -> dict:
  """recipe.split_search "first": the members of the ensemble `ens` chosen on split 0 trained on
  splits 1..r-1 (as one group per shape, no halving: nothing is chosen among them), and the
  ensemble summed over every split's models scored on test -- the result of the "all" search had
  it chosen the same members. Returns `ens` (its "splits": 1, the split it was chosen on) with "test",
  "summed_splits" = r and "other_splits" (each model's split, validation value and selected step);
  also written to workdir/ensemble.json, which a rerun reuses."""
  r = len(run_datas)
  names = ens["members"]
  if ens.get("other_splits") and [m["name"] for m in ens["other_splits"]] == [
      n for n in names for _ in range(1, r)] and "test" in ens:
    return ens  # the ensemble.json of an earlier attempt, which had finished this
  others = [(n, i, _apply(config, {**fields_of[n], **split_fields(config, i)}),
             split_dir(workdir, i) / "candidates" / n) for n in names for i in range(1, r)]
  trained = candidates_lib.train(with_overrides(config, {"recipe.halving": 0}), others, mesh, slots,
                                 min_widths)
  bad = [(n, i, out["diverged"]) for (n, i), out in trained.items() if "diverged" in out]
  if bad:  # the sum must hold every split's model: no silent leaving out
    raise NonFiniteLossError(f"chosen recipe members diverged on other validation splits: {bad}")
  ens = {**ens, "summed_splits": r, "other_splits": [
      {"name": n, "split": i, "validation": trained[(n, i)]["selected"]["value"],
       "selected_step": trained[(n, i)]["selected"]["step"]} for n, i, _, _ in others]}
  record["train_seconds_all_candidates"] += sum(trained[(n, i)]["train_seconds"] for n, i, _, _ in others)
  ens["test"] = _ensemble_evaluator(run_datas, configs, workdir)(names, "test")
  logging.info("[ensemble] %s trained on %d more validation split(s); the sum over %d splits on test: %s",
               names, r - 1, r, {k: round(v, 4) for k, v in ens["test"].items() if isinstance(v, float)})
  if is_writer():
    write_text(workdir / "ensemble.json", json.dumps(ens, indent=2, sort_keys=True))
  return ens


def ensemble_size(config, num_candidates: int) -> int:
  """The most members an ensemble may have: `recipe.ensemble` (0: every candidate), at most the
  number of candidates. 1: no ensemble."""
  m = int(config.recipe.get("ensemble", 1))
  return num_candidates if m == 0 else min(m, num_candidates)


def ensemble_order(table: list[dict]) -> list[str]:
  """Candidate names by validation value, best first (ties: the earlier candidate, as for `chosen`)."""
  order = sorted(range(len(table)), key=lambda i: (-table[i]["validation"], i))
  return [table[i]["name"] for i in order]


def choose_ensemble(config, run_datas, table: list[dict], configs: dict, workdir, max_members: int,
                    evaluate_fn=None) -> dict:
  """The ensemble of the top-m candidates by validation (m = 1..max_members) with the best
  validation `eval.select_metric` (ties: the smaller m); only it is scored on test (m = 1 on one
  split: not at all, the candidate's own results stand).

  The ensemble's score is the sum of its members' logits (`snm_jax.train.recipes.ensemble`), each
  member at its selected checkpoint. With several validation splits (`run_datas`, one per split,
  `num_splits`) a member is its models on every split: on validation the top-m ensemble is scored
  on each split with that split's models and the values averaged; on test every split's models
  are summed. `evaluate_fn(names, split) -> metrics` replaces the real evaluation (tests).
  Returns the record written to results.json["recipe"]["ensemble"]."""
  order = ensemble_order(table)[:max_members]
  select = config.eval.select_metric
  run_datas = _as_splits(run_datas)
  splits = len(run_datas)
  if evaluate_fn is None:
    evaluate_fn = _ensemble_evaluator(run_datas, configs, workdir)
  validation = []
  for m in range(1, max_members + 1):
    metrics = evaluate_fn(order[:m], "validation")
    validation.append({"m": m, "value": metrics[select],
                       "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}})
  best = max(validation, key=lambda v: (v["value"], -v["m"]))
  record = {"max_members": max_members, "order": order, "select_metric": select, "splits": splits,
            "validation": validation, "m": best["m"], "members": order[:best["m"]]}
  if best["m"] > 1 or splits > 1:
    record["test"] = evaluate_fn(record["members"], "test")
  return record


def logit_adjust_grid(config) -> tuple[float, ...]:
  """The taus of `recipe.logit_adjust` ("" = off), ascending, 0 (no adjustment) always included."""
  return logit_adjust.parse_grid(config.recipe.get("logit_adjust", ""))


def choose_logit_adjust(config, run_datas, members: list[str], configs: dict, workdir,
                        taus: tuple[float, ...], evaluate_fn=None) -> dict:
  """Menon et al.'s post-hoc logit adjustment (`snm_jax.train.core.logit_adjust`) of the chosen model or
  ensemble: score(x, y) = z(x, y) - tau log pi_y, pi_y the label's Laplace-smoothed frequency in
  the TRAINING part of the first split (`logit_adjust.log_label_prior`; the validation part is not
  counted), tau in
  `taus` chosen on validation `eval.select_metric` (ties: the smaller tau, so tau = 0, no
  adjustment, wins unless validation prefers another); only the chosen tau > 0 is scored on test.

  z is the sum of the members' logits, each on its own scale (the ensemble), so tau's meaning is
  per run; that is why it is chosen on validation per run. `evaluate_fn(names, split, label_bias)
  -> metrics` replaces the real evaluation (tests). Returns the record written to
  results.json["recipe"]["logit_adjust"]."""
  select = config.eval.select_metric
  run_datas = _as_splits(run_datas)
  if evaluate_fn is None:
    evaluate_fn = _ensemble_evaluator(run_datas, configs, workdir)
  first = run_datas[0]
  if getattr(first, "sharded", False):  # the training part's counts: the whole file's less the validation's
    log_prior = logit_adjust.log_prior_from_counts(
        first.label_counts - first.validation.labels.getnnz(axis=0), first.train.num_points)
  else:
    log_prior = logit_adjust.log_label_prior(first.train.labels)
  validation = []
  for tau in taus:
    metrics = evaluate_fn(members, "validation", -tau * log_prior)
    validation.append({"tau": tau, "value": metrics[select],
                       "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}})
  best = max(validation, key=lambda v: (v["value"], -v["tau"]))
  record = {"members": list(members), "taus": list(taus), "select_metric": select,
            "validation": validation, "tau": best["tau"]}
  if best["tau"] > 0:
    record["test"] = evaluate_fn(members, "test", -best["tau"] * log_prior)
  return record


def _logit_adjust_or_load(config, run_datas, members, configs, workdir, taus) -> dict:
  """`choose_logit_adjust`, or its record in workdir/logit_adjust.json when it was made for the
  same members, taus and selection metric."""
  path = workdir / "logit_adjust.json"
  if path.exists():
    saved = json.loads(path.read_text())
    if (saved.get("members") == list(members) and saved.get("taus") == list(taus)
        and saved.get("select_metric") == config.eval.select_metric
        and saved.get("splits", 1) == len(run_datas)):
      logging.info("[logit adjust] reusing %s", path)
      return saved
  record = choose_logit_adjust(config, run_datas, members, configs, workdir, taus)
  record["splits"] = len(run_datas)
  logging.info("[logit adjust] validation %s per tau %s: %s; chosen tau = %g", config.eval.select_metric,
               list(taus), [round(v["value"], 4) for v in record["validation"]], record["tau"])
  if is_writer():
    write_text(path, json.dumps(record, indent=2, sort_keys=True))
  return record


def _ensemble_evaluator(run_datas, configs: dict, workdir):
  """`evaluate(names, split, label_bias=None)` of the ensemble of the named candidates (one name:
  that candidate), each model restored once; label_bias (K,) is added to the summed logits.
  `run_datas` holds one RunData per validation split (`num_splits`): "validation" is the mean of
  the float metrics over the splits, each scored by that split's models on its own held-out part;
  "test" sums every split's models."""
  loaded = {}
  mesh_of = {}

  def models(names, i):
    for n in names:
      if (i, n) not in loaded:
        cfg = with_overrides(configs[n], split_fields(configs[n], i))
        mesh_of.setdefault("mesh", sharding.make_mesh(cfg.mesh.shape))
        loaded[(i, n)] = ensemble.load_member(cfg, split_dir(workdir, i) / "candidates" / n,
                                              mesh_of["mesh"], run_datas[0].num_features)
    return [loaded[(i, n)] for n in names]

  def score(names, splits, run_data, split, label_bias):
    members = [m for i in splits for m in models(names, i)]
    return ensemble.make_ensemble_evaluate(configs[names[0]], run_data, split, [m[0] for m in members],
                                           members[0][1], mesh_of["mesh"], label_bias=label_bias)()

  def evaluate(names, split, label_bias=None):
    if split != "validation" or len(run_datas) == 1:
      return score(names, range(len(run_datas)), run_datas[0], split, label_bias)
    each = [score(names, [i], run_datas[i], split, label_bias) for i in range(len(run_datas))]
    return {k: float(np.mean([e[k] for e in each])) for k, v in each[0].items() if isinstance(v, float)}

  return evaluate


def _ensemble_or_load(config, run_datas, table, configs, workdir, max_members) -> dict:
  """`choose_ensemble`, or its record in workdir/ensemble.json when it was made for the same
  candidates (same validation order), recipe.ensemble and number of validation splits."""
  path = workdir / "ensemble.json"
  order = ensemble_order(table)[:max_members]
  if path.exists():
    saved = json.loads(path.read_text())
    if (saved.get("order") == order and saved.get("max_members") == max_members
        and saved.get("select_metric") == config.eval.select_metric
        and saved.get("splits", 1) == len(run_datas)):
      logging.info("[ensemble] reusing %s", path)
      return saved
  record = choose_ensemble(config, run_datas, table, configs, workdir, max_members)
  logging.info("[ensemble] validation %s per m = 1..%d: %s; chosen m = %d", config.eval.select_metric,
               max_members, [round(v["value"], 4) for v in record["validation"]], record["m"])
  if is_writer():
    write_text(path, json.dumps(record, indent=2, sort_keys=True))
  return record


def _as_splits(run_datas) -> list:
  """One RunData per validation split: a list as given, a single RunData (or None) as one split."""
  return list(run_datas) if isinstance(run_datas, (list, tuple)) else [run_datas]


def _fields(config):
  return [f"{s}.{n}" for s in config.keys() if hasattr(config[s], "keys") for n in config[s].keys()
          if not hasattr(config[s][n], "keys")]
