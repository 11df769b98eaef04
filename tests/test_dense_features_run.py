"""Dense features end to end through `train_and_evaluate` (config.task="classification"):
Gaussian-cluster embeddings in .npy files with CSR .npz labels, model.kind=mlp on DenseBatcher
batches. It learns (P@1 far above chance, with a validation carve); on 8 forced CPU devices a
(2, 4) run equals the 1-device run, and a run resumed from its checkpoint ends on the same bits."""
import json
import shutil

import jax
import numpy as np
import pytest
import scipy.sparse as sp

from experiments.configs import default
from experiments.sweeps.spec import apply_overrides
from snm_jax import sharding
from snm_jax.train.trainer.loop import train_and_evaluate

K, D = 50, 32


def _write_clusters(root, k=K, d=D, n_train=2000, n_test=500, noise=1.0, seed=0):
  """k Gaussian clusters (centres N(0, I_d), within-cluster std `noise`), one label per point.
  Nearest-centroid accuracy on the test points is 0.99; chance is 1 / k."""
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(k, d))
  for n, split in ((n_train, "train"), (n_test, "test")):
    y = rng.integers(0, k, n)
    np.save(root / f"{split}_x.npy", (centres[y] + noise * rng.normal(size=(n, d))).astype(np.float32))
    sp.save_npz(root / f"{split}_y.npz",
                sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), y)), shape=(n, k)))


def _config(root, **overrides):
  c = default.get_config("paper,runlocal")
  files = {f"dataset.files.{split}_{what}": str(root / f"{split}_{suffix}")
           for split in ("train", "test") for what, suffix in (("features", "x.npy"), ("labels", "y.npz"))}
  base = {"dataset.name": "files", **files, "model.kind": "mlp", "mesh.shape": (1, 1),
          "train.batch_size": 64, "mining.num_samples": 32, "mining.k": 4, "train.log_every": 50,
          "train.eval_every": 0, "train.checkpoint_every": 0, "eval.max_examples": 0}
  return apply_overrides(c, {**base, **overrides})


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
  root = tmp_path_factory.mktemp("clusters")
  _write_clusters(root)
  return root


def test_mlp_on_dense_files_learns_the_clusters(clusters, tmp_path):
  res = train_and_evaluate(_config(clusters, **{"train.num_steps": 300, "train.eval_every": 150,
                                                "dataset.validation_fraction": 0.1}), tmp_path)
  # Measured 0.79-0.83 over 3 data and run seeds (nearest centroid: 0.99; chance 1/K = 0.02).
  assert res["final"]["P@1"] >= 0.6, res["final"]
  assert res["final"]["P@5"] >= 0.18  # at most 0.2 with one label per point
  assert res["dataset"] == "files" and res["num_labels"] == K
  assert res["truncation"]["max_nnz"] == D and res["truncation"]["dataset_rows"] == 1800  # 10% carved
  assert res["selected"]["step"] in (150, 300)
  assert any("val/P@1" in h for h in res["history"])
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["model"]["kind"] == "mlp" and saved["dataset"]["files"]["train_features"].endswith("train_x.npy")


STEPS = 8
# As tests/test_sharded_eval_and_restore.py: the (2, 4) and (1, 1) runs differ only in float
# summation order.
ATOL = 1e-5


def _losses(workdir):
  return np.array([r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
                   if "loss" in r])


def test_sharded_dense_run_equals_the_single_device_run_and_resumes_bitwise(clusters, tmp_path):
  over = {"train.num_steps": STEPS, "train.log_every": 1, "train.checkpoint_every": STEPS // 2,
          "model.dropout": 0.2, "model.feature_dropout": 0.1, "eval.max_examples": 128}
  sharded, sh_state = train_and_evaluate(_config(clusters, **over, **{"mesh.shape": (2, 4)}),
                                         tmp_path / "sharded", return_state=True)
  single, one_state = train_and_evaluate(_config(clusters, **over), tmp_path / "single", return_state=True)
  assert sharded["mesh"] == {"data": 2, "model": 4}
  sharding.assert_table_sharded(sh_state.table, sharding.make_mesh((2, 4)))
  np.testing.assert_allclose(_losses(tmp_path / "sharded"), _losses(tmp_path / "single"), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(sh_state), jax.tree.leaves(one_state), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=ATOL)
  for name in ("P@1", "P@5"):
    assert abs(sharded["final"][name] - single["final"][name]) <= 1 / 128, name

  # The (2, 4) run's step-4 checkpoint (tower, table and the DenseBatcher's position), resumed.
  (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
  shutil.copytree(tmp_path / "sharded" / "checkpoints" / str(STEPS // 2),
                  tmp_path / "resumed" / "checkpoints" / str(STEPS // 2))
  resumed = train_and_evaluate(_config(clusters, **over, **{"mesh.shape": (2, 4)}), tmp_path / "resumed")
  assert resumed["state_fingerprint"] == sharded["state_fingerprint"]
  np.testing.assert_array_equal(_losses(tmp_path / "resumed"), _losses(tmp_path / "sharded")[STEPS // 2:])
