"""Class-balanced batch sampler: structure, determinism, class frequencies."""
import numpy as np
import pytest

from snm_jax.auprc import ClassBalancedSampler
from snm_jax.errors import ConfigError


def _long_tailed_labels(seed=0):
  sizes = np.maximum(2, (400 / np.arange(1, 81) ** 1.1).astype(int))  # 80 classes
  labels = np.repeat(np.arange(80) * 3 + 7, sizes)                    # sparse ids
  return np.random.default_rng(seed).permutation(labels), sizes


def test_batches_have_m_per_class_distinct_classes_and_true_labels():
  labels, sizes = _long_tailed_labels()
  sampler = ClassBalancedSampler(labels, samples_per_class=4, batch_size=224, seed=3)
  assert sampler.num_groups == 56
  eligible = set((np.arange(80) * 3 + 7)[sizes >= 4])
  assert set(sampler.classes) == eligible
  idx, classes = sampler.batches(0, 30)
  assert idx.shape == (30, 224) and classes.shape == (30, 56)
  for b in range(30):
    assert len(set(classes[b])) == 56 and set(classes[b]) <= eligible
    groups = labels[idx[b]].reshape(56, 4)
    np.testing.assert_array_equal(groups, np.repeat(classes[b][:, None], 4, 1))
    assert len(set(idx[b])) == 224  # no item twice in a batch


def test_deterministic_in_seed_and_step_only():
  labels, _ = _long_tailed_labels()
  a = ClassBalancedSampler(labels, batch_size=40, seed=11)
  b = ClassBalancedSampler(labels, batch_size=40, seed=11)
  c = ClassBalancedSampler(labels, batch_size=40, seed=12)
  np.testing.assert_array_equal(a.batch(17)[0], b.batch(17)[0])  # any order of calls
  np.testing.assert_array_equal(a.batches(5, 3)[0][1], b.batch(6)[0])
  assert not np.array_equal(a.batch(17)[0], c.batch(17)[0])
  assert not np.array_equal(a.batch(17)[0], a.batch(18)[0])


def test_iterator_resumes_from_its_state():
  labels, _ = _long_tailed_labels()
  a = ClassBalancedSampler(labels, batch_size=40, seed=11)
  first = [next(a)[0] for _ in range(3)]
  np.testing.assert_array_equal(first[2], a.batch(2)[0])
  saved = a.get_state()
  after = next(a)[0]
  b = ClassBalancedSampler(labels, batch_size=40, seed=11)
  b.set_state(saved)
  np.testing.assert_array_equal(next(b)[0], after)
  with pytest.raises(ValueError, match="does not belong"):
    ClassBalancedSampler(labels, batch_size=40, seed=12).set_state(saved)


def test_class_frequencies_follow_weighting():
  labels, sizes = _long_tailed_labels()
  keep = sizes >= 4
  for weighting in ("size", "uniform"):
    sampler = ClassBalancedSampler(labels, batch_size=8, seed=0,
                                   class_weighting=weighting)
    _, classes = sampler.batches(0, 3000)
    freq = np.array([(classes == c).sum() for c in sampler.classes]) / classes.size
    if weighting == "size":
      # Two classes per batch drawn without replacement: close to proportional.
      p = sizes[keep] / sizes[keep].sum()
      assert np.corrcoef(freq, p)[0, 1] > 0.98
      assert freq[0] > 10 * freq[-1]
    else:
      np.testing.assert_allclose(freq, 1 / keep.sum(), atol=0.01)


def test_bad_settings_raise_config_error():
  labels, _ = _long_tailed_labels()
  with pytest.raises(ConfigError, match="batch_size"):
    ClassBalancedSampler(labels, samples_per_class=4, batch_size=30)
  with pytest.raises(ConfigError, match="samples_per_class"):
    ClassBalancedSampler(labels, samples_per_class=1, batch_size=30)
  with pytest.raises(ConfigError, match="batch_size"):
    ClassBalancedSampler(labels, samples_per_class=4, batch_size=4 * 200)
  with pytest.raises(ConfigError, match="class_weighting"):
    ClassBalancedSampler(labels, class_weighting="zipf")
