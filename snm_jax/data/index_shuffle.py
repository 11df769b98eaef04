"""Grain's index shuffle (`grain.experimental.index_shuffle`) for an array of positions at once.

`index_shuffle(positions, max_index, seed, rounds)[i]` equals
`grain.experimental.index_shuffle(positions[i], max_index=max_index, seed=seed, rounds=rounds)`,
the position's image in a pseudorandom permutation of [0, max_index]: the permutation of
`grain.MapDataset.range(max_index + 1).shuffle(seed)`, computed per position, so no O(M) array
is built for an epoch of M examples.

Hand-written because Grain binds the shuffle one index per call: ~13 us a call on this machine
(the C++ re-derives its round keys each time and cycle-walks a block of >= 2^16 values), 7.8 ms
of the 8 ms that built one Bibtex batch of 512 rows, on the step's critical path. The algorithm,
as Grain's C++ defines it (grain/_src/python/experimental/index_shuffle/index_shuffle.cc):
- round keys: `rounds` uint32 words of C++'s `std::seed_seq{seed}.generate` ([rand.util.seedseq]);
- a Simon-like Feistel cipher on a block of B = max(16, ceil(log2(max_index)) rounded up to even)
  bits, two words of W = B/2 bits; each pair of rounds: left ^= f(right) ^ k[i],
  right ^= f(left) ^ k[i+1], with f(x) = (rotl(x, 1) & rotl(x, 8)) ^ rotl(x, 2) on W bits;
- cycle walking: a value above max_index is encrypted again until it is not.
`tests/test_index_shuffle.py` checks it against Grain's binding value by value.
"""
from __future__ import annotations

import functools
import math

import numpy as np

_MASK32 = 0xFFFFFFFF


@functools.lru_cache(maxsize=256)
def _round_keys(seed: int, rounds: int) -> tuple[int, ...]:
  """`rounds` words of `std::seed_seq{seed}.generate` (C++ [rand.util.seedseq]), as uint32."""
  n, v = rounds, [seed & _MASK32]
  s = len(v)
  b = [0x8B8B8B8B] * n
  t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
  p = (n - t) // 2
  q = p + t
  m = max(s + 1, n)

  def mix(x):
    return x ^ (x >> 27)

  for k in range(m):
    r1 = (1664525 * mix(b[k % n] ^ b[(k + p) % n] ^ b[(k - 1) % n])) & _MASK32
    r2 = (r1 + (s if k == 0 else (k % n + v[k - 1]) if k <= s else k % n)) & _MASK32
    b[(k + p) % n] = (b[(k + p) % n] + r1) & _MASK32
    b[(k + q) % n] = (b[(k + q) % n] + r2) & _MASK32
    b[k % n] = r2
  for k in range(m, m + n):
    r3 = (1566083941 * mix((b[k % n] + b[(k + p) % n] + b[(k - 1) % n]) & _MASK32)) & _MASK32
    r4 = (r3 - k % n) & _MASK32
    b[(k + p) % n] ^= r3
    b[(k + q) % n] ^= r4
    b[k % n] = r4
  return tuple(b)


def _block_bits(max_index: int) -> int:
  """B: ceil(log2(max_index)) (of the double, as the C++), made even, at least 16, at most 64."""
  bits = math.ceil(math.log2(float(max_index)))
  return min(max(bits + bits % 2, 16), 64)


def _round_function(a: np.ndarray, w: int) -> np.ndarray:
  """f(a) = (rotl(a, 1) & rotl(a, 8)) ^ rotl(a, 2) on w-bit words (uint64)."""
  mask = np.uint64((1 << w) - 1)

  def rotl(x, r):
    return ((x << np.uint64(r)) | (x >> np.uint64(w - r))) & mask

  return (rotl(a, 1) & rotl(a, 8)) ^ rotl(a, 2)


@functools.lru_cache(maxsize=8)
def _round_function_table(w: int) -> np.ndarray:
  """f of every w-bit word (w <= 16: at most 2^16 entries), so a round is one gather."""
  return _round_function(np.arange(1 << w, dtype=np.uint64), w)


def _encrypt(x: np.ndarray, keys: tuple[int, ...], w: int) -> np.ndarray:
  """The Feistel cipher on uint64 blocks of 2w bits."""
  mask = np.uint64((1 << w) - 1)
  if w <= 16:
    table = _round_function_table(w)
    f = table.__getitem__
  else:
    f = functools.partial(_round_function, w=w)
  left, right = (x >> np.uint64(w)) & mask, x & mask
  for i in range(0, len(keys), 2):
    left ^= f(right) ^ (np.uint64(keys[i]) & mask)
    right ^= f(left) ^ (np.uint64(keys[i + 1]) & mask)
  return (left << np.uint64(w)) | right


def index_shuffle(positions, max_index: int, seed: int, rounds: int = 4) -> np.ndarray:
  """int64 (n,): each of `positions` (n,) (ints in [0, max_index]) through Grain's permutation of
  [0, max_index] for `seed` (taken mod 2^32, as Grain's uint32 argument) and `rounds` (even, 4..1024)."""
  positions = np.asarray(positions, np.int64)
  if positions.size and (positions.min() < 0 or positions.max() > max_index):
    raise ValueError(f"positions must be in [0, {max_index}], got "
                     f"[{positions.min()}, {positions.max()}]")
  if rounds < 4 or rounds > 1024 or rounds % 2:
    raise ValueError(f"rounds must be even and in [4, 1024], got {rounds}")
  if max_index == 0:
    return np.zeros_like(positions)
  keys, w = _round_keys(int(seed) & _MASK32, rounds), _block_bits(max_index) // 2
  out = _encrypt(positions.astype(np.uint64), keys, w)
  walking = np.flatnonzero(out > np.uint64(max_index))
  while walking.size:  # cycle walking, on the values still out of range
    out[walking] = _encrypt(out[walking], keys, w)
    walking = walking[out[walking] > np.uint64(max_index)]
  return out.astype(np.int64)
