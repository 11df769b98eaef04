"""snm_jax.adversarial.cache: a fitted tree is stored under the hash of its inputs, and a run that
finds it loads the identical tree (same trained state, the original fit's seconds reported)."""

import json

import numpy as np
import pytest
import scipy.sparse as sp

from experiments.configs import adversarial
from snm_jax.adversarial import cache
from snm_jax.adversarial.fit import LevelReport
from snm_jax.adversarial.tree import ProbabilisticTree
from snm_jax.train.config.overrides import apply_overrides
from snm_jax.train.recipes.runs import train


@pytest.fixture
def tree_cache(tmp_path):
  previous = cache.use_tree_cache(tmp_path / "trees")
  yield tmp_path / "trees"
  cache.use_tree_cache(previous)


def test_key_covers_every_input_of_the_fit():
  rng = np.random.default_rng(0)
  x = sp.random(20, 30, density=0.2, format="csr", random_state=0, dtype=np.float32)
  y = rng.integers(0, 8, 20)
  settings = dict(pca_dim=4, reg=0.1, max_reassign_iters=1000)
  key = cache.fit_key(x, y, 8, **settings)
  assert key == cache.fit_key(x.copy(), y.copy(), 8, **settings)
  x2 = x.copy()
  x2.data[3] += 1e-6
  y2 = y.copy()
  y2[5] = (y2[5] + 1) % 8
  others = [cache.fit_key(x2, y, 8, **settings), cache.fit_key(x, y2, 8, **settings),
            cache.fit_key(x, y, 9, **settings), cache.fit_key(x, y, 8, **{**settings, "reg": 0.2}),
            cache.fit_key(x, y, 8, **{**settings, "pca_dim": 5}),
            cache.fit_key(x.toarray(), y, 8, **settings)]
  assert len({key, *others}) == 1 + len(others)


def test_store_and_load_round_trip(tree_cache):
  tree = ProbabilisticTree(weights_Lxk=np.arange(8, dtype=np.float32).reshape(4, 2),
                           biases_L=np.ones(4, np.float32), leaf_of_label_C=np.array([2, 3], np.int32),
                           label_of_leaf_L=np.array([-1, -1, 0, 1], np.int32))
  reports = [LevelReport(level=0, iterations=3, labels_moved_last=0, seconds=0.5)]
  assert cache.load("k") is None
  cache.store("k", tree, reports, 12.5)
  got, got_reports, seconds = cache.load("k")
  for name in ("weights_Lxk", "biases_L", "leaf_of_label_C", "label_of_leaf_L"):
    np.testing.assert_array_equal(getattr(got, name), getattr(tree, name))
    assert getattr(got, name).dtype == getattr(tree, name).dtype
  assert got.proj_mean_d is None and got_reports == reports and seconds == 12.5
  cache.use_tree_cache(None)
  assert cache.load("k") is None  # no cache set: nothing is read


def _tree_run():
  c = adversarial.get_config("synthetic,runlocal")
  return apply_overrides(c, {"dataset.synthetic.num_labels": 64, "dataset.synthetic.num_train": 600,
                             "dataset.synthetic.num_test": 64, "dataset.synthetic.dim": 8,
                             "adversarial.pca_dim": 4, "mining.num_samples": 4, "train.num_steps": 6,
                             "train.eval_every": 0, "train.checkpoint_every": 0, "mesh.shape": (1, 1),
                             "eval.max_examples": 0})


def test_a_second_run_loads_the_identical_tree(tree_cache, tmp_path):
  first = train(_tree_run(), tmp_path / "a")
  assert first["tree_from_cache"] is False and len(list(tree_cache.glob("*.json"))) == 1
  second = train(_tree_run(), tmp_path / "b")
  assert second["tree_from_cache"] is True
  assert second["state_fingerprint"] == first["state_fingerprint"]
  assert second["tree_fit_seconds"] == first["tree_fit_seconds"] > 0
  assert second["tree_rounds_per_level"] == first["tree_rounds_per_level"]
  stored = json.loads(next(tree_cache.glob("*.json")).read_text())
  assert stored["fit_seconds"] == first["tree_fit_seconds"]
