"""Reduced precision: the compute dtype of the towers and scores, and rounding a float32
table update into a bfloat16 table.

Two independent choices (config `model.dtype`, `table.dtype`):

* compute dtype (`model.dtype`): the towers compute their matmuls in it from float32
  parameters (flax `dtype=` / `param_dtype=`), with float32 accumulation
  (`preferred_element_type=float32`); they return float32 queries (L2-normalised in
  float32). The step's scores q . row multiply the query and the gathered class rows
  in it, again accumulating in float32, and every loss is computed in float32. With
  bfloat16 (8 significant bits) each rounded factor carries a relative error of at
  most 2^-9 (round to nearest), so a product of two carries at most ~2^-8.
* storage dtype of the class table (`table.dtype`): a bfloat16 table takes half the
  memory of a float32 one (the point at K = 10^6 and beyond). Gathered rows are upcast
  to float32 (exactly: every bfloat16 value is a float32 value), the row update is
  computed in float32 and rounded back when written (`round_rows`), by round-to-nearest-
  even or stochastically.

Stochastic rounding: round-to-nearest loses every update smaller than half an ulp of the
row's entry (lr g < 2^-9 |w|), however often it repeats; rounding x up with probability
(x - down(x)) / ulp makes the written value unbiased, E[round(x)] = x, so small updates
survive on average. Implemented on the float32 bit pattern: add 16 uniform random bits
to its low half, then truncate it (bfloat16 is the high half of a float32). The bits of
a row come from `fold_in(key, global row id)`, so they do not depend on the mesh (which
shard owns the row) and a run is deterministic given its seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # config name -> dtype
ROUNDINGS = ("nearest", "stochastic")


def dtype_of(name: str):
  """The jnp dtype of a config name ("float32" | "bfloat16"); ValueError otherwise."""
  if name not in DTYPES:
    raise ValueError(f"{name!r} is not one of {list(DTYPES)}")
  return DTYPES[name]


def is_reduced(dtype) -> bool:
  """True for a dtype narrower than float32 (the reduced-precision paths)."""
  return jnp.dtype(dtype) != jnp.dtype(jnp.float32)


def matmul(a, b, dtype):
  """a @ b with both factors in `dtype`, accumulated and returned in float32.
  float32: exactly `a @ b` (the same program as before the compute dtype existed)."""
  if not is_reduced(dtype):
    return a @ b
  return jnp.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def einsum(spec: str, a, b, dtype):
  """`jnp.einsum(spec, a, b)` with both factors in `dtype`, accumulated in float32."""
  if not is_reduced(dtype):
    return jnp.einsum(spec, a, b)
  return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def stochastic_round_bf16(x, bits):
  """x (float32, any shape) rounded to bfloat16 up or down at random, unbiased:
  E[result] = x for finite x below the largest bfloat16. bits: uint32 of x's shape, of
  which the low 16 are used. Infinities and NaNs stay what they are."""
  word = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  rounded = (word + (bits.astype(jnp.uint32) & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000)
  # An infinity (low half 0) is unchanged by the above; keep non-finite values exactly.
  out = jax.lax.bitcast_convert_type(rounded, jnp.float32)
  return jnp.where(jnp.isfinite(x), out, x).astype(jnp.bfloat16)


def round_rows(rows, dtype, rounding: str = "nearest", key=None, row_ids=None):
  """float32 rows (T, h) written into a table of `dtype`.

  float32: unchanged. bfloat16: round-to-nearest-even (`rounding="nearest"`) or
  `stochastic_round_bf16` with the bits of row t drawn from fold_in(key, row_ids[t])
  (`row_ids` (T,): the rows' global ids, so the draw does not depend on the mesh).
  """
  if not is_reduced(dtype):
    return rows.astype(dtype)
  if rounding == "nearest":
    return rows.astype(dtype)
  if rounding != "stochastic" or key is None or row_ids is None:
    raise ValueError(f"rounding={rounding!r} (one of {ROUNDINGS}); stochastic needs key and row_ids")
  if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    raise ValueError(f"stochastic rounding is implemented for bfloat16, not {dtype}")
  bits = jax.vmap(lambda r: jax.random.bits(jax.random.fold_in(key, r), rows.shape[1:], jnp.uint16))(
      row_ids.astype(jnp.uint32))
  return stochastic_round_bf16(rows, bits)
