"""Negative samplers whose per-step cost does not grow with the number of labels K.

Stratified sampling (what makes sharding exact and layout-independent)
--------------------------------------------------------------------
The label range [0, K_pad) is cut into ``V = num_strata`` equal, contiguous
strata of ``K_pad / V`` rows, and each of the ``B`` draws belongs to one
stratum (draw b -> stratum b // (B / V)). Within its stratum a draw is uniform
(or unigram). Every model shard owns V/M whole strata, so a shard samples only
its own rows and no sampled id ever crosses the network. The draw values depend
only on (key, stratum, example) -- never on the number of shards M -- so the
same seed yields the same sample on 1, 2, 4 or 8 model shards as long as M
divides V.

How this differs from one uniform sample of B labels: a plain uniform sample
draws each of the B ids from all K labels, so the number of draws landing in a
stratum is Binomial(B, 1/V); here it is exactly B / V. Each label's marginal
inclusion probability is unchanged (B / K per draw set, up to the padding of
the last stratum), but the joint distribution is a stratified one with lower
variance. With V = 1 it is exactly i.i.d. uniform sampling with replacement.
Padding rows (K <= row < K_pad) are never drawn: the last stratum draws only
among its real rows.

All ids returned here are *stratum-local* offsets turned into global label
ids; samplers also return ``log_q``, the log expected number of times the
label is drawn among the B draws, which the sampled-softmax logQ correction
needs.

The stratified draws are with replacement from all K labels (the positives
included, masked afterwards by the step): an approximation of Reddi et al.'s
Algorithm 1, whose B negatives are distinct and never a positive. `ExactSampler`
(``mining.sampler="exact"``) draws exactly that, per example, in O(B log B).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from snm_jax.errors import ConfigError


def padded_num_labels(num_labels: int, num_strata: int) -> int:
  """K rounded up to a multiple of the number of strata."""
  return -(-num_labels // num_strata) * num_strata


def check_strata_fit_mesh(num_strata: int, num_model_shards: int) -> None:
  """Each model shard must own whole strata (its own rows, the same draws on any mesh)."""
  if num_strata % num_model_shards:
    raise ConfigError("mining.num_strata", f"{num_strata} is not a multiple of the mesh's model "
                      f"size {num_model_shards}")


@dataclasses.dataclass(frozen=True)
class StratifiedSampler:
  """Uniform, or frequency-proportional (unigram: pass `stratum_cdf` to `sample_strata`) stratified sampler.

  Attributes:
    num_labels: K, the number of real labels.
    num_samples: B, draws per step (shared) or per example (per-example).
    num_strata: V; B and K_pad must be divisible by V and V by the mesh's model size.
    per_example: False draws one set of B ids shared by the whole minibatch
      (scores are one N x B matmul); True draws B ids for every example.
      Either way the draws are with replacement and may hit a positive (masked
      afterwards): an approximation of Reddi et al.'s Algorithm 1, which
      draws B distinct labels other than the example's positives.
    full: "draw" every label exactly once (full softmax); num_samples must be K_pad.
  """
  num_labels: int
  num_samples: int
  num_strata: int = 1
  per_example: bool = False
  full: bool = False

  def __post_init__(self):
    if self.num_samples % self.num_strata:
      raise ConfigError("mining.num_samples",
                        f"B={self.num_samples} must be divisible by mining.num_strata={self.num_strata}")
    if self.num_samples < 1:
      raise ConfigError("mining.num_samples", f"must be >= 1, got {self.num_samples}")
    if self.full and self.num_samples != self.padded_labels:
      raise ConfigError("mining.num_samples", "the full sampler draws each of the K_pad labels once")

  @property
  def padded_labels(self) -> int:
    return padded_num_labels(self.num_labels, self.num_strata)

  @property
  def rows_per_stratum(self) -> int:
    return self.padded_labels // self.num_strata

  @property
  def draws_per_stratum(self) -> int:
    return self.num_samples // self.num_strata

  def real_rows(self, stratum):
    """Number of real (non-padding) labels in each stratum; (S,) int32."""
    start = stratum * self.rows_per_stratum
    return jnp.clip(self.num_labels - start, 0, self.rows_per_stratum).astype(jnp.int32)

  def sample_strata(self, key, strata, example_ids=None, stratum_cdf=None):
    """Draws for the given strata.

    Args:
      key: the step's sampling key (identical on every device).
      strata: (S,) int32 stratum indices owned by the caller.
      example_ids: (n,) global example indices, for per-example sampling.
      stratum_cdf: (S, K_pad / V) within-stratum CDF rows for unigram sampling.

    Returns:
      ids: (S * B/V,) or (n, S * B/V) int32 global label ids, stratum-major.
      log_q: same shape, log expected count of each id among the B draws.
    """
    d = self.draws_per_stratum

    def one_stratum(s, cdf_s, k):
      if self.full:
        return s * self.rows_per_stratum + jnp.arange(d, dtype=jnp.int32), jnp.zeros((d,))
      if cdf_s is None:
        n_real = self.real_rows(s)
        offs = jax.random.randint(k, (d,), 0, jnp.maximum(n_real, 1), dtype=jnp.int32)
        log_q = jnp.full((d,), jnp.log(d / jnp.maximum(n_real, 1).astype(jnp.float32)))
      else:
        u = jax.random.uniform(k, (d,), dtype=jnp.float32)
        offs = jnp.searchsorted(cdf_s, u, side="right").astype(jnp.int32)
        offs = jnp.minimum(offs, self.rows_per_stratum - 1)
        prev = jnp.where(offs > 0, cdf_s[jnp.maximum(offs - 1, 0)], 0.0)
        log_q = jnp.log(d * jnp.maximum(cdf_s[offs] - prev, 1e-30))
      return s * self.rows_per_stratum + offs, log_q

    def for_key(k):
      keys = jax.vmap(lambda s: jax.random.fold_in(k, s))(strata)
      if stratum_cdf is None:
        ids, lq = jax.vmap(lambda s, kk: one_stratum(s, None, kk))(strata, keys)
      else:
        ids, lq = jax.vmap(one_stratum)(strata, stratum_cdf, keys)
      return ids.reshape(-1), lq.reshape(-1)

    if not self.per_example:
      return for_key(key)
    ex_keys = jax.vmap(lambda e: jax.random.fold_in(key, e))(example_ids)
    return jax.vmap(for_key)(ex_keys)


def uniform_log_expected_count(sampler: StratifiedSampler, labels):
  """log E[#draws of y] among the B draws of the uniform stratified sampler: log(d / n_real(stratum(y)))."""
  stratum = labels // sampler.rows_per_stratum
  n_real = jnp.maximum(sampler.real_rows(stratum), 1).astype(jnp.float32)
  return jnp.log(sampler.draws_per_stratum / n_real)


def unigram_stratum_cdf(label_counts: np.ndarray, num_strata: int, smoothing: float = 1.0,
                        power: float = 1.0) -> np.ndarray:
  """Within-stratum CDFs of p(y) ~ (count_y + smoothing)^power; shape (K_pad,).

  Padding rows get zero mass so they are never drawn.
  """
  counts = np.asarray(label_counts, np.float64)
  k_pad = padded_num_labels(len(counts), num_strata)
  w = np.zeros(k_pad)
  w[:len(counts)] = (counts + smoothing) ** power
  w = w.reshape(num_strata, -1)
  mass = w.sum(axis=1, keepdims=True)
  cdf = np.cumsum(w, axis=1) / np.where(mass > 0, mass, 1.0)
  cdf[:, -1] = np.where(mass[:, 0] > 0, 1.0, cdf[:, -1])
  return cdf.reshape(-1).astype(np.float32)


def _distinct_uniform(key, num_values, num_samples: int):
  """min(B, m) distinct integers drawn uniformly from [0, m), m = `num_values` (traced scalar).

  Returns (B,) int32: the draws, then B - min(B, m) trailing -1 (no draw).
  The set is a uniformly random min(B, m)-subset of [0, m): it is the first B
  distinct values of one i.i.d. uniform sequence (sequential rejection of
  repeats), drawn in rounds: each round draws a fresh value for every slot not
  yet holding a distinct one, and keeps it unless it repeats a value kept
  earlier or an earlier slot's value of the same round (found by one sort,
  O(B log B)). With B <= m/2 at least half the open slots fill per round in
  expectation, so O(log B) rounds; the loop never touches [0, m) itself.
  """
  slots = jnp.arange(num_samples, dtype=jnp.int32)
  target = jnp.minimum(num_samples, num_values)
  hi = jnp.maximum(num_values, 1)

  def body(carry):
    vals, done, r = carry
    cand = jax.random.randint(jax.random.fold_in(key, r), (num_samples,), 0, hi, dtype=jnp.int32)
    vals = jnp.where(done, vals, cand)
    # Among equal values the one kept earlier (priority -1) or the lowest open slot wins.
    order = jnp.lexsort((jnp.where(done, -1, slots), vals))
    sorted_vals = vals[order]
    repeat = jnp.concatenate([jnp.zeros((1,), bool), sorted_vals[1:] == sorted_vals[:-1]])
    keep = jnp.zeros((num_samples,), bool).at[order].set(~repeat)
    return vals, (done | keep) & (slots < target), r + 1

  init = (jnp.full((num_samples,), -1, jnp.int32), jnp.zeros((num_samples,), bool), jnp.int32(0))
  vals, _, _ = jax.lax.while_loop(lambda c: jnp.sum(c[1]) < target, body, init)
  return jnp.where(slots < target, vals, -1)


def skip_positives(x, positives_sorted, num_labels: int):
  """Order-preserving map of x (B,) in [0, K - P) onto [K] minus the P positives.

  positives_sorted: (L,) the distinct positives p_0 < ... < p_{P-1} in [0, K), then
  padding entries >= K. The x-th (0-based) non-positive label is
  x + #{j : p_j - j <= x} (p_j - j, the number of non-positives below p_j, is
  non-decreasing): O(log L) per x.
  """
  j = jnp.arange(positives_sorted.shape[0], dtype=positives_sorted.dtype)
  gaps = jnp.where(positives_sorted < num_labels, positives_sorted - j, num_labels)
  return x + jnp.searchsorted(gaps, x, side="right").astype(x.dtype)


def sorted_distinct_positives(label_set, num_labels: int):
  """(n, L) label sets (padded with -1, repeats allowed) -> ((n, L) their distinct labels in
  [0, K) ascending, padded with K; (n,) how many)."""
  pos = jnp.sort(jnp.where((label_set >= 0) & (label_set < num_labels), label_set, num_labels), axis=-1)
  repeat = jnp.concatenate([jnp.zeros(pos.shape[:-1] + (1,), bool), pos[..., 1:] == pos[..., :-1]], -1)
  pos = jnp.sort(jnp.where(repeat, num_labels, pos), axis=-1)
  return pos, jnp.sum(pos < num_labels, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ExactSampler:
  """Reddi et al. (2019) Algorithm 1 exactly: per example i, B *distinct* labels drawn
  uniformly from [K] minus its positives P_i (`mining.sampler="exact"`).

  Each negative is drawn with probability B / (K - |P_i|) and at most once, so
  the SNM loss's expectation is the OWL of Lemma 2 (`losses.expected_owl_theta`).
  Cost per example O(B log B + B log L) (`_distinct_uniform` + `skip_positives`),
  never O(K). A global sampler (`snm_jax.mining.negatives.GlobalNegatives`): the
  draws are made outside the shard_map from a key per example id, so they do
  not depend on the mesh. If K - |P_i| < B, the missing draws are id K
  (padding, masked by the step).

  Attributes:
    num_labels: K.
    num_samples: B, draws per example.
  """
  num_labels: int
  num_samples: int

  def __post_init__(self):
    if not 1 <= self.num_samples < self.num_labels:
      raise ConfigError("mining.num_samples", f"B={self.num_samples} must be in [1, K={self.num_labels}) "
                        "for the exact sampler (B distinct non-positive labels)")

  def draw(self, key, batch):
    """batch: 'label_set' (N, L) padded -1, 'label' (N,), 'example_id' (N,).

    Returns (ids (N, B) int32, log_q (N, B), log_q_pos (N,)): log_q is the log
    expected count of a label among the example's B draws, log(B / (K - P_i)),
    for the draws; log_q_pos is the same value for the positive (the count it
    would have as a negative: the uniform sampler's convention for the
    sampled-softmax / NCE correction, as the positive itself is never drawn).
    """
    label_set = jnp.concatenate([batch["label_set"], batch["label"][:, None]], axis=-1)
    positives, num_pos = sorted_distinct_positives(label_set, self.num_labels)
    m = self.num_labels - num_pos

    def one(k, pos_i, m_i):
      x = _distinct_uniform(k, m_i, self.num_samples)
      return jnp.where(x >= 0, skip_positives(jnp.maximum(x, 0), pos_i, self.num_labels), self.num_labels)

    keys = jax.vmap(lambda e: jax.random.fold_in(key, e))(batch["example_id"])
    ids = jax.vmap(one)(keys, positives, m)
    log_count = jnp.log(self.num_samples / jnp.maximum(m, 1).astype(jnp.float32))
    return ids, jnp.broadcast_to(log_count[:, None], ids.shape), log_count
