"""Reduced precision: the compute dtype of the towers and scores, and rounding a float32
table update into a bfloat16 table.

Two independent choices (config `model.dtype`, `table.dtype`):

* compute dtype (`model.dtype`): the towers compute their matmuls in it from float32
  parameters (flax `dtype=` / `param_dtype=`), with float32 accumulation
  (`preferred_element_type=float32`); they return float32 queries (L2-normalised in
  float32). The step's scores q . row multiply the query and the gathered class rows
  in it, again accumulating in float32, and every loss is computed in float32. With
  bfloat16 (8 significant bits, 7 stored) each rounded factor carries a relative error
  of at most u = 2^-8 (round to nearest: half the 2^-7 spacing at 1), so a product of two
  carries at most 2u + u^2 ~ 2^-7.
* storage dtype of the class table (`table.dtype`): a bfloat16 table takes half the
  memory of a float32 one (the point at K = 10^6 and beyond). Gathered rows are upcast
  to float32 (`upcast`; exact: every bfloat16 value is a float32 value), the row update
  is computed in float32 and rounded back when written (`round_rows`), by round-to-
  nearest-even or stochastically.

  The bfloat16 values are held as their bit patterns in a uint16 array (`STORAGE`,
  `to_storage`; `upcast` reads them back): XLA:CPU has no bfloat16 scatter, and rewrites
  a scatter into a bfloat16 array as a float32 copy of the whole table, a scatter and a
  copy back (measured at K = 10^6, h = 128: 1.3 s per step and 0.5 GB of temporaries,
  against 0.75 ms and nothing for the same scatter into uint16). Converting the array's
  type inside the step is a full copy as well, hence the storage type. Checkpoints hold
  the uint16 bits (`upcast` or `jax.lax.bitcast_convert_type(x, jnp.bfloat16)` reads them).

Stochastic rounding: round-to-nearest loses every update smaller than half an ulp of the
row's entry (lr |g| below 2^-9 to 2^-8 of |w|), however often it repeats; rounding x up with probability
(x - down(x)) / ulp makes the written value unbiased, E[round(x)] = x, so small updates
survive on average. Implemented on the float32 bit pattern: add 16 uniform random bits
to its low half, then truncate it (bfloat16 is the high half of a float32). The bits of
a row come from `fold_in(key, global row id)`, so they do not depend on the mesh (which
shard owns the row) and a run is deterministic given its seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # config name -> compute dtype
STORAGE = {"float32": jnp.float32, "bfloat16": jnp.uint16}   # config name -> a table's storage dtype
ROUNDINGS = ("nearest", "stochastic")


def storage_of(name: str):
  """The storage dtype of a table of config dtype `name` (module docstring): float32 | uint16."""
  if name not in STORAGE:
    raise ValueError(f"{name!r} is not one of {list(STORAGE)}")
  return STORAGE[name]


def to_storage(x, storage):
  """float32 values x in a table of `storage` dtype: float32 unchanged; uint16: the bits of
  x rounded to nearest bfloat16."""
  if jnp.dtype(storage) == jnp.dtype(jnp.uint16):
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
  return x.astype(storage)


def upcast(x):
  """Rows read from a table (any storage) as float32: uint16 bfloat16 bits are reinterpreted
  and widened (exact); a float32 array is returned as it is."""
  if x.dtype == jnp.uint16:
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16).astype(jnp.float32)
  return x.astype(jnp.float32)


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


def matmul_nt(a, b, dtype):
  """a @ b.T, (n, h) x (S, h) -> (n, S), with both factors in `dtype`, accumulated and returned in
  float32: one dot_general contracting the last axes. Differentiated, b's cotangent then comes out
  (S, h), b's own layout; `a @ b.T`'s comes out (h, S) and every consumer (the table's update, its
  finiteness check) reads it transposed: on a 4,000 x 5,001 class table the linear step took 377 ms
  against 255 ms so (interleaved, 2 CPU cores)."""
  dims = (((1,), (1,)), ((), ()))
  if not is_reduced(dtype):
    return jax.lax.dot_general(a, b, dims)
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), dims, preferred_element_type=jnp.float32)


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
  """float32 rows (T, h) written into a table of `dtype` (a storage dtype, or bfloat16).

  float32: unchanged. bfloat16 (or its uint16 storage: the bits are returned):
  round-to-nearest-even (`rounding="nearest"`) or `stochastic_round_bf16` with the bits of
  row t drawn from fold_in(key, row_ids[t]) (`row_ids` (T,): the rows' global ids, so the
  draw does not depend on the mesh).
  """
  if not is_reduced(dtype):
    return rows.astype(dtype)
  bits_out = jnp.dtype(dtype) == jnp.dtype(jnp.uint16)
  if not bits_out and jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    raise ValueError(f"rows are rounded to bfloat16, not {dtype}")
  if rounding == "nearest":
    out = rows.astype(jnp.bfloat16)
  elif rounding == "stochastic" and key is not None and row_ids is not None:
    bits = jax.vmap(lambda r: jax.random.bits(jax.random.fold_in(key, r), rows.shape[1:], jnp.uint16))(
        row_ids.astype(jnp.uint32))
    out = stochastic_round_bf16(rows, bits)
  else:
    raise ValueError(f"rounding={rounding!r} (one of {ROUNDINGS}); stochastic needs key and row_ids")
  return jax.lax.bitcast_convert_type(out, jnp.uint16) if bits_out else out
