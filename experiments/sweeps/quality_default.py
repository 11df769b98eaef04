r"""The "default.py" row of results/quality.md: experiments/configs/default.py as a new user runs it
(one SNM-tower model, settings derived from the data, the checkpoint chosen on validation nDCG@5).

  python -m experiments.ablate --sweep=experiments/sweeps/quality_default.py:bibtex \
      --workdir=/tmp/quality/default_bibtex
"""

from experiments.sweeps.spec import Point, Sweep


def get_sweep(arg: str = "bibtex") -> Sweep:
  dataset = arg or "bibtex"
  return Sweep(
      title=f"default.py on {dataset} (one SNM-tower model chosen on validation)",
      config="experiments/configs/default.py",
      points=(Point("default", {"dataset.name": dataset}, "default.py"),),
      seeds=(0, 1, 2),
  )
