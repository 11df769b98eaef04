"""Distributed top-k: a local top-k on each label shard (`losses.masked_top_k`),
then a merge of the M * k candidates. Runs inside `shard_map`.

Why not one global top_k: the scores of the B sampled labels (or of all K
labels at evaluation) live on M shards; exchanging only each shard's k best
(values and ids) costs O(N k M) instead of O(N B).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def all_gather_last_axis(x, axis_name):
  """(..., k) per shard -> (..., M k) shard-ordered, *replicated* over `axis_name`.

  `lax.all_gather`'s result is still typed as varying over the axis under
  shard_map's replication checking (jax 0.10), so the merged top-k could not be
  returned as replicated. Placing each shard's block in its own slot of a zero
  buffer and `psum`-ming gives the same values typed as invariant, and a
  correct transpose for autodiff. Values may be +-inf (never NaN: the other
  slots add exact zeros).
  """
  m = jax.lax.axis_size(axis_name)
  j = jax.lax.axis_index(axis_name)
  dtype = x.dtype
  work = x.astype(jnp.int32) if dtype == jnp.bool_ else x
  buf = jnp.zeros(work.shape[:-1] + (m,) + work.shape[-1:], work.dtype)
  buf = jax.lax.dynamic_update_index_in_dim(buf, work[..., None, :], j, axis=-2)
  out = jax.lax.psum(buf, axis_name).reshape(work.shape[:-1] + (m * work.shape[-1],))
  return out.astype(dtype)


def merge_top_k_across(values, ids, valid, k: int, axis_name):
  """Merges per-shard top-k candidates (..., k) into the global top-k over `axis_name`.

  Exchanges only the k (value, id, valid) triples of each shard.
  Ties between shards are broken by shard order, as a single top_k over the
  concatenated shard-ordered candidates would.
  """
  all_values = all_gather_last_axis(values, axis_name)
  all_ids = all_gather_last_axis(ids, axis_name)
  all_valid = all_gather_last_axis(valid, axis_name)
  top_values, pos = jax.lax.top_k(jnp.where(all_valid, all_values, NEG_INF), k)
  return (top_values, jnp.take_along_axis(all_ids, pos, axis=-1),
          jnp.take_along_axis(all_valid, pos, axis=-1))
