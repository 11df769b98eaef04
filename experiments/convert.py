r"""Writes a dataset into ArrayRecord shards that runs read by index (`dataset.format=sharded`).

  # A dataset the loader finds (XC text, the bundled Bibtex), with the validation carve a run uses:
  python -m experiments.convert --dataset=bibtex --out=/tmp/bibtex_shards --validation_fraction=0.1
  python -m experiments.train --config=experiments/configs/default.py --workdir=/tmp/run \
      --config.dataset.format=sharded --config.dataset.shards=/tmp/bibtex_shards

  # Synthetic sparse rows of any size, generated and written one chunk at a time:
  python -m experiments.convert --synthetic_rows=10000000 --out=gs://bucket/synthetic_10m --num_shards=64

--out may be local or any URI etils.epath writes (gs://...). The shards hold every row of each split
(training splits: every row with a label), in order; metadata.json and train_label_counts.npy hold
what a run needs from the whole training file (label counts, nnz and label-set histograms),
accumulated while writing. Memory: a named dataset is loaded whole (as a run loads it); synthetic
rows use one chunk (--chunk_rows) plus the K label counts.
"""

from __future__ import annotations

import json
import time

from absl import app, flags, logging

from snm_jax.data import convert


def _define_flags():
  flags.DEFINE_string("dataset", "", "Dataset name the loader finds (e.g. bibtex); or use --synthetic_rows.")
  flags.DEFINE_string("data_dir", "", "Where to look for --dataset (default: the loader's places).")
  flags.DEFINE_integer("synthetic_rows", 0, "Training rows of synthetic sparse data (name synthetic_sparse).")
  flags.DEFINE_integer("synthetic_test_rows", 10_000, "Test rows of the synthetic data.")
  flags.DEFINE_integer("synthetic_features", 200_000, "d of the synthetic data.")
  flags.DEFINE_integer("synthetic_labels", 10_000, "K of the synthetic data.")
  flags.DEFINE_integer("synthetic_nnz", 64, "Feature entries per synthetic row (before deduplication).")
  flags.DEFINE_integer("seed", 0, "Seed of the synthetic rows.")
  flags.DEFINE_string("out", None, "Directory to write (local or gs://...).")
  flags.DEFINE_integer("num_shards", 8, "Files per split.")
  flags.DEFINE_integer("chunk_rows", 65_536, "Rows converted at a time.")
  flags.DEFINE_bool("normalize_rows", True, "L2-normalise the rows (a run's dataset.normalize_rows must match).")
  flags.DEFINE_float("validation_fraction", 0.0, "Share of the training file written as split "
                     "'validation' (as dataset.validation_fraction carves it; runs must set the same).")
  flags.DEFINE_integer("validation_seed", 0, "Seed of that carve (dataset.validation_seed).")
  flags.mark_flags_as_required(["out"])


def main(argv):
  del argv
  f = flags.FLAGS
  if bool(f.dataset) == bool(f.synthetic_rows):
    raise app.UsageError("give exactly one of --dataset and --synthetic_rows")
  t0 = time.perf_counter()
  if f.dataset:
    meta = convert.convert_named(f.dataset, f.out, data_dir=f.data_dir or None,
                                 normalize_rows=f.normalize_rows, validation_fraction=f.validation_fraction,
                                 validation_seed=f.validation_seed, num_shards=f.num_shards,
                                 chunk_rows=f.chunk_rows)
  else:
    if not f.normalize_rows or f.validation_fraction:
      raise app.UsageError("synthetic rows are written normalised and without a validation carve")
    meta = convert.convert_synthetic(f.out, num_rows=f.synthetic_rows, num_test_rows=f.synthetic_test_rows,
                                     num_features=f.synthetic_features, num_labels=f.synthetic_labels,
                                     nnz=f.synthetic_nnz, seed=f.seed, num_shards=f.num_shards,
                                     chunk_rows=f.chunk_rows)
  seconds = time.perf_counter() - t0
  rows = sum(s.num_rows for s in meta.splits.values())
  summary = {"out": f.out, "name": meta.name, "seconds": round(seconds, 2),
             "rows_per_second": round(rows / seconds, 1),
             "splits": {k: {"rows": v.num_rows, "files": len(v.files)} for k, v in meta.splits.items()}}
  logging.info("converted: %s", summary)
  print(json.dumps(summary))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
