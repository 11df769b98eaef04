"""The sharded input path: records, the converter, the Grain batcher over ArrayRecord shards, and
training through it (same batches, hence the same state, as the in-memory path)."""
import json

import numpy as np
import pytest
import scipy.sparse as sp

from snm_jax import data as snm_data
from snm_jax.data import convert, conversions, pipeline, records, shards, synthetic
from snm_jax.errors import ConfigError, DataFormatError
from snm_jax.train.trainer.loop import train_and_evaluate
from tests.run_configs import runlocal


def test_records_round_trip_sparse_and_dense():
  rng = np.random.default_rng(0)
  labels = [rng.integers(0, 50, rng.integers(0, 5)).astype(np.int32) for _ in range(20)]
  ids = [rng.integers(0, 900, rng.integers(0, 30)).astype(np.int32) for _ in range(20)]
  vals = [rng.standard_normal(i.size).astype(np.float32) for i in ids]
  big = 2 ** 33 + 7  # an example id past 32 bits
  block = records.decode([records.encode(big + r, labels[r], ids[r], vals[r]) for r in range(20)])
  np.testing.assert_array_equal(block.example_id, big + np.arange(20))
  for r in range(20):
    lab = block.label_ids[block.label_indptr[r]:block.label_indptr[r + 1]]
    np.testing.assert_array_equal(lab, labels[r])
    lo, hi = block.feat_indptr[r], block.feat_indptr[r + 1]
    np.testing.assert_array_equal(block.feat_ids[lo:hi], ids[r])
    np.testing.assert_array_equal(block.feat_vals[lo:hi], vals[r])
  x = rng.standard_normal((4, 6)).astype(np.float32)
  dense = records.decode([records.encode(r, labels[r], None, x[r]) for r in range(4)])
  np.testing.assert_array_equal(dense.dense, x)
  assert dense.feat_ids is None
  with pytest.raises(ValueError, match="mix sparse and dense"):
    records.decode([records.encode(0, labels[0], None, x[0]), records.encode(1, labels[1], ids[1], vals[1])])


@pytest.fixture(scope="module")
def bibtex_shards(tmp_path_factory):
  """Bibtex (bundled) converted with a 10% validation carve, 3 shards per split."""
  out = tmp_path_factory.mktemp("bibtex_shards")
  meta = convert.convert_named("bibtex", out, validation_fraction=0.1, validation_seed=2, num_shards=3,
                               chunk_rows=1000)
  return out, meta


def test_converted_bibtex_holds_the_in_memory_splits_and_statistics(bibtex_shards):
  out, meta = bibtex_shards
  train = snm_data.load_dataset("bibtex", "train")
  test = snm_data.load_dataset("bibtex", "test")
  part, validation = snm_data.split_validation(
      train.__class__(snm_data.l2_normalize_rows(train.features), train.labels, "bibtex", "train"), 0.1, 2)
  assert meta.splits["train"].num_rows == part.num_points and len(meta.splits["train"].files) == 3
  assert meta.train_file_points == train.num_points and meta.num_labels == train.labels.shape[1]
  # The whole training file's label counts (train + validation), as RunData.label_counts.
  np.testing.assert_array_equal(shards.read_label_counts(out), train.labels.getnnz(axis=0))
  np.testing.assert_array_equal(np.asarray(meta.splits["train"].nnz_histogram),
                                np.bincount(np.diff(part.features.indptr)))
  for split, want in (("validation", validation), ("test", test)):
    features, labels = shards.read_split(out, split)
    want_features = want.features if split == "validation" else snm_data.l2_normalize_rows(want.features)
    assert (features != want_features).nnz == 0 and (labels != want.labels).nnz == 0
    np.testing.assert_array_equal(features.indices, want_features.indices)  # stored order kept


