"""Masked ranking helpers shared by the ordered weighted losses.

Convention: `valid` is a bool array, True for entries that take part. Invalid
entries are ranked last and contribute exactly 0; they may hold any value
(even inf/NaN) without producing NaN gradients.
"""

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from snm_jax.losses.surrogates import Phi

KINDS = ("bowl", "powl")


def check_kind(kind: str) -> str:
  if kind not in KINDS:
    raise ValueError(f"kind: must be one of {KINDS}, got {kind!r}")
  return kind


def as_float(x) -> jax.Array:
  """`x` as a JAX array of a floating dtype (ints become the default float)."""
  x = jnp.asarray(x)
  return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(float)


def rank_key(scores: jax.Array, valid: Optional[jax.Array]) -> jax.Array:
  """Scores with invalid entries replaced by the lowest finite value.

  A finite fill (not -inf) keeps every later subtraction finite; invalid
  entries still sort after every valid finite score.
  """
  if valid is None:
    return scores
  return jnp.where(valid, scores, jnp.finfo(scores.dtype).min)


def _num_groups(width: int, k: int) -> int | None:
  """The group count G of `top_k`'s two-stage path, or None for one `lax.top_k`.

  G (a power of two dividing `width`, >= k) minimises the two stages' widths
  G + (width / G) k; the path is taken only if that is at most width / 4.
  """
  best = None
  g = 1
  while g <= width:
    if width % g == 0 and g >= k:
      cost = g + (width // g) * k
      if best is None or cost < best[0]:
        best = (cost, g)
    g *= 2
  return best[1] if best is not None and 4 * best[0] <= width else None


def max_over_groups(grouped, valid=None, fill=None):
  """max over axis -2 of (..., P, G), entries with `valid` (broadcastable) False
  taken as `fill` (default: the lowest finite value, as `rank_key`; unused
  without `valid`).

  For small P as a chain of elementwise maxima, each slice masked on its own:
  XLA:CPU then fuses the producer and the mask into one pass over `grouped`. A
  reduce, or a mask applied to the whole array first, writes the masked array
  out before reducing it (measured 2-3x slower).
  """
  per_group = grouped.shape[-2]
  if valid is not None:
    valid = jnp.broadcast_to(valid, grouped.shape)
    fill = jnp.finfo(grouped.dtype).min if fill is None else fill
  if per_group > 64:
    return jnp.max(grouped if valid is None else jnp.where(valid, grouped, fill), axis=-2)
  slices = [grouped[..., i, :] if valid is None else jnp.where(valid[..., i, :], grouped[..., i, :], fill)
            for i in range(per_group)]
  return functools.reduce(jnp.maximum, slices)


def top_k_candidates(keys: jax.Array, k: int, valid: Optional[jax.Array] = None):
  """A small superset of the top-k of the last axis: (values (..., C), indices (..., C)).

  With `valid`, the keys are `rank_key(keys, valid)`: the mask is applied
  inside the group-max pass and to the gathered candidates, so the masked
  (..., S) keys are never written out.

  Why: XLA's CPU TopK costs ~2.5 ns per element plus microseconds per row,
  more than the matmul that produced the scores (2 h FLOPs per element). With
  G strided groups {i G + g} (G from `_num_groups`), the candidates are the
  (S / G) k elements of the k groups with the largest maxima: one fused max
  pass plus a top-k over G. They hold the top-k exactly: if an element of the
  top-k lay in a group outside those k, each of the k chosen groups would hold
  an element (its max) at least as large, so the chosen groups already hold k
  elements >= it. If no grouping pays off, the candidates are all S entries.
  No gradient (use on keys).
  """
  width = keys.shape[-1]
  groups = _num_groups(width, k)
  if groups is None:
    idx = jax.lax.broadcasted_iota(jnp.int32, keys.shape, keys.ndim - 1)
    return rank_key(keys, valid), idx
  *lead, _ = keys.shape
  per_group = width // groups
  group = lambda x: x.reshape(*lead, per_group, groups)   # element i G + g -> [i, g]
  grouped = group(keys)
  _, group_ids = jax.lax.top_k(max_over_groups(grouped, None if valid is None else group(valid)), k)
  # Indices come from top_k, so in range: no out-of-range masking needed.
  sel = jnp.broadcast_to(group_ids[..., None, :], (*lead, per_group, k))
  pick = lambda x: jnp.take_along_axis(x, sel, axis=-1, mode="promise_in_bounds")
  cand = pick(grouped) if valid is None else rank_key(pick(grouped), pick(group(valid)))
  idx = jnp.arange(per_group, dtype=jnp.int32)[:, None] * groups + sel
  return cand.reshape(*lead, per_group * k), idx.reshape(*lead, per_group * k)


def top_k(keys: jax.Array, k: int, valid: Optional[jax.Array] = None):
  """Exactly `jax.lax.top_k(rank_key(keys, valid), k)` (values; indices up to
  ties), faster for k << width: a `lax.top_k` over `top_k_candidates` only.

  Args:
    keys: (..., S) float.
    k: static, 1 <= k <= S.
    valid: optional (..., S) bool; invalid keys rank last.
  Returns:
    (values (..., k) non-increasing, indices (..., k) int32 into the last axis).
  """
  if _num_groups(keys.shape[-1], k) is None:
    return jax.lax.top_k(rank_key(keys, valid), k)
  cand, cand_idx = top_k_candidates(keys, k, valid)
  values, pos = jax.lax.top_k(cand, k)
  return values, jnp.take_along_axis(cand_idx, pos, axis=-1, mode="promise_in_bounds")


def masked_top_k(scores_xB: jax.Array, k: int, valid_xB: Optional[jax.Array] = None):
  """The k largest valid scores along the last axis, in non-increasing order.

  Uses `top_k` (exact, no full sort). If fewer than k entries are valid -- or
  k exceeds B, e.g. on a label shard holding fewer than k sampled negatives --
  the result is padded with invalid entries, flagged False in `top_valid`.

  Args:
    scores_xB: (..., B) float scores.
    k: static int >= 1.
    valid_xB: optional (..., B) bool, True for entries that may be ranked.

  Returns:
    (top_scores (..., k), top_valid (..., k) bool, top_idx (..., k) int32);
    `top_scores` are gathered from `scores_xB`, so gradients flow to them.
    Invalid slots hold arbitrary finite or padded values: guard them with
    `top_valid` before any arithmetic.
  """
  scores_xB = as_float(scores_xB)
  valid_xB = jnp.ones(scores_xB.shape, bool) if valid_xB is None else jnp.asarray(valid_xB, bool)
  if k > scores_xB.shape[-1]:
    widths = [(0, 0)] * (scores_xB.ndim - 1) + [(0, k - scores_xB.shape[-1])]
    scores_xB, valid_xB = jnp.pad(scores_xB, widths), jnp.pad(valid_xB, widths)
  _, idx = top_k(jax.lax.stop_gradient(scores_xB), k, valid_xB)
  top = jnp.take_along_axis(scores_xB, idx, axis=-1, mode="promise_in_bounds")
  return top, jnp.take_along_axis(valid_xB, idx, axis=-1, mode="promise_in_bounds"), idx


def owl_terms(pos, neg, kind: str):
  """The argument of phi for each negative: -v_j (BOWL) or v_y - v_j (POWL); pos (...,), neg (..., B)."""
  return -neg if kind == "bowl" else pos[..., None] - neg


def phi_terms(pos_score: jax.Array, neg_scores: jax.Array, phi: Phi, kind: str,
              valid: Optional[jax.Array] = None) -> jax.Array:
  """Per-negative terms: phi(v_y - v_j) (POWL) or phi(-v_j) (BOWL).

  Args:
    pos_score: (...,) positive score v_y, broadcast against the last axis.
    neg_scores: (..., B) negative scores v_j.
    phi: surrogate callable.
    kind: "powl" or "bowl".
    valid: optional (..., B) bool; invalid terms are exactly 0.

  Returns:
    (..., B) array of terms.
  """
  u = owl_terms(pos_score, neg_scores, kind)
  if valid is None:
    return phi(u)
  # Double where: evaluating phi at a benign u for invalid entries keeps the
  # backward pass free of 0 * inf = NaN (e.g. exponential at garbage scores).
  u_safe = jnp.where(valid, u, jnp.ones_like(u))
  return jnp.where(valid, phi(u_safe), jnp.zeros_like(u_safe))
