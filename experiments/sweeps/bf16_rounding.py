r"""How `table.rounding`'s default was chosen: a bfloat16 class table rounded to nearest vs
stochastically, against float32, on Bibtex's VALIDATION split.

  python -m experiments.ablate --sweep=experiments/sweeps/bf16_rounding.py --workdir=/tmp/bf16_rounding
  python -m experiments.report /tmp/bf16_rounding --out=results/bf16_rounding   # its validation table

SNM top-16 (`snm.py:bibtex`: B = 64 uniform negatives, table SGD at 0.5 on L2-normalised rows, whose
updates are often below half a bfloat16 ulp of the entry), 10% of the training file held out
(`dataset.validation_fraction`); the choice reads only the validation metrics of the last evaluation
at the selected step (the report's validation table; the test split is not read to choose).
"""

from experiments.sweeps.spec import Point, Sweep

BF16 = {"model.dtype": "bfloat16", "table.dtype": "bfloat16"}


def get_sweep(arg: str = "") -> Sweep:
  del arg
  return Sweep(
      title="bfloat16 class table: round to nearest vs stochastic rounding (Bibtex, validation)",
      config="experiments/configs/snm.py:bibtex,k=16",
      base_overrides={"dataset.validation_fraction": 0.1},
      points=(Point("float32", {}, "float32"),
              Point("bf16_nearest", {**BF16, "table.rounding": "nearest"}, "bfloat16, nearest"),
              Point("bf16_stochastic", {**BF16, "table.rounding": "stochastic"}, "bfloat16, stochastic")),
      seeds=(0, 1, 2),
      baseline="float32",
      notes="Bibtex, SNM top-16, 1,000 steps of 128; chosen on the 10% validation split.",
  )
