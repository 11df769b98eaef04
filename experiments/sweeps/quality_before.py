r"""The "before" row of results/quality.md: experiments/configs/default.py as a new user ran it.

  python -m experiments.ablate --sweep=experiments/sweeps/quality_before.py:delicious \
      --workdir=/tmp/quality/before_delicious
"""

from experiments.sweeps.spec import Point, Sweep


def get_sweep(arg: str = "bibtex") -> Sweep:
  dataset = arg or "bibtex"
  return Sweep(
      title=f"default.py on {dataset} (SNM top-1 tower, no validation split)",
      config="experiments/configs/default.py",
      points=(Point("default", {"dataset.name": dataset}, "default.py"),),
      seeds=(0, 1, 2),
  )
