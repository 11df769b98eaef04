"""Tests of the synthetic generator (exact p(y|x), Bayes-optimal top-k) and the head/tail split."""
import tracemalloc

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.neighbors import NearestNeighbors

from snm_jax.data import synthetic

SMALL = {
    "dense": synthetic.SyntheticConfig(num_labels=300, features="dense", dim=16, noise=2.0),
    "sparse": synthetic.SyntheticConfig(num_labels=300, features="sparse", dim=400),
}


@pytest.fixture(scope="module", params=["dense", "sparse"])
def data(request):
  return synthetic.make_synthetic(SMALL[request.param], num_train=3000, num_test=20000, seed=1)


def test_posterior_is_a_distribution_and_bayes_topk_is_exact(data):
  x = data.test.features[:300]
  full = data.problem.full_label_prob(x)  # (300, K) brute force over every label
  np.testing.assert_allclose(full.sum(1), 1.0, atol=1e-10)
  labels, probs = data.problem.bayes_topk(x, 7)
  np.testing.assert_allclose(probs, -np.sort(-full, axis=1)[:, :7], rtol=1e-12)
  np.testing.assert_allclose(np.take_along_axis(full, labels, 1), probs, rtol=1e-12)
  np.testing.assert_allclose(data.problem.label_prob(x, labels), probs, rtol=1e-12)
  # Index form gives the same answer as feature form.
  by_index = data.bayes_topk(np.arange(300), 7)
  np.testing.assert_array_equal(by_index[0], labels)


