r"""The "before" row of results/quality.md: experiments/configs/default.py as a new user ran it
before it became one SNM-tower model chosen on validation; those settings are default.py:paper now.

  python -m experiments.ablate --sweep=experiments/sweeps/quality_before.py:delicious \
      --workdir=/tmp/quality/before_delicious
"""

from experiments.sweeps.spec import Point, Sweep


def get_sweep(arg: str = "bibtex") -> Sweep:
  dataset = arg or "bibtex"
  return Sweep(
      title=f"default.py:paper on {dataset} (SNM top-1 tower, no validation split)",
      config="experiments/configs/default.py:paper",
      points=(Point("default", {"dataset.name": dataset}, "default.py:paper"),),
      seeds=(0, 1, 2),
  )