def test_sharded_batches_equal_the_in_memory_batches_for_1_and_2_processes(bibtex_shards):
  out, _ = bibtex_shards
  features, labels = shards.read_split(out, "train")  # the same rows, in memory
  kw = dict(global_batch_size=64, max_nnz=40, max_labels=4, seed=5)
  for conversion in ("sample_one_positive", "first_label"):
    ref = pipeline.SparseBatcher(features, labels, conversion, process_index=0, process_count=1, **kw)
    halves = [pipeline.SparseBatcher(pipeline.ShardedRows(out, "train"), None, conversion,
                                     process_index=p, process_count=2, read_threads=1, **kw)
              for p in range(2)]
    steps = ref.steps_per_epoch()
    for _ in range(steps + 3):  # across an epoch boundary
      want = next(ref)
      got = [next(h) for h in halves]
      for key in pipeline.BATCH_KEYS:
        np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key], err_msg=key)
    assert ref.stats == {**halves[0].stats, "epoch_examples": ref.stats["epoch_examples"],
                         "epoch_rows_truncated": ref.stats["epoch_rows_truncated"],
                         "epoch_nnz_dropped": ref.stats["epoch_nnz_dropped"],
                         "epoch_label_sets_truncated": ref.stats["epoch_label_sets_truncated"]}
    # Resume mid-epoch from the JSON state, on one process.
    state = json.loads(json.dumps(ref.get_state()))
    assert state["grain"] == {"next_index": steps + 3}
    resumed = pipeline.SparseBatcher(pipeline.ShardedRows(out, "train"), None, conversion,
                                     process_index=0, process_count=1, **kw)
    resumed.set_state(state)
    for _ in range(2):
      want, got = next(ref), next(resumed)
      for key in pipeline.BATCH_KEYS:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  with pytest.raises(ValueError, match="per-row conversions"):
    pipeline.SparseBatcher(pipeline.ShardedRows(out, "train"), None, "expand_all_positives", **kw)


def test_the_sample_one_positive_draw_is_per_point_and_epoch():
  labels = sp.csr_matrix(np.array([[1, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]], np.float32))
  rows, lab = conversions.sample_one_positive(labels, seed=3, epoch=0)
  np.testing.assert_array_equal(rows, [0, 1, 3])
  assert lab[2] == 0 and lab[0] in (0, 1, 2) and lab[1] in (1, 3)
  # Uniform over a point's set: 3 labels over 3000 epochs.
  draws = np.array([conversions.sample_one_positive(labels, 3, e)[1][0] for e in range(3000)])
  counts = np.bincount(draws, minlength=3)
  assert counts.min() > 900 and counts.max() < 1100, counts
  u = conversions.uniform_per_example(7, 1, np.arange(100_000))
  assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005


def test_synthetic_chunks_convert_with_streamed_statistics(tmp_path):
  gen = dict(num_features=5000, num_labels=300, nnz=16, labels_per_row=3, chunk_rows=700)
  meta = convert.convert_synthetic(tmp_path, num_rows=2500, num_test_rows=300, num_shards=4, **gen)
  chunks = list(synthetic.sparse_row_chunks(2500, seed=0, **gen))
  assert [c[0].shape[0] for c in chunks] == [700, 700, 700, 400]
  labels = sp.vstack([c[1] for c in chunks], format="csr")
  np.testing.assert_array_equal(shards.read_label_counts(tmp_path), labels.getnnz(axis=0))
  assert meta.splits["train"].num_rows == 2500 and len(meta.splits["train"].files) == 4
  features, read_labels = shards.read_split(tmp_path, "train")
  want = snm_data.l2_normalize_rows(sp.vstack([c[0] for c in chunks], format="csr"))
  assert abs(features - want).max() == 0 and (read_labels != labels).nnz == 0
  # Learnable: a row's own-label feature block is over-represented.
  assert np.all(np.diff(labels.indptr) >= 1) and np.all(np.diff(features.indptr) <= 16)


def _run(tmp_path, name, **overrides):
  # Evaluations at steps 8 and 16 (24 steps, evaluated at 12 and 24, before 2026-11-28): on Bibtex's
  # carve validation P@1 selects the step-8 state, so the selected state scored on test is not the last.
  config = runlocal({"train.fingerprint": True, "train.num_steps": 16, "train.eval_every": 8,
                     "train.checkpoint_every": 8, **overrides})
  return train_and_evaluate(config, tmp_path / name)


def _diagnostics(workdir) -> list[dict]:
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if k.startswith("diag/")} for r in rows
          if any(k.startswith("diag/") for k in r)]


