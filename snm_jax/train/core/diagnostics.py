"""Sampler diagnostics during training: mining recall and gradient signal-to-noise.

Every `diagnostics.every` steps the loop calls `diagnose(state, step)` on a
fixed probe batch (the first `diagnostics.probe_size` training points, in file
order) and logs what it returns as `diag/...` scalars (metrics.jsonl,
TensorBoard). Nothing here changes the state or the step's random keys, so a
run's bits do not depend on whether diagnostics are on.

Mining recall (`mining_recall@k`, `hardest_mined_rank`, `hardest_mined_rank_median`):
  for a probe point x, its k hardest negatives over all K labels are the k
  highest-scoring labels that are not positives (found with the chunked top-k
  retrieval of the evaluators, `snm_jax.mining.retrieval`); the sampled-and-mined
  set is the top k, by the same score, of the negatives the run's sampler draws
  for x (with a key of the diagnostic step, not the train step's). Recall is the
  fraction of the former in the latter; the rank is that of the hardest sampled
  negative among all K - |positives| negatives (1: the sampler found the hardest).
  It measures how close stochastic mining is to exact mining (Reddi et al. 2019,
  Sec. 4: SNM's top-k of B samples is a cheap stand-in for the top-k of K).

Gradient signal-to-noise (`grad_snr`, `grad_snr_db`): Bamler & Mandt (2020)
  argue (their Sec. 3, Eq. 12) that a sampler's quality is the signal-to-noise
  ratio |E g| / sqrt(Var g) of the stochastic gradient g it induces. Measured
  here on the class table: R independent negative draws on the probe batch
  (keys fold_in(key, r)) give R dense table gradients g_r (K_pad, h) (the
  step's gathered-row gradients scattered into the table by the step's own
  sparse update, `step.make_table_update`, with SGD). With m and v the mean and
  the unbiased variance of each coordinate over the R draws,
      grad_snr = sqrt( sum m^2 / sum v ),
  Eq. 12's ratio aggregated over the table as a ratio of powers (one number
  per sampler, comparable across samplers of the same model; per-coordinate
  ratios are dominated by the many rows no draw touches). The tower is run
  without dropout, so all the variance is the sampler's.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from snm_jax import sharding
from snm_jax.data.pipeline import SparseBatcher
from snm_jax.errors import ConfigError
from snm_jax.mining.negatives import hit_mask
from snm_jax.mining.retrieval import make_top_k_retrieval
from snm_jax.models import precision
from snm_jax.models.towers import l2_normalize, tower_inputs
from snm_jax.sharding import DATA, MODEL
from snm_jax.train.core import row_optimizers
from snm_jax.train.runtime.host import to_host
from snm_jax.train.core.step import make_loss_and_grads, make_table_update

P = jax.P
DIAGNOSTICS_SEED_OFFSET = 2  # keys from seed + 2: the loop's train keys come from seed + 1


def probe_batch(features, labels, size: int, mesh, *, max_nnz: int, max_labels: int,
                batcher_cls=SparseBatcher) -> dict:
  """The first `size` points of (features (N, d), labels (N, K)) as one global batch
  sharded over `data` (every process holds the same points, like the evaluators), batched
  as the run's batches are (`batcher_cls`: SparseBatcher or DenseBatcher)."""
  if not 0 < size <= features.shape[0]:
    raise ConfigError("diagnostics.probe_size", f"{size} must be in [1, {features.shape[0]}] "
                      "(the number of training points)")
  sharding.check_divisible("diagnostics.probe_size", size, mesh, DATA)
  batcher = batcher_cls(features[:size], labels[:size], None, global_batch_size=size,
                        max_nnz=max_nnz, max_labels=max_labels, shuffle=False, num_epochs=1,
                        process_index=0, process_count=1, log_epochs=False)
  batch = next(iter(batcher))
  return {k: jax.device_put(v, sharding.named(mesh, P(DATA))) for k, v in batch.items()}


def _exact_hard_negatives(retrieve, q, table, label_set, k):
  """(n, k) ids of the k highest-scoring non-positive labels: the top k + L of all K, positives dropped."""
  _, ids = retrieve(q, table)
  is_pos = hit_mask(ids, label_set) | (ids < 0)
  order = jnp.argsort(is_pos, axis=-1, stable=True)  # non-positives first, in score order
  return jnp.take_along_axis(ids, order, axis=-1)[:, :k]


def make_count_above(mesh, num_labels: int, normalize_classes: bool, row_block: int = 16_384):
  """`count(q (n, h), table (K_pad, h), thr (n,), excluded (n, E)) -> (n,)`: labels y < K not in
  the row's `excluded` ids with score(x, y) > thr, each model shard counting its rows block by
  block (O(n x row_block) memory, never n x K). Excluding the labels whose own score defines
  `thr` keeps the count free of float ties between two computations of the same score."""

  def local(q_l, table_l, thr_l, excluded_l):
    j = jax.lax.axis_index(MODEL)
    k_loc = table_l.shape[0]
    block = min(row_block, k_loc)
    num_blocks = -(-k_loc // block)

    def body(b, count):
      start = jnp.minimum(b * block, k_loc - block)  # the last block is shifted back ...
      rows = precision.upcast(jax.lax.dynamic_slice_in_dim(table_l, start, block, 0))  # a bf16 table
      rows = l2_normalize(rows) if normalize_classes else rows
      ids = j * k_loc + start + jnp.arange(block)
      fresh = (ids >= j * k_loc + b * block) & (ids < num_labels)  # ... and not recounted
      kept = fresh[None] & ~jnp.any(ids[None, :, None] == excluded_l[:, None, :], axis=-1)
      return count + jnp.sum((q_l @ rows.T > thr_l[:, None]) & kept, axis=-1)

    count = jax.lax.fori_loop(0, num_blocks, body, jnp.zeros(q_l.shape[0], jnp.int32))
    return jax.lax.psum(count, MODEL)

  return jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(DATA, None), P(MODEL, None), P(DATA), P(DATA, None)),
                               out_specs=P(DATA), check_vma=False))


