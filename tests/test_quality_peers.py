"""benchmarks/quality_peers.py on a tiny synthetic XC problem: the evaluation path goes
through the library's `multilabel_metrics`, and the popularity baseline's P@1 is checked
against a direct count. Peers whose packages are missing are skipped with a reason."""

import importlib.util
import subprocess

import numpy as np
import pytest
import scipy.sparse as sp

from benchmarks import quality_peers as qp
from snm_jax import data as snm_data
from snm_jax.train.core import evaluate as snm_evaluate

NUM_LABELS, DIM = 8, 24


def _split(rng, n, split):
  """Label l has probability ~ 1/(l+1) (label 0 the most frequent); features are noisy
  indicators of the labels (3 feature columns per label), so the classifiers can learn."""
  probs = 0.9 / (1.0 + np.arange(NUM_LABELS))
  y = rng.random((n, NUM_LABELS)) < probs
  y[~y.any(axis=1), NUM_LABELS - 1] = True  # every point has a label
  x = np.repeat(y, 3, axis=1).astype(np.float32) * rng.uniform(0.5, 1.5, (n, DIM))
  x += (rng.random((n, DIM)) < 0.1) * rng.uniform(0, 1, (n, DIM))
  return snm_data.XCDataset(features=snm_data.l2_normalize_rows(sp.csr_matrix(x)),
                            labels=sp.csr_matrix(y.astype(np.float32)), name="tiny", split=split)


@pytest.fixture(scope="module")
def problem():
  rng = np.random.default_rng(0)
  return _split(rng, 300, "train"), _split(rng, 120, "test")


@pytest.fixture
def spy(monkeypatch):
  calls = []
  real = snm_evaluate.multilabel_metrics

  def wrapper(pred, labels, propensities, k_max):
    calls.append({"pred": np.asarray(pred).copy(), "labels": labels, "k_max": k_max})
    return real(pred, labels, propensities, k_max)

  monkeypatch.setattr(snm_evaluate, "multilabel_metrics", wrapper)
  return calls


def _check(res, name, spy_calls, test, index=0):
  """Method `name`'s result, checked; it was the `index`-th method evaluated on the test labels."""
  r = res["methods"][name]
  assert r["status"] == "ok", r
  for key in qp.TABLE_METRICS:
    assert 0.0 <= r["metrics"][key] <= 1.0, (name, key, r["metrics"][key])
  # The reported metrics are exactly those of the library's evaluate function on the test labels.
  mine = [c for c in spy_calls if c["labels"].shape == test.labels.shape and
          (c["labels"] != test.labels).nnz == 0]
  assert len(mine) > index, f"{name}: multilabel_metrics was not called on the test labels"
  call = mine[index]
  assert call["k_max"] == 5 and call["pred"].shape == (test.labels.shape[0], 5)
  again = snm_evaluate.multilabel_metrics(call["pred"], test.labels, qp.propensities_for(res["_train"]), 5)
  assert again == r["metrics"]
  return r


def test_popularity_p1_and_evaluation_path(problem, spy):
  train, test = problem
  res = qp.run_dataset(train, test, ["popularity"], log=lambda _: None)
  res["_train"] = train
  r = _check(res, "popularity", spy, test)
  counts = np.asarray(train.labels.getnnz(axis=0))
  top = int(np.argmax(counts))
  assert np.sum(counts == counts[top]) == 1  # a unique most frequent label
  expected_p1 = float(np.mean(test.labels[:, top].toarray().ravel() > 0))
  assert r["metrics"]["P@1"] == pytest.approx(expected_p1, abs=1e-6)  # float32 relevance
  assert r["settings"]["top_labels"][0] == top


def test_sklearn_one_vs_rest(problem, spy):
  pytest.importorskip("sklearn", reason="scikit-learn not installed")
  train, test = problem
  methods = ["popularity", "ovr_linearsvc", "ovr_logreg", "ovr_linearsvc_valC"]
  res = qp.run_dataset(train, test, methods, log=lambda _: None)
  res["_train"] = train
  pop = _check(res, "popularity", spy, test)["metrics"]
  for i, name in enumerate(methods[1:], start=1):
    m = _check(res, name, spy, test, index=i)["metrics"]
    assert m["P@1"] > pop["P@1"] + 0.1, (name, m, pop)  # learnable problem: beats popularity
  search = res["methods"]["ovr_linearsvc_valC"]["settings"]["c_search"]
  assert search["chosen_C"] in qp.C_GRID and len(search["points"]) == len(qp.C_GRID)


def test_validation_split_is_fixed_and_disjoint():
  a_fit, a_val = qp.validation_split(100)
  b_fit, b_val = qp.validation_split(100)
  assert np.array_equal(a_val, b_val) and len(a_val) == 20
  assert np.array_equal(np.union1d(a_fit, a_val), np.arange(100)) and not np.intersect1d(a_fit, a_val).size


def test_topk_helpers():
  scores = np.array([[0.1, 0.5, 0.5, -1.0, 0.2, 0.0]])
  assert qp.topk_from_scores(scores).tolist() == [[1, 2, 4, 0, 5]]  # ties: lower id first
  assert qp.topk_from_lists([[3, 1], []]).tolist() == [[3, 1, -1, -1, -1], [-1] * 5]
  s = sp.csr_matrix(np.array([[0, 0.3, 0, 0.9, 0.3, 0, 0]]))
  assert qp.topk_from_sparse_scores(s).tolist() == [[3, 1, 4, -1, -1]]


def test_napkinxc_plt(problem, spy):
  if importlib.util.find_spec("napkinxc") is None:
    pytest.skip("napkinxc not installed (pip install '.[peers]')")
  train, test = problem
  res = qp.run_dataset(train, test, ["napkinxc_plt"], log=lambda _: None)
  res["_train"] = train
  _check(res, "napkinxc_plt", spy, test)


def test_pecos_xrlinear(problem, spy):
  python = qp.pecos_python()
  probe = subprocess.run([python, "-c", "import pecos.xmc.xlinear.model"], capture_output=True,
                         check=False)
  if probe.returncode != 0:
    pytest.skip(f"libpecos not importable by {python} (needs numpy<2, scipy<1.14; set "
                "SNM_JAX_PECOS_PYTHON to such an interpreter, see benchmarks/quality_peers.py)")
  train, test = problem
  res = qp.run_dataset(train, test, ["pecos_xrlinear"], log=lambda _: None)
  res["_train"] = train
  _check(res, "pecos_xrlinear", spy, test)