def test_training_through_the_shards_gives_the_in_memory_state(bibtex_shards, tmp_path):
  """The same state, selection, test metrics and sampler diagnostics (their probe: the first
  training points, read by index from the shards or cut from memory)."""
  out, _ = bibtex_shards
  carve = {"dataset.validation_fraction": 0.1, "dataset.validation_seed": 2, "eval.select_metric": "P@1",
           "diagnostics.every": 8, "diagnostics.probe_size": 32, "diagnostics.snr_draws": 2}
  memory = _run(tmp_path, "memory", **carve)
  sharded = _run(tmp_path, "sharded", **carve, **{"dataset.format": "sharded", "dataset.shards": str(out)})
  assert sharded["state_fingerprint"] == memory["state_fingerprint"]
  diagnosed = _diagnostics(tmp_path / "memory")
  assert len(diagnosed) == 2 and diagnosed[0]["diag/grad_snr"] > 0
  assert _diagnostics(tmp_path / "sharded") == diagnosed
  metrics = lambda r: {k: v for k, v in r["final"].items() if k != "eval_seconds"}  # noqa: E731
  assert metrics(sharded) == metrics(memory) and metrics(memory)["P@1"] > 0
  assert [sharded["selected"][k] for k in ("step", "value")] == [memory["selected"][k] for k in ("step", "value")]
  assert sharded["truncation"]["dataset_rows"] == memory["truncation"]["dataset_rows"]


def test_sharded_config_errors(bibtex_shards, tmp_path):
  out, _ = bibtex_shards
  cases = [
      ({"dataset.format": "sharded"}, "dataset.shards"),
      ({"dataset.shards": str(out)}, "dataset.shards"),
      ({"dataset.format": "sharded", "dataset.shards": str(out)}, "dataset.validation_fraction"),
      ({"dataset.format": "sharded", "dataset.shards": str(out), "dataset.validation_fraction": 0.1,
        "dataset.validation_seed": 3}, "dataset.validation_seed"),
      ({"dataset.format": "sharded", "dataset.shards": str(out), "dataset.conversion": "expand_all_positives"},
       "dataset.conversion"),
      ({"dataset.format": "sharded", "dataset.shards": str(out), "dataset.name": "delicious"}, "dataset.name"),
      ({"dataset.format": "sharded", "dataset.shards": str(tmp_path / "none")}, "dataset.shards"),
      ({"dataset.format": "parquet"}, "dataset.format"),
  ]
  for overrides, field in cases:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
      train_and_evaluate(runlocal(overrides), tmp_path / "bad")
  with pytest.raises(DataFormatError, match="metadata.json"):
    shards.read_metadata(tmp_path)


def test_the_recipe_reads_the_shards_as_it_reads_memory(bibtex_shards, tmp_path, optimized):
  """xmc.py's seconds-long variant through the shards: the statistics from the metadata's histograms,
  the same candidates, choice and test metrics as in memory (the same batches); one validation split."""
  from experiments.configs import xmc  # pylint: disable=g-import-not-at-top
  from snm_jax.train.config.overrides import with_overrides  # pylint: disable=g-import-not-at-top
  from snm_jax.train.recipes import recipe  # pylint: disable=g-import-not-at-top
  from snm_jax.train.trainer.run_data import load_run_data  # pylint: disable=g-import-not-at-top
  out, _ = bibtex_shards
  base = with_overrides(xmc.get_config("bibtex,runlocal"), {"dataset.validation_seed": 2, "recipe.splits": -1,
                                                          "recipe.ensemble": 1})  # (no ensemble to score)
  sharded = with_overrides(base, {"dataset.format": "sharded", "dataset.shards": str(out)})
  want, got = (recipe.DataStats.of(load_run_data(c)) for c in (base, sharded))
  # The logit-adjustment prior's counts on shards (the whole file's less the validation carve's) are
  # the in-memory training part's.
  mem, sh = load_run_data(base), load_run_data(sharded)
  np.testing.assert_array_equal(sh.label_counts - sh.validation.labels.getnnz(axis=0),
                                mem.train.labels.getnnz(axis=0))
  assert (got.num_train, got.num_features, got.num_labels) == (want.num_train, want.num_features, want.num_labels)
  assert got.labels_per_point == pytest.approx(want.labels_per_point, rel=1e-12)
  assert got.nnz_per_point == pytest.approx(want.nnz_per_point, rel=1e-12)
  through = recipe.run(sharded, tmp_path / "sharded")
  # In memory Bibtex's 488 validation points take 3 splits (recipe.splits=-1); the shards hold one carve.
  assert recipe.num_splits(base, load_run_data(base).validation.num_points) == 3
  assert through["recipe"]["splits"] == 1
  one_split = recipe.run(with_overrides(base, {"recipe.splits": 1}), tmp_path / "memory1")
  assert through["recipe"]["derived"] == one_split["recipe"]["derived"]
  assert [c["name"] for c in through["recipe"]["candidates"]] == [c["name"] for c in one_split["recipe"]["candidates"]]
  assert through["recipe"]["chosen"] == one_split["recipe"]["chosen"]
  drop = lambda r: {k: v for k, v in r["final"].items() if k != "eval_seconds"}  # noqa: E731
  assert drop(through) == drop(one_split) and drop(through)["P@1"] > 0.2
  from snm_jax.train.recipes import runs  # pylint: disable=g-import-not-at-top
  for field, value in (("recipe.splits", 2), ("recipe.refit", True)):  # refused before any loading
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
      runs.train(with_overrides(sharded, {field: value}), tmp_path / "bad")
  # The auto search's one-vs-rest candidate lists every (point, positive) pair up front: not on shards.
  stats = recipe.DataStats.of(load_run_data(sharded))
  full = with_overrides(sharded, {"recipe.search": "auto"})
  assert recipe.ovr_settings(full, stats, recipe.derive(full, stats)) is None
  assert recipe.ovr_settings(with_overrides(base, {"recipe.search": "auto"}), stats,
                             recipe.derive(full, stats)) is not None


