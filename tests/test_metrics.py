"""Ranking metrics vs scikit-learn, brute-force references and hand computations."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.metrics import average_precision_score, ndcg_score, top_k_accuracy_score

from snm_jax import metrics


def _random_xc(rng, n=60, num_labels=25, k_max=5, max_true=6):
  """Random multi-label data: padded truth, CSR truth, distinct top-k predictions."""
  true_sets = [rng.choice(num_labels, size=rng.integers(1, max_true + 1), replace=False)
               for _ in range(n)]
  padded = -np.ones((n, max_true), np.int64)
  for i, s in enumerate(true_sets):
    padded[i, :len(s)] = s
  csr = sp.csr_matrix((np.ones(sum(map(len, true_sets))),
                       (np.repeat(np.arange(n), [len(s) for s in true_sets]),
                        np.concatenate(true_sets))), shape=(n, num_labels))
  scores = rng.random((n, num_labels))
  # Make a correct top prediction likely so the metrics are not all near 0.
  for i, s in enumerate(true_sets):
    scores[i, s] += rng.random(len(s)) * 0.6
  pred = np.argsort(-scores, axis=1)[:, :k_max]
  return true_sets, padded, csr, scores, pred


def _brute(true_sets, pred, k_max, inv_p=None):
  """Per-point loops: P@k, R@k, nDCG@k, PSP@k numerator and its best value."""
  out = {m: np.zeros(k_max) for m in ("p", "r", "ndcg", "psp", "best")}
  n = len(true_sets)
  for i, s in enumerate(true_sets):
    s = set(int(x) for x in s)
    for k in range(1, k_max + 1):
      hits = [int(p) in s for p in pred[i, :k]]
      out["p"][k - 1] += sum(hits) / k / n
      out["r"][k - 1] += sum(hits) / len(s) / n
      dcg = sum(h / math.log2(r + 2) for r, h in enumerate(hits))
      idcg = sum(1 / math.log2(r + 2) for r in range(min(k, len(s))))
      out["ndcg"][k - 1] += dcg / idcg / n
      if inv_p is not None:
        out["psp"][k - 1] += sum(inv_p[p] for p, h in zip(pred[i, :k], hits) if h) / k / n
        out["best"][k - 1] += sum(sorted((inv_p[l] for l in s), reverse=True)[:k]) / k / n
  return out


def test_precision_recall_ndcg_psp_vs_brute_force_padded_and_sparse():
  rng = np.random.default_rng(0)
  true_sets, padded, csr, _, pred = _random_xc(rng)
  counts = np.asarray(csr.sum(0)).ravel() + rng.integers(0, 30, size=csr.shape[1])
  prop = metrics.jain_propensities(counts, 500)
  ref = _brute(true_sets, pred, 5, 1 / prop)
  for true in (padded, csr, jnp.asarray(padded)):
    np.testing.assert_allclose(metrics.precision_at_k(pred, true, 5), ref["p"], rtol=1e-12)
    np.testing.assert_allclose(metrics.recall_at_k(pred, true, 5), ref["r"], rtol=1e-12)
    np.testing.assert_allclose(metrics.ndcg_at_k(pred, true, 5), ref["ndcg"], rtol=1e-12)
    np.testing.assert_allclose(metrics.psp_at_k(pred, true, 5, prop, normalize=False),
                               ref["psp"], rtol=1e-12)
    np.testing.assert_allclose(metrics.psp_at_k(pred, true, 5, prop),
                               ref["psp"] / ref["best"], rtol=1e-12)
  assert 0.2 < ref["p"][0] < 0.95


def test_ndcg_vs_sklearn():
  rng = np.random.default_rng(1)
  _, _, csr, scores, pred = _random_xc(rng, k_max=6)
  for k in range(1, 7):
    want = ndcg_score(csr.toarray(), scores, k=k)
    np.testing.assert_allclose(metrics.ndcg_at_k(pred, csr, 6)[k - 1], want, rtol=1e-10)


def test_hand_computed_example():
  pred = np.array([[3, 1, 4], [0, 2, -1]])  # -1: fewer than 3 predictions
  true = np.array([[1, 4, -1, -1], [5, 0, 2, 9]])
  np.testing.assert_allclose(metrics.precision_at_k(pred, true, 3), [0.5, 0.75, 4 / 6])
  # recall: (0 + 1/4) / 2, (1/2 + 2/4) / 2, (2/2 + 2/4) / 2
  np.testing.assert_allclose(metrics.recall_at_k(pred, true, 3), [1 / 8, 1 / 2, 3 / 4])
  d = 1 / np.log2([2, 3, 4])
  want_ndcg = [(0 + 1) / 2,
               (d[1] / (d[0] + d[1]) + (d[0] + d[1]) / (d[0] + d[1])) / 2,
               ((d[1] + d[2]) / (d[0] + d[1]) + (d[0] + d[1]) / (d[0] + d[1] + d[2])) / 2]
  np.testing.assert_allclose(metrics.ndcg_at_k(pred, true, 3), want_ndcg)
  prop = np.full(10, 0.5)
  prop[4] = 0.25  # inverse propensity 4
  np.testing.assert_allclose(metrics.psp_at_k(pred, true, 1, prop, normalize=False), [(0 + 2) / 2])
  # best@1: point 0 -> label 4 (1/p = 4), point 1 -> 2 -> normalised 1 / 3
  np.testing.assert_allclose(metrics.psp_at_k(pred, true, 1, prop), [1 / 3])


def test_point_without_labels_counts_zero():
  pred = np.array([[0, 1], [2, 3]])
  true = np.array([[0], [-1]])
  np.testing.assert_allclose(metrics.precision_at_k(pred, true, 2), [0.5, 0.25])
  np.testing.assert_allclose(metrics.recall_at_k(pred, true, 2), [0.5, 0.5])
  np.testing.assert_allclose(metrics.ndcg_at_k(pred, true, 2), [0.5, 0.5])


def test_jain_propensities():
  counts = np.array([0, 1, 10, 1000])
  n = 2000
  c = (math.log(n) - 1) * (1.5 + 1) ** 0.55
  want = [1 / (1 + c * (x + 1.5) ** -0.55) for x in counts]
  np.testing.assert_allclose(metrics.jain_propensities(counts, n), want, rtol=1e-12)
  assert metrics.propensity_params("WikiLSHTC-325K") == (0.5, 0.4)
  assert metrics.propensity_params("Amazon-670K") == (0.6, 2.6)
  assert metrics.propensity_params("AmazonCat-13K") == (0.55, 1.5)
  assert metrics.propensity_params("bibtex") == (0.55, 1.5)
  p = metrics.jain_propensities(counts, n, *metrics.propensity_params("amazon-3m"))
  assert np.all(np.diff(p) > 0) and np.all((p > 0) & (p <= 1))


def test_retrieval_recall_vs_sklearn_top_k_accuracy():
  rng = np.random.default_rng(2)
  scores = rng.random((80, 12))
  y = rng.integers(0, 12, size=80)
  pred = np.argsort(-scores, axis=1)[:, :5]
  got = metrics.retrieval_recall_at_r(pred, y, 5)
  want = [top_k_accuracy_score(y, scores, k=r, labels=np.arange(12)) for r in range(1, 6)]
  np.testing.assert_allclose(got, want, rtol=1e-12)


def test_recall_curve_counts_first_hits_as_the_cumulative_sum_does():
  rng = np.random.default_rng(5)
  pred = rng.integers(0, 30, size=(400, 12))  # repeated ids and labels absent from the top 12
  y = rng.integers(0, 30, size=400)
  ranks = metrics.first_hit_rank(pred, y, 9)
  assert ranks.min() >= 0 and ranks.max() == 9 and (ranks < 9).any()
  want = np.mean(np.cumsum(pred[:, :9] == y[:, None], axis=1) > 0, axis=0)
  np.testing.assert_array_equal(metrics.recall_curve(ranks, 9), want)
  np.testing.assert_array_equal(metrics.retrieval_recall_at_r(pred, y, 9), want)


def test_average_precision_vs_sklearn_including_ties():
  rng = np.random.default_rng(3)
  per_query = []
  for q in range(20):
    n = rng.integers(5, 30)
    scores = rng.integers(0, 6, size=n).astype(float) if q % 2 else rng.normal(size=n)
    rel = rng.random(n) < 0.3
    rel[0] = True
    got = metrics.average_precision(scores, rel)
    np.testing.assert_allclose(got, average_precision_score(rel, scores), rtol=1e-12)
    per_query.append((scores, rel, got))
  scores, rels, aps = zip(*per_query)
  empty = (np.array([0.3, 0.1]), np.array([False, False]))
  assert math.isnan(metrics.average_precision(*empty))
  np.testing.assert_allclose(
      metrics.mean_average_precision(list(scores) + [empty[0]], list(rels) + [empty[1]]),
      np.mean(aps), rtol=1e-12)
  s2d, r2d = rng.normal(size=(4, 10)), rng.random((4, 10)) < 0.4
  r2d[:, 0] = True
  np.testing.assert_allclose(metrics.mean_average_precision(s2d, r2d),
                             np.mean([average_precision_score(r, s) for s, r in zip(s2d, r2d)]))
  # Hand value: relevant at ranks 1 and 3 -> (1 + 2/3) / 2.
  np.testing.assert_allclose(metrics.average_precision([0.9, 0.8, 0.7, 0.1], [1, 0, 1, 0]), 5 / 6)


def test_subpopulation_masks():
  # label:          0  1  2  3  4  5  6  7  8
  counts = np.array([0, 1, 2, 3, 4, 5, 6, 7, 100])
  # seen counts 1..7, 100 -> np.quantile(., [1/3, 2/3]) = [3.333.., 5.666..]
  labels = np.array([[8, 0, -1], [3, 4, 5], [6, 1, 2]])
  masks = metrics.subpopulation_masks(counts, labels)
  np.testing.assert_array_equal(masks["head"], [[1, 0, 0], [0, 0, 0], [1, 0, 0]])
  np.testing.assert_array_equal(masks["torso"], [[0, 0, 0], [0, 1, 1], [0, 0, 0]])
  np.testing.assert_array_equal(masks["tail"], [[0, 1, 0], [1, 0, 0], [0, 1, 1]])
  # Ties at a threshold go to the lower group: seen counts 1,1,1,2,2,9 -> q = [1, 2].
  tied = metrics.subpopulation_masks([3, 1, 1, 1, 2, 2, 9], np.array([0, 1, 4, 6, 2]))
  np.testing.assert_array_equal(tied["tail"], [0, 1, 0, 0, 1])
  np.testing.assert_array_equal(tied["torso"], [0, 0, 1, 0, 0])
  np.testing.assert_array_equal(tied["head"], [1, 0, 0, 1, 0])
  with pytest.raises(ValueError, match="^quantiles"):
    metrics.subpopulation_masks(counts, labels, quantiles=(0.7, 0.3))


def test_explicit_propensity_parameters_win_over_the_dataset_name():
  from experiments.configs import common  # pylint: disable=g-import-not-at-top
  from snm_jax.train.core.evaluate import propensity_ab  # pylint: disable=g-import-not-at-top
  c = common.base_config()
  assert propensity_ab(c, "amazon-670k") == (0.6, 2.6)
  assert propensity_ab(c, None) == (0.55, 1.5)
  c.eval.psp_a, c.eval.psp_b = 0.7, 3.0
  assert propensity_ab(c, "amazon-670k") == (0.7, 3.0)
  assert propensity_ab(c, "bibtex") == (0.7, 3.0)
