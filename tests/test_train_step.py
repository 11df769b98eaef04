"""The jitted SNM/S2M step: sparse updates equal dense references, sharded runs
equal single-device runs, the loss equals the reference `snm_loss`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from snm_jax import losses, sharding
from snm_jax.mining.samplers import ExactSampler, StratifiedSampler
from snm_jax.models.towers import l2_normalize
from step_fixtures import B, K, N, V, loss_spec, make

KEY = jax.random.key(7)

# One set-up (and so one compiled step, kept in memory) per distinct argument set: several tests
# start from the same toy state (steps do not donate it). test_same_seed_same_bits builds its two
# set-ups with `make` itself, independently.
_make = functools.lru_cache(maxsize=None)(make)


@functools.cache
def _sample_ids(sampler, per_example):
  """The ids the step draws on a (1, 1) mesh for KEY (all strata on one shard); jitted, as the step
  draws them (one compile instead of a dozen eager ops)."""
  example_ids = np.arange(N, dtype=np.int32) if per_example else None
  return jax.jit(lambda key: sampler.sample_strata(key, jnp.arange(V), example_ids)[0])(KEY)


def _dense_reference(setup, per_example, spec):
  """Loss with the whole table as the differentiated input, via losses.snm_loss (the caller jits
  it: one compile instead of op-by-op dispatch, which took ~8 s of the test)."""
  b = setup["raw_batch"]
  ids = _sample_ids(setup["sampler"], per_example)
  vt = np.zeros(B, np.float32)
  vt[:len(spec.head_minus_tail)] = np.asarray(spec.head_minus_tail) + spec.tail
  vt[len(spec.head_minus_tail):] = spec.tail

  def loss_fn(params, table):
    q = setup["model"].apply(params, b["feat_ids"], b["feat_vals"])
    t = l2_normalize(table)
    pos = jnp.sum(q * t[b["label"]], -1)
    neg_ids = ids if per_example else jnp.broadcast_to(ids, (N, B))
    neg = jnp.einsum("nh,nbh->nb", q, t[neg_ids])
    hit = jnp.any(neg_ids[:, :, None] == b["label_set"][:, None, :], -1)
    per_ex = jax.vmap(lambda p, s, m: losses.snm_loss(p, s, vt, losses.hinge, kind=spec.kind, neg_mask=m))(
        pos, neg, hit)
    return jnp.mean(per_ex), per_ex

  return loss_fn


@pytest.mark.parametrize("per_example", [False, True])
def test_sparse_update_equals_dense_gradient_update(per_example):
  spec = loss_spec(k=4)
  setup = _make((1, 1), per_example=per_example, spec=spec)
  state0 = setup["state"]
  loss_fn = _dense_reference(setup, per_example, spec)
  table0 = np.asarray(state0.table)
  (ref_loss, _), (g_params, g_table) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))(
      state0.params, jnp.asarray(table0))
  ref_table = table0 - 0.5 * np.asarray(g_table)  # dense SGD on the whole table
  tx = setup["tx"]
  sgd_step = jax.jit(lambda g, p: optax.apply_updates(p, tx.update(g, tx.init(p))[0]))
  ref_params = sgd_step(g_params, state0.params)

  state1, metrics = setup["step"](state0, setup["batch"], KEY)
  np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(state1.table), ref_table, rtol=0, atol=1e-6)
  touched = np.abs(ref_table - table0).sum(1) > 0
  assert 0 < touched.sum() < K  # the update is really sparse
  np.testing.assert_array_equal(np.asarray(state1.table)[~touched], table0[~touched])
  for a, b in zip(jax.tree.leaves(state1.params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("row_opt", ["momentum", "adagrad"])
def test_lazy_row_optimizers_touch_only_sampled_rows(row_opt):
  setup = _make((1, 1), row_opt=row_opt)
  table0 = np.asarray(setup["state"].table)
  state1, _ = setup["step"](setup["state"], setup["batch"], KEY)
  ids = np.asarray(_sample_ids(setup["sampler"], False))
  touched = np.zeros(K, bool)
  touched[ids] = True
  touched[setup["raw_batch"]["label"]] = True
  changed = np.abs(np.asarray(state1.table) - table0).sum(1) > 0
  assert not (changed & ~touched).any()
  assert changed.sum() > 0.5 * touched.sum()


@pytest.mark.parametrize("mesh_shape,per_example", [((2, 4), False), ((2, 4), True), ((1, 8), False)])
def test_sharded_step_matches_single_device(mesh_shape, per_example):
  ref = _make((1, 1), per_example=per_example)
  sh = _make(mesh_shape, per_example=per_example)
  s_ref, s_sh = ref["state"], sh["state"]
  for i in range(3):
    key = jax.random.fold_in(KEY, i)
    s_ref, m_ref = ref["step"](s_ref, ref["batch"], key)
    s_sh, m_sh = sh["step"](s_sh, sh["batch"], key)
  # Same sample, same mined negatives; only the float summation order differs.
  np.testing.assert_allclose(np.asarray(s_sh.table), np.asarray(s_ref.table), atol=2e-6)
  for a, b in zip(jax.tree.leaves(s_sh.params), jax.tree.leaves(s_ref.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
  np.testing.assert_allclose(float(m_sh["loss"]), float(m_ref["loss"]), rtol=1e-5)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)])
def test_exact_sampler_sharded_step_matches_single_device(mesh_shape):
  """Algorithm 1's exact draws (global layout): same draws, same step on any mesh."""
  ref = _make((1, 1), sampler=ExactSampler(K, B))
  sh = _make(mesh_shape, sampler=ExactSampler(K, B))
  s_ref, s_sh = ref["state"], sh["state"]
  for i in range(3):
    key = jax.random.fold_in(KEY, i)
    s_ref, m_ref = ref["step"](s_ref, ref["batch"], key)
    s_sh, m_sh = sh["step"](s_sh, sh["batch"], key)
    # B distinct non-positives per example: no draw is masked.
    assert float(m_ref["valid_negatives"]) == float(m_sh["valid_negatives"]) == B
  np.testing.assert_allclose(np.asarray(s_sh.table), np.asarray(s_ref.table), atol=2e-6)
  for a, b in zip(jax.tree.leaves(s_sh.params), jax.tree.leaves(s_ref.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
  np.testing.assert_allclose(float(m_sh["loss"]), float(m_ref["loss"]), rtol=1e-5)
  assert np.abs(np.asarray(s_ref.table) - np.asarray(_make((1, 1))["state"].table)).max() > 1e-3


def test_s2m_reduction_averages_the_hardest_examples():
  spec_mean = loss_spec(k=2)
  spec_s2m = loss_spec(k=2, reduction="s2m", k_prime=4)
  a = _make((1, 1), spec=spec_mean)
  b = _make((1, 1), spec=spec_s2m)
  _, m_a = a["step"](a["state"], a["batch"], KEY)
  _, m_b = b["step"](b["state"], b["batch"], KEY)
  # avg of the 4 largest per-example losses lies between the mean and the max.
  assert float(m_a["loss"]) < float(m_b["loss"]) <= float(m_b["max_example_loss"]) + 1e-6
  ref = jax.jit(_dense_reference(a, False, spec_mean))(a["state"].params, a["state"].table)[1]
  np.testing.assert_allclose(float(m_b["loss"]), float(np.mean(np.sort(np.asarray(ref))[-4:])), rtol=1e-5)


def test_same_seed_same_bits_and_accidental_hits_masked():
  runs = []
  for _ in range(2):
    s = make((2, 4))
    st = s["state"]
    for i in range(2):
      st, m = s["step"](st, s["batch"], jax.random.fold_in(KEY, i))
    runs.append((np.asarray(st.table), float(m["valid_negatives"])))
  np.testing.assert_array_equal(runs[0][0], runs[1][0])
  assert runs[0][1] < B  # with 3 positives per row among K=64, some of 16 draws hit


def test_nonfinite_loss_drops_the_update():
  s = _make((1, 1))
  bad = dict(s["batch"])
  vals = s["raw_batch"]["feat_vals"].copy()
  vals[0, 0] = np.nan
  bad["feat_vals"] = jax.device_put(vals, s["batch"]["feat_vals"].sharding)  # as placed: the step's program
  st, m = s["step"](s["state"], bad, KEY)
  assert not np.isfinite(float(m["loss"]))
  np.testing.assert_array_equal(np.asarray(st.table), np.asarray(s["state"].table))
  for a, b in zip(jax.tree.leaves((st.params, st.opt_state)), jax.tree.leaves((s["state"].params,
                                                                              s["state"].opt_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the tower's update is dropped too
  # Numbered as the logs count steps: the first step is step 1.
  assert int(st.nonfinite_steps) == 1 and int(st.first_nonfinite_step) == 1


@functools.cache
def _jit_count(count_fn):
  """A valid-draw count jitted as the step runs it (one compile per function, not one per op)."""
  return jax.jit(count_fn, static_argnums=2)


def test_valid_negatives_metric_counts_the_mask():
  """The sort-based count of valid shared draws equals summing the (N, B) mask,
  with padding draws, repeated draws, padded label slots and repeated labels."""
  from snm_jax.mining.negatives import shared_valid_count  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  num_labels = 20
  ids = rng.integers(0, num_labels + 4, 64).astype(np.int32)  # >= num_labels: padding draws
  label_set = rng.integers(-1, num_labels, (32, 5)).astype(np.int32)
  label_set[0] = [3, 3, -1, -1, 7]
  hit = np.any(ids[None, :, None] == label_set[:, None, :], axis=-1)
  expected = np.sum((ids[None] < num_labels) & ~hit, axis=-1)
  got = np.asarray(_jit_count(shared_valid_count)(ids, label_set, num_labels))
  np.testing.assert_array_equal(got, expected)
  assert expected.min() < expected.max()  # the case exercises hits


@pytest.mark.parametrize("lo,hi", [(0, 12), (8, 24), (16, 28)])  # inside, across and past num_labels
def test_range_valid_count_equals_the_mask(lo, hi):
  """The full sampler's shard draws lo..hi-1 once each: the range count equals summing the mask."""
  from snm_jax.mining.negatives import range_valid_count  # pylint: disable=g-import-not-at-top
  num_labels = 20
  ids = np.arange(lo, hi, dtype=np.int32)
  label_set = np.random.default_rng(lo).integers(-1, num_labels, (32, 5)).astype(np.int32)
  label_set[0] = [lo, lo, -1, hi - 1, 7]
  hit = np.any(ids[None, :, None] == label_set[:, None, :], axis=-1)
  expected = np.sum((ids[None] < num_labels) & ~hit, axis=-1)
  got = np.asarray(_jit_count(range_valid_count)(ids, label_set, num_labels))
  np.testing.assert_array_equal(got, expected)
  assert expected.min() < expected.max()


@pytest.mark.parametrize("lo,hi", [(0, 12), (8, 24), (16, 28)])
def test_range_hit_mask_equals_the_compare(lo, hi):
  """The full sampler's accidental-hit mask by a scatter equals the n x S x L compare: repeated,
  padding (-1) and out-of-range labels, a range past num_labels."""
  from snm_jax.mining.negatives import hit_mask, range_hit_mask  # pylint: disable=g-import-not-at-top
  ids = np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (32, hi - lo))
  label_set = np.random.default_rng(lo).integers(-1, 30, (32, 5)).astype(np.int32)
  label_set[0] = [lo, lo, -1, hi - 1, hi]
  want = np.any(ids[:, :, None] == label_set[:, None, :], axis=-1)
  np.testing.assert_array_equal(np.asarray(jax.jit(range_hit_mask)(ids, label_set)), want)
  np.testing.assert_array_equal(np.asarray(jax.jit(hit_mask)(ids, label_set)), want)
  assert want.any() and not want.all()


def test_additive_sgd_update_equals_the_merged_update():
  """SGD's scatter-add fast path equals the unique + segment-sum path on
  duplicate, out-of-shard and padding ids."""
  from snm_jax.train.core import row_optimizers as ro  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  table = rng.normal(size=(10, 3)).astype(np.float32)
  ids = np.asarray([1, 4, 1, 1, 10, -3, 9, 4], np.int32)
  grads = rng.normal(size=(8, 3)).astype(np.float32)
  fast = ro.sgd()
  merged = fast._replace(additive=False)
  # Each path jitted on its own, as the step runs it (two programs, not one: the claim is equality).
  update = lambda opt: jax.jit(lambda t, i, g: ro.apply_row_update(t, {}, i, g, 0.3, opt)[0])(
      table, ids, grads)
  t_fast = update(fast)
  t_merged = update(merged)
  np.testing.assert_allclose(np.asarray(t_fast), np.asarray(t_merged), atol=1e-6)
  expected = np.asarray(table).copy()
  for i, g in zip(np.asarray(ids), np.asarray(grads)):
    if 0 <= i < 10:
      expected[i] -= 0.3 * g
  np.testing.assert_allclose(np.asarray(t_fast), expected, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(t_fast)[[0, 2, 3]], np.asarray(table)[[0, 2, 3]])


@pytest.mark.parametrize("mesh_shape,per_example,kind", [((1, 1), False, "bowl"), ((1, 1), True, "powl"),
                                                         ((2, 4), False, "powl"), ((2, 4), True, "bowl")])
def test_rescored_top_k_gradient_equals_dense_score_gradient(mesh_shape, per_example, kind):
  """Differentiating only the k re-scored rows gives the step of the dense
  (N x S) score gradient: same loss, table and tower after two steps."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  spec = loss_spec(kind=kind, k=4)
  assert spec.tail == 0.0 and not spec.dense_score_grad
  states = []
  for s in (spec, dataclasses.replace(spec, dense_score_grad=True)):
    setup = _make(mesh_shape, per_example=per_example, spec=s)
    st = setup["state"]
    for i in range(2):
      st, m = setup["step"](st, setup["batch"], jax.random.fold_in(KEY, i))
    states.append((st, float(m["loss"]), float(m["hardest_neg_score"])))
  (a, loss_a, hard_a), (b, loss_b, hard_b) = states
  np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
  np.testing.assert_allclose(hard_a, hard_b, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(a.table), np.asarray(b.table), atol=2e-6)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-6)
  assert np.abs(np.asarray(a.table) - np.asarray(_make(mesh_shape)["state"].table)).max() > 1e-3


def test_strata_must_fit_the_model_axis():
  from snm_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from snm_jax.mining import negatives  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match="mining.num_strata.*model size 8"):
    negatives.for_sampler(StratifiedSampler(K, B, num_strata=4), sharding.make_mesh((1, 8)))


@pytest.mark.parametrize("mesh_shape,row_opt", [((1, 1), "sgd"), ((2, 4), "momentum")])
def test_full_sampler_scores_positives_in_the_shared_product(mesh_shape, row_opt, monkeypatch):
  """The full sampler draws every row once, in order: the positive's score is taken from the shared
  scores and the table's update is dense (`positives_in_scores`). Same steps as gathering, scoring
  and updating the positives' rows apart (the other layouts' way), to float tolerance; on (2, 4)
  the positives are owned by four model shards."""
  from snm_jax.mining import negatives as negatives_lib  # pylint: disable=import-outside-toplevel
  full = StratifiedSampler(K, K, num_strata=V, full=True)
  spec = loss_spec(kind="full_softmax")
  new = make(mesh_shape, sampler=full, spec=spec, row_opt=row_opt)
  monkeypatch.setattr(negatives_lib.SharedNegatives, "positives_in_scores", False)
  ref = make(mesh_shape, sampler=full, spec=spec, row_opt=row_opt)
  s_new, s_ref = new["state"], ref["state"]
  for i in range(3):
    key = jax.random.fold_in(KEY, i)
    s_new, m_new = new["step"](s_new, new["batch"], key)
    s_ref, m_ref = ref["step"](s_ref, ref["batch"], key)
    np.testing.assert_allclose(float(m_new["pos_score"]), float(m_ref["pos_score"]), rtol=1e-5)
  np.testing.assert_allclose(float(m_new["loss"]), float(m_ref["loss"]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(s_new.table), np.asarray(s_ref.table), atol=2e-6)
  for a, b in zip(jax.tree.leaves((s_new.params, s_new.table_state)),
                  jax.tree.leaves((s_ref.params, s_ref.table_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
  moved = np.abs(np.asarray(s_new.table) - np.asarray(new["state"].table)).sum(1) > 0
  assert moved.all()  # every label's row is a negative or a positive of the full softmax
