"""Synthetic retrieval data with a known p(y|x), and a head/tail downsampler.

Generative model (all parameters drawn once from `seed`):

    p ~ Cat(pi)                      subpopulation (P of them; S2M heterogeneity)
    c ~ Cat(rho_p)                   coarse concept; rho_p ~ Dirichlet around a Zipf prior
    s ~ Cat(sigma)                   fine sub-cluster of c (F per concept, Zipf weights)
    y ~ q_s(r) = (r+1)^-a / H(n_s)   label of rank r among the n_s labels of s (long tail)
    x ~ f(x | p, s)                  features depend on (p, s), not on y beyond s

Dense features: x = mu_c + nu_s + delta_p + noise * eps, eps ~ N(0, I_D), so
sub-clusters of one concept are close (Bamler & Mandt's hard negatives).
Sparse features: `words_per_point` word counts from the multinomial
phi_{p,s} = b * Unif(d) + m * U_p + (1 - b - m)/2 * (T_c + T_s), where
U_p, T_c, T_s are uniform over small random word lists.

Hence p(y|x) = p(s(y)|x) q_{s(y)}(rank(y)) exactly, with p(s|x) computed in
closed form over S = C * F sub-clusters. Memory is O(S * D + max_s n_s),
never O(K * N) or even O(K): label ids are a bijective affine hash of
(sub-cluster offset + rank), so K = 10^7 is cheap.

The Bayes-optimal top-k predictor (Lemma 1 of Reddi et al. 2019, SNM) is the
top-k of p(y|x); `bayes_topk` computes it exactly by merging the first k
labels of the k sub-clusters with the best leading label.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp
from absl import logging

from snm_jax.data.datasets import XCDataset
from snm_jax.data.datasets import load_dataset
from snm_jax.errors import DatasetNotFoundError

_CHUNK_FLOATS = 1 << 20  # Posterior computed in row chunks of <= this many floats.


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """Knobs of the generator (defaults: a small dense problem).

  Attributes:
    num_labels: K (>= num_coarse * num_fine_per_coarse), up to 10^7 and beyond.
    num_coarse: C generic concepts.
    num_fine_per_coarse: F specialised sub-clusters per concept.
    num_subpopulations: P.
    subpopulation_weights: pi (P,), default uniform.
    subpop_concentration: Dirichlet concentration of each rho_p around the
      Zipf prior; small = very different subpopulations.
    cluster_zipf: Zipf exponent of the concept and sub-cluster priors.
    label_zipf: a, Zipf exponent of labels within a sub-cluster.
    cluster_size_sigma: log-normal spread of sub-cluster sizes n_s.
    features: "dense" or "sparse".
    dim: D (dense) or vocabulary size d (sparse).
    coarse_scale, fine_scale, subpop_scale, noise: dense std devs.
    words_per_point, topic_words, background, subpop_mix: sparse model.
  """
  num_labels: int = 1000
  num_coarse: int = 10
  num_fine_per_coarse: int = 5
  num_subpopulations: int = 3
  subpopulation_weights: tuple[float, ...] | None = None
  subpop_concentration: float = 1.0
  cluster_zipf: float = 1.0
  label_zipf: float = 1.1
  cluster_size_sigma: float = 1.0
  features: str = "dense"
  dim: int = 16
  coarse_scale: float = 3.0
  fine_scale: float = 1.0
  subpop_scale: float = 1.0
  noise: float = 1.0
  words_per_point: int = 20
  topic_words: int = 20
  background: float = 0.1
  subpop_mix: float = 0.2


class SyntheticSample(NamedTuple):
  features: sp.csr_matrix  # (N, D) dense-valued CSR, or (N, d) counts
  label: np.ndarray  # (N,) int64 public label ids
  subpopulation: np.ndarray  # (N,) int32
  fine_cluster: np.ndarray  # (N,) int32 sub-cluster s


def _zipf(n: int, a: float) -> np.ndarray:
  w = np.arange(1, n + 1, dtype=np.float64) ** -a
  return w / w.sum()


class SyntheticProblem:
  """A sampled instance of the generative model above, with exact p(y|x)."""

  def __init__(self, config: SyntheticConfig, seed: int):
    cfg = self.config = config
    c, f, p = cfg.num_coarse, cfg.num_fine_per_coarse, cfg.num_subpopulations
    s = self.num_fine = c * f
    k = cfg.num_labels
    if k < s:
      raise ValueError(f"num_labels={k} < num_coarse * num_fine_per_coarse={s}")
    if cfg.features not in ("dense", "sparse"):
      raise ValueError(f"features must be 'dense' or 'sparse', got {cfg.features!r}")
    rng = np.random.default_rng([seed, 0x5F7])
    pi = np.ones(p) if cfg.subpopulation_weights is None else \
        np.asarray(cfg.subpopulation_weights, np.float64)
    if pi.shape != (p,) or np.any(pi < 0) or pi.sum() <= 0:
      raise ValueError(f"subpopulation_weights must be {p} non-negative numbers")
    self.log_pi = np.log(pi / pi.sum())  # (P,)
    base = _zipf(c, cfg.cluster_zipf)[rng.permutation(c)]
    rho = rng.dirichlet(cfg.subpop_concentration * c * base, size=p) + 1e-12
    self.log_rho = np.log(rho / rho.sum(1, keepdims=True))  # (P, C)
    sigma = np.stack([_zipf(f, cfg.cluster_zipf)[rng.permutation(f)] for _ in range(c)])
    self.log_sigma = np.log(sigma).reshape(s)  # (S,): log p(s | c(s))
    self.coarse_of = np.repeat(np.arange(c), f)  # (S,)

    # Sub-cluster sizes n_s >= 1 summing to K; labels of s are internal ids
    # offset[s] .. offset[s] + n_s - 1 in order of decreasing frequency.
    w = rng.lognormal(0.0, cfg.cluster_size_sigma, s)
    extra = (k - s) * w / w.sum()
    sizes = 1 + np.floor(extra).astype(np.int64)
    short = k - sizes.sum()
    sizes[np.argsort(extra - np.floor(extra))[::-1][:short]] += 1
    self.sizes = sizes
    self.offsets = np.concatenate([[0], np.cumsum(sizes)])
    self.zipf_cdf = np.cumsum(np.arange(1, sizes.max() + 1, dtype=np.float64) ** -cfg.label_zipf)
    self.log_h = np.log(self.zipf_cdf[sizes - 1])  # (S,): log H(n_s)
    # Public id = (mult * internal + shift) mod K: a bijection hiding the block layout.
    mult = int(rng.integers(1, k)) if k > 1 else 1
    while math.gcd(mult, k) != 1:
      mult += 1
    self._mult, self._shift = mult, int(rng.integers(0, k))
    self._mult_inv = pow(mult, -1, k) if k > 1 else 0

    if cfg.features == "dense":
      d = cfg.dim
      centres = cfg.coarse_scale * rng.standard_normal((c, d))
      self.means = centres[self.coarse_of] + cfg.fine_scale * rng.standard_normal((s, d))
      self.subpop_offsets = cfg.subpop_scale * rng.standard_normal((p, d))
    else:
      d, tw = cfg.dim, cfg.topic_words
      topic = (1.0 - cfg.background - cfg.subpop_mix) / 2.0
      if topic < 0:
        raise ValueError("background + subpop_mix must be <= 1")
      self.coarse_words = rng.integers(0, d, (c, tw))
      self.fine_words = rng.integers(0, d, (s, tw))
      self.subpop_words = rng.integers(0, d, (p, tw))
      rows = np.repeat(np.arange(s), 2 * tw)
      cols = np.concatenate([self.coarse_words[self.coarse_of], self.fine_words], 1).ravel()
      g = sp.csr_matrix((np.full(rows.size, topic / tw), (rows, cols)), shape=(s, d))
      g.sum_duplicates()
      self._log_base, self._delta_t = [], []
      for q in range(p):
        base = np.full(d, cfg.background / d)
        np.add.at(base, self.subpop_words[q], cfg.subpop_mix / tw)
        delta = g.copy()
        delta.data = np.log(base[g.indices] + g.data) - np.log(base[g.indices])
        self._log_base.append(np.log(base))
        self._delta_t.append(sp.csr_matrix(delta.T))

  # ------------------------------------------------------------------ labels
  @property
  def num_labels(self) -> int:
    return self.config.num_labels

  def _public(self, internal):
    k = self.num_labels
    return (self._mult * np.asarray(internal, np.int64) + self._shift) % k

  def _internal(self, label):
    k = self.num_labels
    return ((np.asarray(label, np.int64) - self._shift) % k) * self._mult_inv % k

  def label_cluster_rank(self, label) -> tuple[np.ndarray, np.ndarray]:
    """Sub-cluster s and within-cluster frequency rank r of public label ids."""
    internal = self._internal(label)
    fine = np.searchsorted(self.offsets, internal, side="right") - 1
    return fine, internal - self.offsets[fine]

  def _log_q(self, fine, rank):
    return -self.config.label_zipf * np.log1p(rank) - self.log_h[fine]

  def log_prior_fine(self) -> np.ndarray:
    """log p(s), (S,)."""
    from scipy.special import logsumexp  # pylint: disable=g-import-not-at-top  (~0.2 s of start-up)
    return logsumexp(self.log_pi[:, None] + self.log_rho[:, self.coarse_of], axis=0) \
        + self.log_sigma

  def label_prior(self, label) -> np.ndarray:
    """Marginal p(y) of public label ids (any shape)."""
    fine, rank = self.label_cluster_rank(label)
    return np.exp(self.log_prior_fine()[fine] + self._log_q(fine, rank))

  # --------------------------------------------------------------- features
  def _loglik(self, x) -> np.ndarray:
    """log f(x | p, s) up to a constant in (p, s): (n, P, S)."""
    cfg = self.config
    if cfg.features == "dense":
      x = x.toarray() if sp.issparse(x) else np.asarray(x, np.float64)
      xc = x[:, None, :] - self.subpop_offsets[None]  # (n, P, D)
      sq = (np.einsum("npd,npd->np", xc, xc)[:, :, None] - 2 * xc @ self.means.T
            + np.einsum("sd,sd->s", self.means, self.means)[None, None])
      return -sq / (2 * cfg.noise ** 2)
    x = sp.csr_matrix(x, dtype=np.float64)
    out = [(x @ lb)[:, None] + (x @ dt).toarray()
           for lb, dt in zip(self._log_base, self._delta_t)]
    return np.stack(out, axis=1)

  def log_posterior_fine(self, x) -> np.ndarray:
    """log p(s | x), (n, S) for features x (n, D) dense/CSR."""
    from scipy.special import logsumexp  # pylint: disable=g-import-not-at-top  (~0.2 s of start-up)
    n = x.shape[0]
    rows = max(1, _CHUNK_FLOATS // (self.num_fine * self.config.num_subpopulations))
    log_joint_ps = (self.log_pi[:, None] + self.log_rho[:, self.coarse_of]
                    + self.log_sigma[None])  # (P, S)
    out = np.empty((n, self.num_fine))
    for lo in range(0, n, rows):
      joint = self._loglik(x[lo:lo + rows]) + log_joint_ps[None]
      marg = logsumexp(joint, axis=1)  # (n, S)
      out[lo:lo + rows] = marg - logsumexp(marg, axis=1, keepdims=True)
    return out

  def label_prob(self, x, label) -> np.ndarray:
    """p(y | x) for public labels `label` (n,) or (n, m) and features x (n, .)."""
    label = np.asarray(label)
    post = self.log_posterior_fine(x)
    fine, rank = self.label_cluster_rank(label)
    rows = np.arange(x.shape[0]).reshape((-1,) + (1,) * (label.ndim - 1))
    return np.exp(post[rows, fine] + self._log_q(fine, rank))

  def full_label_prob(self, x) -> np.ndarray:
    """p(y | x) for all K labels, (n, K) indexed by public id. Only for small K (tests)."""
    post = self.log_posterior_fine(x)
    internal = np.arange(self.num_labels)
    fine = np.searchsorted(self.offsets, internal, side="right") - 1
    probs = np.exp(post[:, fine] + self._log_q(fine, internal - self.offsets[fine])[None])
    out = np.empty_like(probs)
    out[:, self._public(internal)] = probs
    return out

  def _topk(self, log_cluster, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of exp(log_cluster[:, s] + log q_s(r)) over all labels."""
    if not 0 < k <= self.num_labels:
      raise ValueError(f"k must be in [1, {self.num_labels}], got {k}")
    n = log_cluster.shape[0]
    lead = log_cluster - self.log_h[None]  # score of each sub-cluster's rank-0 label
    kc = min(k, self.num_fine)
    cand = np.argpartition(-lead, kc - 1, axis=1)[:, :kc]  # (n, kc)
    ranks = np.arange(k)
    scores = (log_cluster[np.arange(n)[:, None], cand][:, :, None]
              + self._log_q(cand[:, :, None], ranks[None, None]))  # (n, kc, k)
    scores = np.where(ranks[None, None] < self.sizes[cand][:, :, None], scores, -np.inf)
    scores = scores.reshape(n, -1)
    internal = (self.offsets[cand][:, :, None] + ranks[None, None]).reshape(n, -1)
    # Sort by score, ties by internal id, so the output is deterministic.
    order = np.lexsort((internal, -scores), axis=1)[:, :k]
    return (self._public(np.take_along_axis(internal, order, 1)),
            np.exp(np.take_along_axis(scores, order, 1)))

  def bayes_topk(self, x, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Bayes-optimal top-k (SNM Lemma 1): the k labels of largest p(y|x).

    Args:
      x: features (n, D) dense or CSR.
      k: number of labels.

    Returns:
      (labels (n, k) int64 public ids, p(y|x) (n, k) float64), by decreasing p.
    """
    return self._topk(self.log_posterior_fine(x), k)

  def prior_topk(self, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most frequent labels under p(y) (the label-frequency predictor): (k,), (k,)."""
    labels, probs = self._topk(self.log_prior_fine()[None], k)
    return labels[0], probs[0]

  # --------------------------------------------------------------- sampling
  def sample(self, n: int, seed: int) -> SyntheticSample:
    """Draws n i.i.d. points (x, y) from the model."""
    cfg = self.config
    rng = np.random.default_rng([seed, 0xDA7A])
    f = cfg.num_fine_per_coarse
    pop = rng.choice(cfg.num_subpopulations, n, p=np.exp(self.log_pi))
    u = rng.random(n)[:, None]
    coarse = (u > np.cumsum(np.exp(self.log_rho[pop]), axis=1)).sum(1)
    coarse = np.minimum(coarse, cfg.num_coarse - 1)
    sig = np.exp(self.log_sigma).reshape(cfg.num_coarse, f)
    u = rng.random(n)[:, None]
    sub = np.minimum((u > np.cumsum(sig[coarse], axis=1)).sum(1), f - 1)
    fine = coarse * f + sub
    target = rng.random(n) * self.zipf_cdf[self.sizes[fine] - 1]
    rank = np.minimum(np.searchsorted(self.zipf_cdf, target, side="right"),
                      self.sizes[fine] - 1)
    label = self._public(self.offsets[fine] + rank)
    if cfg.features == "dense":
      x = (self.means[fine] + self.subpop_offsets[pop]
           + cfg.noise * rng.standard_normal((n, cfg.dim))).astype(np.float32)
      features = sp.csr_matrix(x)
    else:
      l, tw = cfg.words_per_point, cfg.topic_words
      topic = (1.0 - cfg.background - cfg.subpop_mix) / 2.0
      comp = rng.choice(4, (n, l), p=[cfg.background, cfg.subpop_mix, topic, topic])
      pick = rng.integers(0, tw, (n, l))
      words = np.select(
          [comp == 0, comp == 1, comp == 2],
          [rng.integers(0, cfg.dim, (n, l)), self.subpop_words[pop][np.arange(n)[:, None], pick],
           self.coarse_words[coarse][np.arange(n)[:, None], pick]],
          self.fine_words[fine][np.arange(n)[:, None], pick])
      features = sp.csr_matrix(
          (np.ones(n * l, np.float32), (np.repeat(np.arange(n), l), words.ravel())),
          shape=(n, cfg.dim))
      features.sum_duplicates()
    return SyntheticSample(features, label, pop.astype(np.int32), fine.astype(np.int32))


def _as_dataset(sample: SyntheticSample, k: int, split: str) -> XCDataset:
  n = sample.label.size
  labels = sp.csr_matrix((np.ones(n, np.float32), sample.label.astype(np.int32),
                          np.arange(n + 1)), shape=(n, k))
  return XCDataset(features=sample.features, labels=labels, name="synthetic", split=split)


@dataclasses.dataclass
class SyntheticData:
  """Train/test splits drawn from one `SyntheticProblem` (one label per point)."""
  problem: SyntheticProblem
  train: XCDataset
  test: XCDataset
  train_sample: SyntheticSample
  test_sample: SyntheticSample

  def bayes_topk(self, x_or_index, k: int, split: str = "test"):
    """Bayes-optimal top-k for features, or for row indices of `split`."""
    x = x_or_index
    if not sp.issparse(x) and np.asarray(x).dtype.kind in "iu" and np.asarray(x).ndim == 1:
      x = getattr(self, split).features[np.asarray(x)]
    return self.problem.bayes_topk(x, k)


def make_synthetic(config: SyntheticConfig, num_train: int, num_test: int,
                   seed: int = 0) -> SyntheticData:
  """Samples a problem from `seed`, then train and test points from it."""
  problem = SyntheticProblem(config, seed)
  tr, te = problem.sample(num_train, seed * 2 + 1), problem.sample(num_test, seed * 2 + 2)
  k = config.num_labels
  return SyntheticData(problem, _as_dataset(tr, k, "train"), _as_dataset(te, k, "test"), tr, te)


# ------------------------------------------------------------ head / tail

def downsample_tail(x, y, tail_classes, ratio: float = 100, seed: int = 0):
  """S2M small-scale set-up: keep ~1/ratio of the examples of each Tail class.

  Each tail class keeps max(1, round(n_c / ratio)) examples chosen uniformly
  at random; head-class examples are all kept. Apply to the training set
  only.

  Args:
    x: (N, ...) array or CSR. y: (N,) int class ids. tail_classes: iterable.

  Returns:
    (x_kept, y_kept, kept_index) with kept_index sorted ascending.
  """
  y = np.asarray(y)
  rng = np.random.default_rng([seed, 0x7A11])
  keep = ~np.isin(y, np.asarray(list(tail_classes)))
  for c in sorted(set(np.asarray(list(tail_classes)).tolist())):
    idx = np.flatnonzero(y == c)
    if idx.size:
      keep[rng.choice(idx, max(1, int(round(idx.size / ratio))), replace=False)] = True
  kept = np.flatnonzero(keep)
  return x[kept], y[kept], kept


class HeadTailDigits(NamedTuple):
  x_train: np.ndarray  # (N_tr, 64) float32 in [0, 1]
  y_train: np.ndarray  # (N_tr,) int64, tail classes downsampled
  x_test: np.ndarray  # (N_te, 64) float32, untouched
  y_test: np.ndarray
  tail_classes: np.ndarray  # (num_tail,)


def digits_head_tail(num_tail: int = 5, ratio: float = 100, test_fraction: float = 0.5,
                     seed: int = 0) -> HeadTailDigits:
  """scikit-learn's bundled digits (no download) split per class, tail classes downsampled."""
  from sklearn.datasets import load_digits  # Imported lazily: only this helper needs it.
  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  rng = np.random.default_rng([seed, 0xD161])
  test = np.zeros(y.size, bool)
  for c in np.unique(y):
    idx = rng.permutation(np.flatnonzero(y == c))
    test[idx[:int(round(idx.size * test_fraction))]] = True
  tail = np.sort(rng.choice(np.unique(y), num_tail, replace=False))
  tr = np.flatnonzero(~test)
  x_tr, y_tr, _ = downsample_tail(x[tr], y[tr], tail, ratio, seed)
  return HeadTailDigits(x_tr, y_tr, x[test], y[test], tail)


def load_or_synthesize(name: str, config: SyntheticConfig | None = None,
                       num_train: int = 5000, num_test: int = 1000, seed: int = 0,
                       data_dir=None) -> tuple[XCDataset, XCDataset, SyntheticProblem | None]:
  """Real dataset `name` (shared/data, then the cache) or, if absent, synthetic data.

  The fallback prints and logs a notice saying where it looked. Returns
  (train, test, problem), with problem None for real data.
  """
  try:
    return (load_dataset(name, "train", data_dir), load_dataset(name, "test", data_dir), None)
  except DatasetNotFoundError as e:
    notice = f"NOTICE: {e}\nFalling back to synthetic data ({num_train} train / {num_test} test)."
    print(notice)
    logging.warning("%s", notice)
  data = make_synthetic(config or SyntheticConfig(), num_train, num_test, seed)
  return data.train, data.test, data.problem


# ------------------------------------------------------------ streamed sparse rows

def sparse_row_chunks(num_rows: int, *, num_features: int, num_labels: int, nnz: int = 64,
                      labels_per_row: int = 3, chunk_rows: int = 65_536, seed: int = 0):
  """Yields `(features CSR (n, d) float32, labels CSR (n, K))` chunks of a learnable sparse
  multi-label set of `num_rows` rows, one chunk in memory at a time (for the ArrayRecord converter
  at any size; chunk c depends only on (seed, c), so the rows do not depend on what was read before).

  Each row has 1..`labels_per_row` labels (Zipf-like: label y has weight 1 / (y + 1)) and `nnz`
  feature ids: half drawn from its labels' own blocks of `num_features // num_labels` ids (at least
  8), half uniform over d; values uniform in (0, 1].
  """
  block = max(8, num_features // max(num_labels, 1))
  weights = 1.0 / np.arange(1, num_labels + 1)
  cdf = np.cumsum(weights / weights.sum())
  for c, lo in enumerate(range(0, num_rows, chunk_rows)):
    n = min(chunk_rows, num_rows - lo)
    rng = np.random.default_rng([seed, c, 0x5EED])
    counts = rng.integers(1, labels_per_row + 1, n)
    lab = np.minimum(np.searchsorted(cdf, rng.random((n, labels_per_row))), num_labels - 1)
    keep = np.arange(labels_per_row)[None, :] < counts[:, None]
    # Distinct ids per row (a label set, and CSR without duplicate entries): drop repeats.
    lab_sorted = np.sort(np.where(keep, lab, num_labels), axis=1)
    keep = (lab_sorted < num_labels) & np.concatenate(
        [np.ones((n, 1), bool), lab_sorted[:, 1:] != lab_sorted[:, :-1]], axis=1)
    labels = sp.csr_matrix((np.ones(int(keep.sum()), np.float32), lab_sorted[keep],
                            np.concatenate([[0], np.cumsum(keep.sum(1))])), shape=(n, num_labels))
    half = nnz // 2
    owner = lab_sorted[np.arange(n)[:, None], rng.integers(0, keep.sum(1)[:, None], (n, half))]
    own = (owner * block + rng.integers(0, block, (n, half))) % num_features
    ids = np.concatenate([own, rng.integers(0, num_features, (n, nnz - half))], axis=1)
    ids = np.sort(ids, axis=1)
    first = np.concatenate([np.ones((n, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    vals = (1.0 - rng.random((n, nnz))).astype(np.float32)
    features = sp.csr_matrix((vals[first], ids[first], np.concatenate([[0], np.cumsum(first.sum(1))])),
                             shape=(n, num_features))
    yield features, labels
