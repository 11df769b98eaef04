r"""The quality issue's measurements: the xmc recipe and the regularised SNM tower, 3 seeds.

  python -m experiments.ablate --sweep=experiments/sweeps/quality.py:bibtex --workdir=/tmp/quality/bibtex
  python -m experiments.ablate --sweep=experiments/sweeps/quality.py:delicious --workdir=/tmp/quality/delicious
  python -m experiments.quality_report --workdirs=/tmp/quality --out=results/quality.md

Every run is a recipe (experiments/configs/xmc.py): settings derived from the data and
candidates chosen on a validation split carved from the training file. Points:
  xmc         the recipe as shipped (linear and wide-and-deep softmax candidates x 3 learning rates
              and the one-vs-rest linear candidate "ovr", chosen on validation nDCG@5, then the
              ensemble of the top m <= 3 of them with m chosen on validation; its "no ensemble" row
              is the best candidate alone, re-read from its runs);
  xmc_no_ovr  the recipe without the one-vs-rest candidate (the 6 softmax candidates; their runs are
              xmc's, copied: only the ensemble step differs);
  xmc_select_p1  the softmax candidates chosen on validation P@1 (the recipe's earlier metric);
  tower_recipe  the papers' SNM tower alone through the recipe as shipped (model.kind=snm_tower:
              its tower settings, recipes.KIND_SETTINGS; its table learning rates, validation splits
              and ensemble step); its "one model" row is the best candidate of split 0 alone;
  tower       the SNM tower alone as first measured: one validation split, selection on P@1, no
              ensemble step;
  tower_narrow  the tower with the recipe's earlier settings (256/128, dropout 0.3, scores x10):
              what the width and score scale contribute;
  tower_nodo  that narrow tower without dropout (the "before regularisation" learning curves;
              selection still applies, and each run's results also hold its last state's metrics).
"""

from experiments.sweeps.spec import Point, Sweep

DATASETS = ("bibtex", "delicious")
# The recipe selected candidates and checkpoints on validation P@1 before it chose nDCG@5 (xmc.py); the
# tower rows were measured that way.
# Those rows predate the recipe's ensemble step too (recipe.ensemble=1: the best candidate alone).
SELECT_P1 = {"eval.select_metric": "P@1", "recipe.ensemble": 1}
# The recipe's auto search before the one-vs-rest candidate (recipes.OVR_SEARCH) joined it: the
# xmc_no_ovr ablation, and xmc_select_p1, which was measured with it.
SOFTMAX_SEARCH = "model.kind=linear,wide_deep;table.learning_rate*=0.5,1,2"
# The SNM tower as the recipe set it before the width / scale change.
NARROW = {"model.kind": "snm_tower", "model.hidden": 256, "model.out": 128, "loss.logit_scale": 10.0}


def get_sweep(arg: str = "bibtex") -> Sweep:
  dataset = arg or "bibtex"
  if dataset not in DATASETS:
    raise ValueError(f"quality.py:{dataset}: choose one of {DATASETS}")
  return Sweep(
      title=f"Quality on {dataset}: the xmc recipe and the regularised SNM tower",
      config=f"experiments/configs/xmc.py:{dataset}",
      points=(
          Point("xmc", {}, "xmc recipe"),
          Point("xmc_no_ovr", {"recipe.search": SOFTMAX_SEARCH},
                "xmc recipe without the one-vs-rest candidate"),
          Point("xmc_select_p1", {**SELECT_P1, "recipe.search": SOFTMAX_SEARCH},
                "xmc recipe, selecting on validation P@1"),
          Point("tower_recipe", {"model.kind": "snm_tower"},
                "SNM tower through the recipe (model.kind=snm_tower)"),
          Point("tower", {"model.kind": "snm_tower", **SELECT_P1},
                "SNM tower (1024/512, dropout 0.5, x20, selection on P@1)"),
          Point("tower_narrow", {**NARROW, "model.dropout": 0.3, **SELECT_P1},
                "SNM tower (256/128, dropout 0.3, x10, selection on P@1)"),
          Point("tower_nodo", {**NARROW, "model.dropout": 0.0, **SELECT_P1},
                "SNM tower (256/128, no dropout, x10)"),
      ),
      seeds=(0, 1, 2),
      notes=(f"{dataset}: 10% of the training file held out for validation (seed 0); every choice "
             "(candidate, checkpoint) made on it; test metrics of the chosen state."),
  )
