"""Exact top-k retrieval over a row-sharded class table, with bounded memory.

For a chunk of n queries, each model shard scans its K/M rows in blocks of R
rows (`lax.scan`), keeping a running top-k: memory is O(n (k + R)) per device,
never O(n K). The shards' k candidates are then merged (O(n k M) exchanged).
An optional per-label additive bias, e.g. log p_n(y|x) for the adversarial
sampler's bias removal (Bamler & Mandt Eq. 5), is evaluated block by block.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from snm_jax.losses.ranking import top_k_candidates
from snm_jax.mining.topk import merge_top_k_across
from snm_jax.models.towers import l2_normalize
from snm_jax.sharding import DATA, MODEL

P = jax.P


def _local_block_top_k(q, table, k, row_block, num_labels, row_offset, normalize, bias_fn, extra,
                       with_lse=False):
  """Running top-k of q @ table.T over blocks of rows. q (n, h), table (R_loc, h)."""
  n = q.shape[0]
  r_loc = table.shape[0]
  r = min(row_block, r_loc)
  num_blocks = -(-r_loc // r)

  def body(carry, b):
    vals, ids, lse = carry
    # The last block is shifted back to stay in range; rows it re-visits are masked.
    start = jnp.minimum(b * r, r_loc - r)
    rows = jax.lax.dynamic_slice_in_dim(table, start, r, axis=0)
    rows = l2_normalize(rows) if normalize else rows
    local = start + jnp.arange(r)
    gid = row_offset + local
    s = q @ rows.T
    if bias_fn is not None:
      s = s + bias_fn(extra, gid)
    s = jnp.where(((local >= b * r) & (gid < num_labels))[None, :], s, -jnp.inf)
    # The block's top-k candidates (all r scores when grouping does not pay
    # off) merged with the running top-k by one top_k over both.
    cand, cand_pos = top_k_candidates(s, min(k, r))
    all_vals = jnp.concatenate([vals, cand], axis=1)
    cand_ids = (jnp.broadcast_to(gid[None], (n, r)) if cand.shape[1] == r  # not grouped
                else jnp.take(gid, cand_pos, mode="clip"))
    all_ids = jnp.concatenate([ids, cand_ids], axis=1)
    top, pos = jax.lax.top_k(all_vals, k)
    if with_lse:  # running log-sum-exp over all labels (for normalised log-likelihoods)
      lse = jnp.logaddexp(lse, jax.nn.logsumexp(s, axis=1))
    return (top, jnp.take_along_axis(all_ids, pos, axis=1), lse), None

  init = (jnp.full((n, k), -jnp.inf, q.dtype), jnp.full((n, k), -1, jnp.int32),
          jnp.full((n,), -jnp.inf, q.dtype))
  # Peeling block 0 off the scan gives a carry already typed like the blocks
  # (varying over the mesh axes inside shard_map), as scan requires.
  carry, _ = body(init, 0)
  (vals, ids, lse), _ = jax.lax.scan(body, carry, jnp.arange(1, num_blocks))
  return vals, ids, lse


def make_top_k_retrieval(mesh, *, k: int, num_labels: int, row_block: int = 4096,
                         normalize_classes: bool = True, bias_fn: Callable | None = None,
                         with_logsumexp: bool = False):
  """Returns jitted `retrieve(queries (n, h), table (K_pad, h), extra) -> (scores, ids)`.

  With `with_logsumexp` it returns (scores, ids, lse), `lse` (n,) being
  log sum_y exp(score_y) over all K labels (for normalised log-likelihoods,
  e.g. Bamler & Mandt's predictive log-likelihood).

  queries are sharded over `data` (n divisible by its size), the table over
  `model`. `extra` (n, ...) is passed to `bias_fn(extra, label_ids) -> (n, R)`;
  use None when there is no bias. Invalid slots (fewer than k labels) have id -1.
  """
  has_extra = bias_fn is not None

  def local(q_l, table_l, *extra_l):
    j = jax.lax.axis_index(MODEL)
    vals, ids, lse = _local_block_top_k(q_l, table_l, k, row_block, num_labels, j * table_l.shape[0],
                                        normalize_classes, bias_fn, extra_l[0] if has_extra else None,
                                        with_logsumexp)
    vals, ids, valid = merge_top_k_across(vals, ids, ids >= 0, k, MODEL)
    ids = jnp.where(valid, ids, -1)
    if not with_logsumexp:
      return vals, ids
    m = jax.lax.pmax(lse, MODEL)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return vals, ids, m_safe + jnp.log(jax.lax.psum(jnp.exp(lse - m_safe), MODEL))

  in_specs = (P(DATA, None), P(MODEL, None)) + ((P(DATA),) if has_extra else ())
  out_specs = (P(DATA, None), P(DATA, None)) + ((P(DATA),) if with_logsumexp else ())
  sm = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

  @jax.jit
  def retrieve(queries, table, extra=None):
    return sm(queries, table, *((extra,) if has_extra else ()))

  return retrieve


def dense_top_k_reference(queries, table, k, num_labels, normalize_classes=True):
  """NumPy reference: full score matrix then argsort (tests only)."""
  q = np.asarray(queries, np.float64)
  t = np.asarray(table, np.float64)[:num_labels]
  if normalize_classes:
    t = t / np.sqrt((t ** 2).sum(1, keepdims=True) + 1e-12)
  s = q @ t.T
  ids = np.argsort(-s, axis=1, kind="stable")[:, :k]
  return np.take_along_axis(s, ids, 1), ids
