"""Exact top-k retrieval over a row-sharded class table, with bounded memory.

For a chunk of n queries, each model shard scans its K/M rows in blocks of R
rows (`lax.scan`), keeping a running top-k of *group maxima* (a group: P rows
of a block), then re-scores the rows of the k best groups: memory is
O(n (k + R) + n P h) per device, never O(n K). The shards' k candidates are
then merged (O(n k M) exchanged).
An optional per-label additive bias, e.g. log p_n(y|x) for the adversarial
sampler's bias removal (Bamler & Mandt Eq. 5), is evaluated block by block in
the scan and label by label (`bias_at`) in the re-scoring.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from snm_jax.losses.ranking import masked_top_k, max_over_groups, top_k_candidates
from snm_jax.losses.topk import merge_top_k_across
from snm_jax.models import precision
from snm_jax.models.towers import l2_normalize, normalized_row_scores
from snm_jax.sharding import DATA, MODEL

P = jax.P


# Rows per group P of the running top-k of group maxima, for k < _FILTER_MIN_K
# (merged by one TopK per block) and k >= _FILTER_MIN_K (by `_filtered_merge`);
# fewer rows per group keep the final re-scoring of k P rows cheap at large k.
# Measured at K = 10^6, n = 512, R = 4096: k = 5 P in {16, 32, 64} within noise;
# k = 100 P = 8 1.16x faster than 16 and 1.8x faster than 4.
_PER_GROUP, _PER_GROUP_FILTERED = 32, 8
# Filtered merge: strided sub-groups of _GROUP maxima, at most _MAX_GROUPS
# sub-groups per row taken as candidates.
_GROUP, _MAX_GROUPS, _FILTER_MIN_K = 8, 16, 32


def _top_k_merge(vals, ids, s, gid, k):
  """(vals, ids) (n, k) merged with a block's values s (n, r) (-inf: excluded)
  of ids gid (r,), by one top_k over the block's `top_k_candidates` and the
  carry. Here the values are group maxima and the ids their group keys."""
  n, r = s.shape
  cand, cand_pos = top_k_candidates(s, min(k, r))
  cand_ids = (jnp.broadcast_to(gid[None], (n, r)) if cand.shape[1] == r  # not grouped
              else jnp.take(gid, cand_pos, mode="clip"))
  all_ids = jnp.concatenate([ids, cand_ids], axis=1)
  top, pos = jax.lax.top_k(jnp.concatenate([vals, cand], axis=1), k)
  return top, jnp.take_along_axis(all_ids, pos, axis=1)


def _first_index(x, value):
  """Per row, the first column where x (n, m) equals value (n,): a min over an
  iota, which XLA:CPU runs as one plain reduction (argmax is a slower variadic one)."""
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.min(jnp.where(x == value[:, None], iota, x.shape[1]), axis=1)


def _filtered_merge(vals, ids, s, gid, k):
  """Exact merge for large k that avoids XLA:CPU's TopK on most blocks.

  vals, ids (n, k): the carry (here: group maxima and their group keys); s (n, r)
  the block's values (-inf: excluded) with ids gid (r,).

  Why: TopK costs ~16 us per row at k = 100, more than the block's matmul. Once
  the carry (an unsorted buffer of the k best so far) is full, few scores of a
  block (here: of its group maxima; -inf entries are excluded) beat its
  minimum. Each row's strided sub-groups {i S + j} of _GROUP values whose max
  beats that minimum are compacted (a prefix count, no TopK); if no row has more
  than _MAX_GROUPS of them, their values are inserted one at a time in
  descending order, each replacing the buffer's minimum, until no candidate
  beats it (a while loop of O(n (k + candidates)) per insertion). Otherwise
  (early blocks) the block is merged by `_top_k_merge` under `lax.cond`. The
  result is the exact set of the k best (as values), unsorted.
  """
  n, r = s.shape
  subgroups = r // _GROUP
  grouped = s.reshape(n, _GROUP, subgroups)               # value i S + j -> [i, j]
  group_max = max_over_groups(grouped)
  floor = jnp.min(vals, axis=1)                           # (n,) the buffer's minimum
  above = group_max > floor[:, None]
  count = jnp.sum(above, axis=1)

  def insert(vals, ids):
    # The (j+1)-th group above the floor is at index #{g : running count <= j}.
    # On XLA:CPU: associative_scan (log-depth elementwise passes) beats cumsum
    # (a reduce-window); the count is summed in float32 (exact below 2^24), as
    # integer reductions are much slower; a bisection on the running counts got
    # fused into the gathers below and recomputed per gathered element.
    ranks = jax.lax.associative_scan(jnp.add, above.astype(jnp.int32), axis=1)
    slots = jnp.arange(_MAX_GROUPS, dtype=jnp.int32)
    chosen = jnp.sum(jnp.where(ranks[:, None, :] <= slots[None, :, None], 1.0, 0.0), axis=2)
    chosen = jnp.minimum(chosen.astype(jnp.int32), subgroups - 1)
    sel = jnp.broadcast_to(chosen[:, None, :], (n, _GROUP, _MAX_GROUPS))
    pos = (jnp.arange(_GROUP, dtype=jnp.int32)[:, None] * subgroups + sel).reshape(n, -1)
    cand = jnp.take_along_axis(grouped, sel, axis=2).reshape(n, -1)
    in_use = jnp.broadcast_to((jnp.arange(_MAX_GROUPS) < count[:, None])[:, None, :],
                              (n, _GROUP, _MAX_GROUPS)).reshape(n, -1)
    cand = jnp.where(in_use, cand, -jnp.inf)
    cand_ids = jnp.take(gid, pos, mode="clip")

    def beats(state):
      vals, _, cand = state
      return jnp.any(jnp.max(cand, axis=1) > jnp.min(vals, axis=1))

    def step(state):
      vals, ids, cand = state
      best, worst = jnp.max(cand, axis=1), jnp.min(vals, axis=1)
      j, i = _first_index(cand, best), _first_index(vals, worst)
      put = (jax.lax.broadcasted_iota(jnp.int32, vals.shape, 1) == i[:, None]) & (best > worst)[:, None]
      best_id = jnp.take_along_axis(cand_ids, j[:, None], axis=1)
      taken = jax.lax.broadcasted_iota(jnp.int32, cand.shape, 1) == j[:, None]
      return (jnp.where(put, best[:, None], vals), jnp.where(put, best_id, ids),
              jnp.where(taken, -jnp.inf, cand))

    vals, ids, _ = jax.lax.while_loop(beats, step, (vals, ids, cand))
    return vals, ids

  if subgroups <= _MAX_GROUPS:  # the count can never exceed the insertion's capacity
    return insert(vals, ids)
  return jax.lax.cond(jnp.max(count) <= _MAX_GROUPS, insert,
                      lambda v, i: _top_k_merge(v, i, s, gid, k), vals, ids)


def bias_at(bias_fn, extra, label_ids):
  """`bias_fn` at arbitrary per-query labels: extra (n, ...), label_ids (n, ...)
  int -> (n, ...). `bias_fn` takes contiguous label ranges, so each label is
  passed as a range of one."""
  one = lambda e, y: bias_fn(e[None], y[None])[0, 0]
  per_query = lambda e, ids: jax.vmap(one, in_axes=(None, 0))(e, ids.reshape(-1)).reshape(ids.shape)
  return jax.vmap(per_query)(extra, label_ids)


def _rows_per_group(r: int, k: int) -> int:
  """The group size P of the grouped running top-k: the largest divisor of the
  block size r that is at most the target (so the re-scoring stays O(n k P h)
  even for awkward r, e.g. 8 x 499 rows: P = 8)."""
  target = _PER_GROUP if k < _FILTER_MIN_K else _PER_GROUP_FILTERED
  return max(d for d in range(1, min(target, r) + 1) if r % d == 0)


def _local_block_top_k(q, table, k, row_block, num_labels, row_offset, normalize, bias_fn, extra,
                       with_lse=False):
  """Running top-k of q @ table.T over blocks of rows. q (n, h), table (R_loc, h).

  The scan keeps only the k largest *group maxima* (group {i G + g} of a block
  of r = P G rows: P rows strided by G), then `_rescore_groups` re-scores the
  k P rows of those groups. Exact: if an element of the top-k lay in a group
  outside those k, each of the k kept groups would hold an element (its max) at
  least as large. (Up to float32 rounding: the re-scored values may differ
  from the scan's in the last bits, so labels tied within ~1e-6 may swap.)
  Per block this is one fused max pass, then for k < _FILTER_MIN_K one TopK
  over k + G columns (merging elements instead cost two TopKs and gathers:
  1.3-1.8x slower at k = 5), for larger k `_filtered_merge`. A shard that fits
  in one block is ranked directly (re-scoring would only add work).

  Returns (vals (n, k) non-increasing, ids (n, k), lse (n,)).
  """
  n = q.shape[0]
  r_loc = table.shape[0]
  r = min(row_block, r_loc)
  num_blocks = -(-r_loc // r)
  per_group = _rows_per_group(r, k)
  groups = r // per_group
  filtered = k >= _FILTER_MIN_K and groups % _GROUP == 0 and groups // _GROUP >= _MAX_GROUPS

  def block(b):
    """Block b's scores (n, r), label ids (r,) and keep mask (r,)."""
    # The last block is shifted back to stay in range; rows it re-visits are masked.
    start = jnp.minimum(b * r, r_loc - r)
    # A bfloat16 table is upcast block by block (exact): float32 norms and products.
    rows = precision.upcast(jax.lax.dynamic_slice_in_dim(table, start, r, axis=0))
    rows = l2_normalize(rows) if normalize else rows
    local = start + jnp.arange(r)
    gid = row_offset + local
    s = q @ rows.T
    if bias_fn is not None:
      s = s + bias_fn(extra, gid)
    keep = (local >= b * r) & (gid < num_labels)  # re-visited rows and padding labels out
    return s, gid, keep

  def lse_of(s, keep):  # log-sum-exp over the block's labels (normalised log-likelihoods)
    return jax.nn.logsumexp(jnp.where(keep[None, :], s, -jnp.inf), axis=1)

  if num_blocks == 1:
    s, gid, keep = block(0)
    top, top_valid, pos = masked_top_k(s, k, jnp.broadcast_to(keep[None, :], s.shape))
    ids = jnp.where(top_valid, jnp.take(gid, pos, mode="clip"), -1)
    lse = lse_of(s, keep) if with_lse else jnp.full((n,), -jnp.inf, q.dtype)
    return jnp.where(top_valid, top, -jnp.inf), ids, lse

  def body(carry, b, first=False):
    vals, keys, lse = carry   # the k best group maxima so far and their keys b G + g
    s, gid, keep = block(b)
    group_max = max_over_groups(s.reshape(n, per_group, groups), keep.reshape(per_group, groups),
                                fill=-jnp.inf)
    if filtered:
      block_keys = b * groups + jnp.arange(groups, dtype=jnp.int32)
      # The first block always fills the (empty) buffer by TopK.
      vals, keys = (_top_k_merge if first else _filtered_merge)(vals, keys, group_max, block_keys, k)
    else:
      vals, pos = jax.lax.top_k(jnp.concatenate([vals, group_max], axis=1), k)
      kept = jnp.take_along_axis(keys, jnp.minimum(pos, k - 1), axis=1)
      keys = jnp.where(pos < k, kept, b * groups + pos - k)
    if with_lse:
      lse = jnp.logaddexp(lse, lse_of(s, keep))
    return (vals, keys, lse), None

  init = (jnp.full((n, k), -jnp.inf, q.dtype), jnp.full((n, k), -1, jnp.int32),
          jnp.full((n,), -jnp.inf, q.dtype))
  # Peeling block 0 off the scan gives a carry already typed like the blocks
  # (varying over the mesh axes inside shard_map), as scan requires.
  carry, _ = body(init, 0, first=True)
  (vals, keys, lse), _ = jax.lax.scan(body, carry, jnp.arange(1, num_blocks))
  vals, ids = _rescore_groups(q, table, keys, k, r, per_group, groups, num_labels, row_offset,
                              normalize, bias_fn, extra)
  return vals, ids, lse


def _rescore_groups(q, table, keys, k, r, per_group, groups, num_labels, row_offset, normalize,
                    bias_fn, extra):
  """The top-k elements of the k groups `keys` (n, k) (key b G + g, -1 for none).

  Their k P rows are gathered and scored one group slot at a time (memory
  O(n P h), as one block). Returns (vals (n, k) non-increasing, ids (n, k), -1
  where fewer than k labels exist)."""
  r_loc = table.shape[0]
  b, g = keys // groups, keys % groups
  start = jnp.minimum(b * r, r_loc - r)
  local = start[..., None] + jnp.arange(per_group, dtype=jnp.int32) * groups + g[..., None]  # (n, k, P)
  keep = (keys[..., None] >= 0) & (local >= (b * r)[..., None]) & (row_offset + local < num_labels)
  local = jnp.clip(local, 0, r_loc - 1)

  def slot_scores(local_nP):
    rows = precision.upcast(jnp.take(table, local_nP, axis=0, mode="clip"))  # (n, P, h), in range
    return (normalized_row_scores(q, rows) if normalize
            else jnp.einsum("nh,nph->np", q, rows))

  s = jax.lax.map(slot_scores, jnp.swapaxes(local, 0, 1))  # (k, n, P)
  s = jnp.swapaxes(s, 0, 1)
  if bias_fn is not None:
    s = s + bias_at(bias_fn, extra, row_offset + local)
  # Row-major over (P, k): when the k kept groups are in one block (G >= k),
  # exactly tied scores (equal rows) go to the lowest ids, as the TopK merge
  # keeps tied maxima in key order. Otherwise any of the tied labels may be
  # returned. (A sort by (score, id) would always pick the lowest, but XLA:CPU's
  # sort of 512 x 160 takes 15 ms, 18x a TopK.)
  flat = lambda x: jnp.swapaxes(x, 1, 2).reshape(q.shape[0], -1)
  vals, pos = jax.lax.top_k(flat(jnp.where(keep, s, -jnp.inf)), k)
  ids = jnp.take_along_axis(flat(row_offset + local), pos, axis=1)
  return vals, jnp.where(vals > -jnp.inf, ids, -1)


# Memoised: evaluators of equal arguments (every candidate and run of one shape, bias_fn None or
# the same function) share one jitted retrieval, so it is traced, lowered and compiled once.
@functools.lru_cache(maxsize=64)
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