def make_diagnose(*, tower_apply: Callable, sampler, loss, mesh, normalize_classes: bool, probe: dict,
                  num_labels: int, k: int, snr_draws: int, seed: int, stratum_cdf=None,
                  table_rows: int | None = None, row_block: int = 4096, compute_dtype=jnp.float32) -> Callable:
  """`diagnose(state, step) -> {name: float}` (module docstring) for the run's sampler and loss.

  probe: a `probe_batch`; k: the mined set's size; snr_draws: R (0 = no SNR).
  The other arguments are the train step's (`step.make_train_step`).
  """
  loss_and_grads, negatives = make_loss_and_grads(
      tower_apply=tower_apply, sampler=sampler, loss=loss, mesh=mesh, normalize_classes=normalize_classes,
      stratum_cdf=stratum_cdf, table_rows=table_rows, dropout=False, compute_dtype=compute_dtype)
  max_labels = probe["label_set"].shape[1]
  retrieve = make_top_k_retrieval(mesh, k=min(k + max_labels, num_labels), num_labels=num_labels,
                                  row_block=row_block, normalize_classes=normalize_classes)
  count_above = make_count_above(mesh, num_labels, normalize_classes)
  densify_grad = make_table_update(negatives, mesh, row_optimizers.sgd())  # SGD, lr -1: + gradient
  base_key = jax.random.key(seed + DIAGNOSTICS_SEED_OFFSET)

  def score(q, table, ids):  # (n, h), (n, S) global ids -> (n, S), the ranking the loss mines on
    rows = precision.upcast(jnp.take(table, jnp.clip(ids, 0, table.shape[0] - 1), axis=0))
    rows = l2_normalize(rows) if normalize_classes else rows
    return jnp.einsum("nh,nsh->ns", q, rows)

  @jax.jit
  def mining(params, table, key):
    q = tower_apply(params, *tower_inputs(probe))
    label_set = probe["label_set"]
    exact = _exact_hard_negatives(retrieve, q, table, label_set, k)
    ids = negatives.draw_and_gather(table, probe, key).ids
    ids = jnp.broadcast_to(ids, (q.shape[0], ids.shape[-1]))  # a shared draw serves every example
    valid = (ids < num_labels) & ~hit_mask(ids, label_set)
    scores = jnp.where(valid, score(q, table, ids), -jnp.inf)
    top_scores, top = jax.lax.top_k(scores, min(k, ids.shape[-1]))
    mined = jnp.where(jnp.isfinite(top_scores), jnp.take_along_axis(ids, top, axis=-1), -1)
    recall = jnp.mean(jnp.any(exact[:, :, None] == mined[:, None, :], axis=-1), axis=-1)
    hardest = top_scores[:, 0]
    above = count_above(q, table, hardest, jnp.concatenate([label_set, mined[:, :1]], axis=1))
    return recall, jnp.where(jnp.isfinite(hardest), above + 1, -1)

  @jax.jit
  def grad_moments(params, table, key):
    def one_draw(r, carry):
      mean, m2 = carry
      out = loss_and_grads(params, table, probe, jax.random.fold_in(key, r))
      zeros = jnp.zeros_like(table, jnp.float32)  # float32 gradients of a bfloat16 table too
      g, _ = densify_grad(zeros, {}, out.draws.ids, out.g_rows, out.g_pos, out.draws.owned,
                          probe["label"], -1.0)
      delta = g - mean  # Welford's update: no cancellation where |mean| >> std
      mean = mean + delta / (r + 1.0)
      return mean, m2 + delta * (g - mean)

    zeros = jnp.zeros_like(table, jnp.float32)
    mean, m2 = jax.lax.fori_loop(0, snr_draws, one_draw, (zeros, zeros))
    return jnp.sum(jnp.square(mean)), jnp.sum(m2) / (snr_draws - 1)

  def diagnose(state, step: int) -> dict:
    key = jax.random.fold_in(base_key, step)
    recall, rank = (to_host(x) for x in mining(state.tower_params(), state.table, key))
    valid = to_host(probe["valid"]) & (rank > 0)
    out = {f"mining_recall@{k}": float(np.mean(recall[valid])),
           "hardest_mined_rank": float(np.mean(rank[valid])),
           "hardest_mined_rank_median": float(np.median(rank[valid]))}
    if snr_draws >= 2:
      signal, noise = (float(x) for x in jax.device_get(grad_moments(state.tower_params(), state.table,
                                                                      key)))
      out["grad_snr"] = float(np.sqrt(signal / noise)) if noise > 0 else float("inf")
      out["grad_snr_db"] = float(10 * np.log10(signal / noise)) if noise > 0 else float("inf")
    return out

  return diagnose