def test_the_tree_sampler_fits_on_a_sample_read_from_the_shards(bibtex_shards, tmp_path):
  """adversarial.fit_max_points = n: the tree is fitted on n seeded training points, read by index
  from the shards or cut from memory: the same tree, hence the same trained state. Without a bound
  the sharded run is refused (its training split is never loaded whole).

  The runs share a tree cache (snm_jax/adversarial/cache.py), keyed on the SHA-256 of everything the
  fit reads (the sampled rows' features and labels, bit for bit, with their shapes and dtypes): the
  sharded run finds the memory run's fit only if it read the very points memory cut, and is then
  spared a second fit, a PCA of Bibtex's 1836 features and the greedy tree (the same pure function
  of the same inputs; a hit's tree is the fitted one: test_tree_cache.py)."""
  from experiments.configs import adversarial  # pylint: disable=import-outside-toplevel
  from snm_jax.adversarial import cache  # pylint: disable=import-outside-toplevel
  from snm_jax.train.config.overrides import apply_overrides  # pylint: disable=import-outside-toplevel
  from snm_jax.train.trainer.classification import tree_fit_sample  # pylint: disable=import-outside-toplevel
  out, meta = bibtex_shards
  rows = tree_fit_sample(meta.splits["train"].num_rows, 1500, 0)
  assert rows.size == 1500 and np.all(np.diff(rows) > 0)
  assert tree_fit_sample(100, 0, 0) is None and tree_fit_sample(100, 100, 0) is None

  def run(name, **overrides):
    c = apply_overrides(adversarial.get_config("bibtex,method=adversarial,runlocal"), {
        "dataset.validation_fraction": 0.1, "dataset.validation_seed": 2, "eval.select_metric": "P@1",
        "adversarial.pca_dim": 4, "mesh.shape": (1, 1), "train.num_steps": 12, "train.eval_every": 6,
        "train.checkpoint_every": 0, "train.fingerprint": True, "eval.max_examples": 200,
        "adversarial.fit_max_points": 1500, **overrides})
    return train_and_evaluate(c, tmp_path / name)

  previous = cache.use_tree_cache(tmp_path / "tree_cache")
  try:  # (one BLAS thread for the fit's PCA, as for every test: tests/conftest.py)
    memory = run("memory")
    sharded = run("sharded", **{"dataset.format": "sharded", "dataset.shards": str(out)})
  finally:
    cache.use_tree_cache(previous)
  assert memory["tree_from_cache"] is False and sharded["tree_from_cache"] is True  # the same sample
  assert sharded["state_fingerprint"] == memory["state_fingerprint"]
  assert sharded["tree_rounds_per_level"] == memory["tree_rounds_per_level"]
  with pytest.raises(ConfigError, match=r"adversarial\.fit_max_points"):
    run("unbounded", **{"dataset.format": "sharded", "dataset.shards": str(out),
                        "adversarial.fit_max_points": 0})
