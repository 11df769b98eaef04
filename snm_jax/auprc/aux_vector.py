"""SOPRC's auxiliary vector v: batch positives -> N quantiles (Alg. 2) -> EMA (Eq. 10).

v stands for the sorted scores of all N+ positives of a query (or of a class of
queries, one row per class). Each step the batch's positive scores are sorted,
linearly interpolated onto N quantile positions and averaged into v. v is state,
not a parameter: it lives in the train state, is checkpointed with it, and every
entry point stops gradients through it.

Quantile convention: the i-th of n sorted values (0-based) sits at position
(i + 1/2) / n and the j-th of N outputs at (j + 1/2) / N. Outputs below the first
or above the last input position are extrapolated from the end segment and, like
all outputs, clipped to the score range [b, B] (Alg. 2). For a quantile function
p with bounded p'' sampled exactly, the error is <= ||p''|| / (8 n^2) between
the first and last input positions (Prop. 3) and <= 3 ||p''|| / (8 n^2) in the
extrapolated end pieces (each at most half a spacing long).
"""
from typing import Tuple

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class AuxVectorState:
  """Auxiliary vectors of C classes (C = 1 for a single query).

  Attributes:
    v: (C, N) float, row c approximates the sorted positive scores of class c.
    count: (C,) int32, number of updates row c has received.
  """
  v: jax.Array
  count: jax.Array


def quantile_positions(n: int) -> jax.Array:
  """(n,) positions (i + 1/2) / n of n sorted samples on [0, 1]."""
  return (jnp.arange(n, dtype=jnp.float32) + 0.5) / n


def init_aux_vector(num_classes: int, num_aux: int,
                    score_range: Tuple[float, float]) -> AuxVectorState:
  """Every row = the N quantiles of the uniform distribution on [b, B]."""
  lo, hi = score_range
  row_N = lo + (hi - lo) * quantile_positions(num_aux)
  return AuxVectorState(
      v=jnp.tile(row_N[None, :], (num_classes, 1)),
      count=jnp.zeros((num_classes,), jnp.int32))


def interpolate_to_quantiles(values_n: jax.Array, mask_n: jax.Array,
                             num_out: int,
                             score_range: Tuple[float, float]):
  """Algorithm 2: n (masked) values -> num_out values at quantile positions.

  Args:
    values_n: (n,) scores, any order; entries with mask False are ignored.
    mask_n: (n,) bool.
    num_out: static N.
    score_range: (b, B) clip range of the outputs.

  Returns:
    (out_N, has_values): (N,) non-decreasing interpolated values (zeros when no
    entry is valid) and a scalar bool, False when mask_n has no True entry.
  """
  lo, hi = score_range
  size = values_n.shape[0]
  n = jnp.sum(mask_n.astype(jnp.int32))
  sorted_n = jnp.sort(jnp.where(mask_n, values_n, jnp.inf))
  sorted_n = jnp.where(jnp.arange(size) < n, sorted_n, 0.0)  # no inf arithmetic
  t_N = quantile_positions(num_out) * n.astype(jnp.float32) - 0.5
  i0_N = jnp.clip(jnp.floor(t_N).astype(jnp.int32), 0, jnp.maximum(n - 2, 0))
  i1_N = jnp.minimum(i0_N + 1, jnp.maximum(n - 1, 0))
  y0_N, y1_N = sorted_n[i0_N], sorted_n[i1_N]
  out_N = y0_N + (t_N - i0_N) * (y1_N - y0_N)
  has_values = n > 0
  return jnp.where(has_values, jnp.clip(out_N, lo, hi), 0.0), has_values


def ema_update(v, target, beta):
  """Eq. 10: v <- (1 - beta) v + beta target (elementwise, broadcasting)."""
  return (1.0 - beta) * v + beta * target


def update_aux_vector(state: AuxVectorState,
                      class_ids_G: jax.Array,
                      values_GxM: jax.Array,
                      mask_GxM: jax.Array,
                      *,
                      beta: float,
                      score_range: Tuple[float, float],
                      init_from_first_batch: bool = False) -> AuxVectorState:
  """Interpolates G groups of positive scores and folds them into their rows.

  Args:
    state: current AuxVectorState with v of shape (C, N).
    class_ids_G: (G,) int, distinct row indices to update (duplicates: only one
      of the writes survives).
    values_GxM: (G, M) positive scores observed for each class this step
      (gradients are stopped).
    mask_GxM: (G, M) bool validity of `values_GxM`; a row with no valid entry
      leaves its class unchanged.
    beta: EMA rate of Eq. 10 (0.001 in the paper).
    score_range: (b, B) clip range of the interpolation.
    init_from_first_batch: if True, a row that was never updated takes the
      interpolation as is (beta = 1) instead of averaging it with the init.

  Returns:
    The new AuxVectorState.
  """
  num_aux = state.v.shape[-1]
  values_GxM = jax.lax.stop_gradient(values_GxM)
  target_GxN, has_G = jax.vmap(
      lambda x, m: interpolate_to_quantiles(x, m, num_aux, score_range))(
          values_GxM, mask_GxM)
  old_GxN = state.v[class_ids_G]
  beta_G = jnp.full(class_ids_G.shape, beta, state.v.dtype)
  if init_from_first_batch:
    beta_G = jnp.where(state.count[class_ids_G] == 0, 1.0, beta_G)
  new_GxN = jnp.where(has_G[:, None],
                      ema_update(old_GxN, target_GxN, beta_G[:, None]),
                      old_GxN)
  return AuxVectorState(
      v=state.v.at[class_ids_G].set(new_GxN),
      count=state.count.at[class_ids_G].add(has_G.astype(jnp.int32)))


def within_group_targets(scores_BxB: jax.Array, num_groups: int, m: int):
  """The aux vector's targets in a class-balanced batch (G groups of M items,
  group-major): each group's positive-pair scores, ((G, M*M) values, (G, M*M)
  mask of the off-diagonal pairs)."""
  blocks = scores_BxB.reshape(num_groups, m, num_groups, m)
  blocks = blocks[jnp.arange(num_groups), :, jnp.arange(num_groups), :]  # (G, M, M)
  mask = jnp.broadcast_to(~jnp.eye(m, dtype=bool), blocks.shape)
  return blocks.reshape(num_groups, m * m), mask.reshape(num_groups, m * m)