def test_label_prior_matches_sampling_and_sums_to_one(data):
  k = data.problem.num_labels
  prior = data.problem.label_prior(np.arange(k))
  np.testing.assert_allclose(prior.sum(), 1.0, atol=1e-12)
  y = data.test_sample.label
  emp = np.bincount(y, minlength=k) / y.size
  top = np.argsort(-prior)[:10]
  # Binomial standard errors; 5 of them.
  np.testing.assert_array_less(np.abs(emp[top] - prior[top]),
                               5 * np.sqrt(prior[top] * (1 - prior[top]) / y.size))
  # Long tail: the 10% most frequent labels carry most of the mass.
  assert np.sort(prior)[::-1][:k // 10].sum() > 0.5
  plab, pprob = data.problem.prior_topk(5)
  np.testing.assert_array_equal(plab, np.argsort(-prior, kind="stable")[:5])
  np.testing.assert_allclose(pprob, prior[plab])


def test_posterior_is_calibrated_against_the_sampler(data):
  """Recall of the Bayes top-k on sampled labels equals its predicted mass sum p(y|x)."""
  y = data.test_sample.label
  labels, probs = data.bayes_topk(np.arange(y.size), 5)
  for k in (1, 5):
    hit = (labels[:, :k] == y[:, None]).any(1)
    se = hit.std() / np.sqrt(y.size)
    assert abs(hit.mean() - probs[:, :k].sum(1).mean()) < 4 * se


def test_bayes_topk_beats_other_predictors(data):
  k = 5
  n = 3000
  x, y = data.test.features[:n], data.test_sample.label[:n]
  full = data.problem.full_label_prob(x)
  bayes, _ = data.problem.bayes_topk(x, k)
  rng = np.random.default_rng(0)
  noisy = full * np.exp(0.5 * rng.standard_normal(full.shape))
  # A learned predictor: label votes of the 30 nearest training points (ties: frequency).
  nbrs = NearestNeighbors(n_neighbors=30).fit(data.train.features)
  _, nn = nbrs.kneighbors(x)
  votes = np.zeros_like(full)
  np.add.at(votes, (np.arange(n)[:, None], data.train_sample.label[nn]), 1.0)
  votes += 1e-3 * data.problem.label_prior(np.arange(full.shape[1]))[None]
  others = {
      "perturbed_p": np.argsort(-noisy, 1)[:, :k],
      "label_frequency": np.tile(data.problem.prior_topk(k)[0], (n, 1)),
      "nearest_neighbours": np.argsort(-votes, 1)[:, :k],
  }
  bayes_mass = np.take_along_axis(full, bayes, 1).sum(1)
  bayes_recall = (bayes == y[:, None]).any(1).mean()
  for name, pred in others.items():
    mass = np.take_along_axis(full, pred, 1).sum(1)
    # Expected recall@k (SNM Lemma 1): Bayes is best point by point, not only on average.
    assert np.all(mass <= bayes_mass + 1e-12), name
    assert mass.mean() < bayes_mass.mean() - 0.005, name
    assert (pred == y[:, None]).any(1).mean() < bayes_recall, name


def test_structure_hierarchy_and_subpopulations():
  cfg = synthetic.SyntheticConfig(num_labels=500, num_coarse=8, num_fine_per_coarse=4,
                                  num_subpopulations=3, subpopulation_weights=(0.6, 0.3, 0.1))
  problem = synthetic.SyntheticProblem(cfg, seed=3)
  sample = problem.sample(20000, seed=0)
  np.testing.assert_allclose(np.bincount(sample.subpopulation) / 20000, [0.6, 0.3, 0.1],
                             atol=0.015)
  assert problem.sizes.sum() == 500 and problem.sizes.min() >= 1
  # Sub-clusters of one concept are closer than sub-clusters of different concepts.
  d = np.linalg.norm(problem.means[:, None] - problem.means[None], axis=-1)
  same = problem.coarse_of[:, None] == problem.coarse_of[None]
  off = ~np.eye(len(d), dtype=bool)
  assert d[same & off].mean() < 0.6 * d[~same].mean()
  fine, rank = problem.label_cluster_rank(sample.label)
  np.testing.assert_array_equal(fine, sample.fine_cluster)
  assert np.all(rank < problem.sizes[fine])
  # Subpopulations differ in their concept distributions (S2M heterogeneity).
  assert np.abs(np.exp(problem.log_rho[0]) - np.exp(problem.log_rho[1])).sum() > 0.2


@pytest.mark.parametrize("features,dim", [("dense", 32), ("sparse", 100_000)])
def test_ten_million_labels_without_k_times_n_memory(features, dim):
  cfg = synthetic.SyntheticConfig(num_labels=10**7, num_coarse=100, num_fine_per_coarse=20,
                                  features=features, dim=dim)
  tracemalloc.start()
  try:
    data = synthetic.make_synthetic(cfg, num_train=2000, num_test=500, seed=0)
    labels, probs = data.bayes_topk(np.arange(500), 10)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 200e6  # K * N floats would be 8e10 bytes
  assert labels.shape == (500, 10) and labels.min() >= 0 and labels.max() < 10**7
  assert np.all(np.diff(probs, axis=1) <= 0)
  assert data.train.labels.shape == (2000, 10**7) and data.train.labels.nnz == 2000
  # Exactness spot check: p(y|x) of the returned labels, recomputed independently.
  np.testing.assert_allclose(data.problem.label_prob(data.test.features[:500], labels), probs,
                             rtol=1e-12)


def test_downsample_tail_counts():
  y = np.repeat(np.arange(4), [300, 250, 200, 40])
  x = np.arange(y.size) * 10
  xs, ys, kept = synthetic.downsample_tail(x, y, tail_classes=[2, 3], ratio=100, seed=0)
  assert np.bincount(ys).tolist() == [300, 250, 2, 1]  # round(200/100), max(1, round(0.4))
  np.testing.assert_array_equal(xs, x[kept])
  assert np.all(np.diff(kept) > 0)
  again = synthetic.downsample_tail(x, y, [2, 3], 100, seed=0)[2]
  np.testing.assert_array_equal(kept, again)
  assert not np.array_equal(kept, synthetic.downsample_tail(x, y, [2, 3], 100, seed=1)[2])


def test_digits_head_tail():
  d = synthetic.digits_head_tail(num_tail=5, ratio=100, seed=0)
  assert d.x_train.shape[1] == 64 and d.x_train.max() <= 1.0
  counts = np.bincount(d.y_train, minlength=10)
  head = np.setdiff1d(np.arange(10), d.tail_classes)
  assert len(d.tail_classes) == 5
  total = np.bincount(load_digits().target, minlength=10)
  test_counts = np.bincount(d.y_test, minlength=10)
  np.testing.assert_array_equal(test_counts, np.round(total * 0.5))  # test split untouched
  np.testing.assert_array_equal(counts[head], (total - test_counts)[head])
  np.testing.assert_array_equal(counts[d.tail_classes], 1)  # ~90 / 100 -> 1


def test_load_or_synthesize_falls_back_with_a_notice(tmp_path, capsys):
  cfg = synthetic.SyntheticConfig(num_labels=60)
  train, test, problem = synthetic.load_or_synthesize("bibtex", cfg, num_train=50, num_test=20,
                                                      data_dir=tmp_path)
  out = capsys.readouterr().out
  assert "NOTICE" in out and str(tmp_path / "bibtex") in out and "synthetic" in out
  assert (train.num_points, test.num_points, train.num_labels) == (50, 20, 60)
  assert isinstance(problem, synthetic.SyntheticProblem)


def test_load_or_synthesize_prefers_real_data(shared_data_dir, capsys):
  train, test, problem = synthetic.load_or_synthesize("delicious", data_dir=shared_data_dir)
  assert problem is None and (train.num_points, test.num_points) == (12920, 3185)
  assert "NOTICE" not in capsys.readouterr().out
