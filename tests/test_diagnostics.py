"""Sampler diagnostics (snm_jax/train/core/diagnostics.py) against NumPy references."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snm_jax import losses, sharding
from snm_jax.mining.samplers import StratifiedSampler
from snm_jax.train.core.diagnostics import DIAGNOSTICS_SEED_OFFSET, make_count_above, make_diagnose
from step_fixtures import B, K, N, V, loss_spec
from step_fixtures import make as _make_setup

SEED, STEP = 3, 40
make = functools.lru_cache(maxsize=None)(_make_setup)  # one set-up per mesh (diagnostics read it only)


def _diagnose(setup, *, k=4, snr_draws=0, sampler=None):
  return make_diagnose(tower_apply=setup["model"].apply, sampler=sampler or setup["sampler"],
                       loss=loss_spec(k=k), mesh=setup["mesh"], normalize_classes=True,
                       probe=setup["batch"], num_labels=K, k=k, snr_draws=snr_draws, seed=SEED,
                       table_rows=K)


def _scores(setup):
  """(N, K) cosine scores of the probe against every class (float64)."""
  b = setup["raw_batch"]
  q = np.asarray(setup["model"].apply(setup["state"].params, b["feat_ids"], b["feat_vals"]), np.float64)
  t = np.asarray(setup["state"].table, np.float64)
  return q @ (t / np.linalg.norm(t, axis=1, keepdims=True)).T


# Jitted: one program per sampler, not op-by-op dispatch (~1.5 s of small compiles under load).
_draws = jax.jit(lambda sampler, key: sampler.sample_strata(key, jnp.arange(V), None)[0], static_argnums=0)


def _shared_draws(sampler, key):
  return np.asarray(_draws(sampler, key))


def _diag_key(step, r=None):
  key = jax.random.fold_in(jax.random.key(SEED + DIAGNOSTICS_SEED_OFFSET), step)
  return key if r is None else jax.random.fold_in(key, r)


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)])
def test_count_above_matches_numpy(mesh_shape):
  mesh = sharding.make_mesh(mesh_shape)
  rng = np.random.default_rng(0)
  q = rng.normal(size=(8, 5)).astype(np.float32)
  table = rng.normal(size=(64, 5)).astype(np.float32)  # 60 real labels + 4 padding rows
  thr = rng.normal(size=8).astype(np.float32) * 0.5
  count = make_count_above(mesh, num_labels=60, normalize_classes=True, row_block=12)  # blocks overlap
  excluded = np.stack([rng.integers(0, 64, 8), np.full(8, -1)], 1).astype(np.int32)
  data = sharding.named(mesh, jax.P(sharding.DATA))
  got = np.asarray(count(jax.device_put(q, data), jax.device_put(table, sharding.named(mesh, sharding.TABLE)),
                         jax.device_put(thr, data), jax.device_put(excluded, data)))
  t = table[:60] / np.linalg.norm(table[:60], axis=1, keepdims=True)
  above = q @ t.T > thr[:, None]
  above[np.arange(8)[excluded[:, 0] < 60], excluded[excluded[:, 0] < 60, 0]] = False
  np.testing.assert_array_equal(got, np.sum(above, axis=1))
  assert 0 < got.sum() < 8 * 60


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)])
def test_mining_recall_and_rank_match_numpy(mesh_shape):
  setup = make(mesh_shape)
  k = 4
  out = _diagnose(setup, k=k)(setup["state"], STEP)
  s = _scores(setup)
  label_set = setup["raw_batch"]["label_set"]
  pos = np.zeros_like(s, bool)
  for i, ls in enumerate(label_set):
    pos[i, ls[ls >= 0]] = True
  neg = np.where(pos, -np.inf, s)
  exact = np.argsort(-neg, axis=1, kind="stable")[:, :k]
  draws = _shared_draws(setup["sampler"], _diag_key(STEP))
  recalls, ranks = [], []
  for i in range(N):
    d = np.array([y for y in draws if y < K and not pos[i, y]])
    mined = d[np.argsort(-s[i, d], kind="stable")[:k]]
    recalls.append(np.mean(np.isin(exact[i], mined)))
    ranks.append(1 + np.sum(neg[i] > s[i, mined[0]]))
  np.testing.assert_allclose(out[f"mining_recall@{k}"], np.mean(recalls), atol=1e-6)
  np.testing.assert_allclose(out["hardest_mined_rank"], np.mean(ranks), atol=1e-6)
  np.testing.assert_allclose(out["hardest_mined_rank_median"], np.median(ranks), atol=1e-6)
  assert 0 < np.mean(recalls) < 1 and np.mean(ranks) > 1  # B = 16 of K = 64: neither trivial nor exact


def test_full_sampler_mines_exactly_and_has_no_gradient_noise():
  setup = make((1, 1))
  full = StratifiedSampler(K, num_samples=K, num_strata=V, full=True)
  out = _diagnose(setup, sampler=full, snr_draws=3)(setup["state"], STEP)
  assert out["mining_recall@4"] == 1.0 and out["hardest_mined_rank"] == 1.0
  assert out["grad_snr"] == float("inf")


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)])
def test_grad_snr_matches_dense_gradients_over_draws(mesh_shape):
  """The SNR from R dense table gradients, each the gradient of the loss written with the
  whole table as input (the draw of key r replayed), against the diagnostics' streaming one."""
  setup = make(mesh_shape)
  spec = loss_spec(k=4)
  b = setup["raw_batch"]
  vt = np.zeros(B, np.float32)
  vt[:len(spec.head_minus_tail)] = np.asarray(spec.head_minus_tail) + spec.tail
  params = setup["state"].params

  def loss_fn(table, ids):
    q = setup["model"].apply(params, b["feat_ids"], b["feat_vals"])
    t = table / jnp.sqrt(jnp.sum(table ** 2, -1, keepdims=True) + 1e-12)
    neg_ids = jnp.broadcast_to(ids, (N, B))
    neg = jnp.einsum("nh,nbh->nb", q, t[neg_ids])
    hit = jnp.any(neg_ids[:, :, None] == b["label_set"][:, None, :], -1)
    per_ex = jax.vmap(lambda p, s_, m: losses.snm_loss(p, s_, vt, losses.hinge, kind="bowl", neg_mask=m))(
        jnp.sum(q * t[b["label"]], -1), neg, hit)
    return jnp.mean(per_ex)

  r_draws = 5
  table = jnp.asarray(np.asarray(setup["state"].table))
  grad = jax.jit(jax.grad(loss_fn))  # one compile for the R draws (op by op: ~8 s per case)
  grads = np.stack([np.asarray(grad(table, _shared_draws(setup["sampler"], _diag_key(STEP, r))), np.float64)
                    for r in range(r_draws)])
  signal = np.sum(np.mean(grads, 0) ** 2)
  noise = np.sum(np.var(grads, 0, ddof=1))
  out = _diagnose(setup, snr_draws=r_draws)(setup["state"], STEP)
  np.testing.assert_allclose(out["grad_snr"], np.sqrt(signal / noise), rtol=1e-4)
  np.testing.assert_allclose(out["grad_snr_db"], 10 * np.log10(signal / noise), rtol=1e-4)


def test_diagnostics_are_logged_and_leave_the_run_unchanged(tmp_path):
  from experiments.configs import default  # pylint: disable=g-import-not-at-top
  from snm_jax.train.trainer.loop import train_and_evaluate  # pylint: disable=g-import-not-at-top
  fingerprints = []
  for every in (0, 10):
    config = default.get_config("paper,runlocal")
    config.dataset.name = "synthetic"
    config.dataset.synthetic.num_labels = 512
    config.dataset.synthetic.num_train = 2000
    config.eval.max_examples = 256
    config.diagnostics.every = every
    config.diagnostics.snr_draws = 2
    workdir = tmp_path / f"every{every}"
    fingerprints.append(train_and_evaluate(config, workdir)["state_fingerprint"])
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    diag_steps = [r["step"] for r in rows if "diag/grad_snr" in r]
    assert diag_steps == ([] if every == 0 else [10, 20])
    for r in rows:
      if "diag/grad_snr" in r:
        assert 0 <= r[f"diag/mining_recall@{config.mining.k}"] <= 1
        assert r["diag/hardest_mined_rank"] >= 1 and np.isfinite(r["diag/grad_snr"])
  assert fingerprints[0] == fingerprints[1]
