r"""A development copy of a dataset: its training file split in two, the real test split left unread.

  python -m experiments.carve --dataset=bibtex --seed=0 --out=/tmp/carve0
  python -m experiments.train --config=experiments/configs/xmc.py:bibtex \
      --config.dataset.data_dir=/tmp/carve0 --workdir=/tmp/dev_run     # a recipe change, tried

Writes OUT/<dataset>/<dataset>_train.txt and _test.txt (XC format): the held-out `--fraction` of
the training file (the rows `snm_jax.data.split_validation` picks for `--seed`) as the "test" split,
the rest as the training split. A recipe change is chosen on such carves (their held-out part is
the test), so the real test split is never read to choose; results/quality.md and the recipe's
comments cite carves made this way ("90/10 carves of the training files").
"""

from __future__ import annotations

from absl import app, flags

from snm_jax import data as snm_data
from snm_jax.data.xc_format import write_xc
from snm_jax.train.runtime.workpath import workdir_path


def _define_flags():
  """Defined only when run as a program (tests import this module beside other absl apps)."""
  flags.DEFINE_string("dataset", None, "Dataset name the loader finds (e.g. bibtex).")
  flags.DEFINE_string("data_dir", "", "Where to look for it (default: the loader's places).")
  flags.DEFINE_float("fraction", 0.1, "Share of the training file held out as the carve's test.")
  flags.DEFINE_integer("seed", 0, "Seed of the held-out rows (split_validation's).")
  flags.DEFINE_string("out", None, "Folder to write <dataset>/<dataset>_{train,test}.txt into.")
  flags.mark_flags_as_required(["dataset", "out"])


def carve(name: str, out, fraction: float = 0.1, seed: int = 0, data_dir=None):
  """Writes the carve (module docstring); returns its folder, OUT/<name>."""
  train = snm_data.load_dataset(name, "train", data_dir=data_dir or None)
  kept, held_out = snm_data.split_validation(train, fraction, seed)
  folder = workdir_path(out) / name
  folder.mkdir(parents=True, exist_ok=True)
  write_xc(folder / f"{name}_train.txt", kept.features, kept.labels)
  write_xc(folder / f"{name}_test.txt", held_out.features, held_out.labels)
  return folder


def main(argv):
  del argv
  f = flags.FLAGS
  print(carve(f.dataset, f.out, f.fraction, f.seed, f.data_dir))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
