"""`snm_jax.data.index_shuffle` is Grain's index shuffle, value by value, for arrays of positions."""

import itertools

import grain
import numpy as np
import pytest

from snm_jax.data.index_shuffle import index_shuffle

SEEDS, ROUNDS = (0, 7, 2**32 - 1), (4, 8)
COMBOS = list(itertools.product(SEEDS, ROUNDS))
# M <= 7: the block is its minimum 16 bits, so a position cycle-walks up to tens of thousands of
# encryptions (each a loop pass of NumPy calls on a few values) before it lands in [0, M]: 4.7-7.3 s
# per M for the six seed x rounds pairs (`make test`). Each of these M checks two pairs, one of each
# rounds and two seeds, together all six (of such assignments, the one with the shortest walks);
# every other M (255 also a 16-bit block) checks all six.
TINY = {1: [(7, 4), (0, 8)], 2: [(2**32 - 1, 4), (7, 8)], 7: [(0, 4), (2**32 - 1, 8)]}
assert sorted(sum(TINY.values(), [])) == sorted(COMBOS)


@pytest.mark.parametrize("max_index", [1, 2, 7, 255, 4391, 65535, 65536, 65537, 100_003, 2**32 - 1,
                                       2**32, 2**40 + 3, 2**62 + 5])
def test_equals_grains_binding(max_index):
  rng = np.random.default_rng(max_index % 1000)
  positions = np.unique(np.concatenate([np.arange(min(max_index + 1, 200)),
                                        rng.integers(0, max_index + 1, 200, dtype=np.int64)]))
  for seed, rounds in TINY.get(max_index, COMBOS):
    want = [grain.experimental.index_shuffle(int(j), max_index=max_index, seed=seed, rounds=rounds)
            for j in positions]
    np.testing.assert_array_equal(index_shuffle(positions, max_index, seed, rounds), want)


def test_a_whole_range_is_a_permutation_and_seeds_differ():
  a, b = index_shuffle(np.arange(4392), 4391, 3), index_shuffle(np.arange(4392), 4391, 4)
  np.testing.assert_array_equal(np.sort(a), np.arange(4392))
  assert (a != b).mean() > 0.99
  np.testing.assert_array_equal(index_shuffle(np.zeros(3, np.int64), 0, 3), [0, 0, 0])  # M = 1


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match=r"positions must be in \[0, 9\]"):
    index_shuffle(np.array([10]), 9, 0)
  with pytest.raises(ValueError, match="rounds must be even"):
    index_shuffle(np.array([1]), 9, 0, rounds=5)
