"""The tree sampler inside the trainer: sharded steps equal single-device ones,
bias removal at evaluation, and a short run learns."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import adversarial
from snm_jax import sharding
from snm_jax.adversarial import random_tree
from snm_jax.adversarial.training import TreeTrainingSampler
from snm_jax.models.towers import SNMTower
from snm_jax.train.core import row_optimizers
from snm_jax.train.trainer.loop import train_and_evaluate
from snm_jax.train.core.step import LossSpec, TrainState, make_train_step
from step_fixtures import D, H, K, N, commit, toy_batch


def _tree_sampler(num_samples):
  tree = random_tree(0, K, 4)
  # A projection from the toy feature space (D) to the tree's 4 dims.
  comps = np.random.default_rng(1).standard_normal((4, D)).astype(np.float32)
  tree = tree.__class__(**{**tree.__dict__, "proj_mean_d": jnp.zeros(D), "proj_components_kxd": comps})
  return TreeTrainingSampler(tree=tree, num_samples=num_samples)


def _run(mesh_shape, kind, steps=3):
  mesh = sharding.make_mesh(mesh_shape)
  model = SNMTower(num_features=D, hidden=H, out=H)
  b = toy_batch()
  params = model.init(jax.random.key(0), b["feat_ids"], b["feat_vals"])
  tx, ropt = optax.sgd(0.1), row_optimizers.adagrad()
  state = TrainState.create(params=params, opt_state=tx.init(params),
      table=jax.device_put(jax.random.normal(jax.random.key(1), (K, H)),
                                          sharding.named(mesh, sharding.TABLE)),
      table_state=jax.device_put(ropt.init(K, H), sharding.named(mesh, jax.P(sharding.MODEL))))
  state = commit(state, mesh)
  spec = LossSpec(kind=kind, lam=0.01) if kind != "bowl" else LossSpec(
      kind="bowl", phi=lambda u: jnp.maximum(1 - u, 0), head_minus_tail=(1.0, 1.0), tail=0.0)
  step = make_train_step(tower_apply=model.apply, tx=tx, row_opt=ropt, table_lr=lambda s: 0.5,
                         sampler=_tree_sampler(6), loss=spec, mesh=mesh, normalize_classes=True,
                         donate=False, table_rows=K)
  batch = {k: jax.device_put(v, sharding.named(mesh, jax.P(sharding.DATA))) for k, v in b.items()}
  losses = []
  for i in range(steps):
    state, m = step(state, batch, jax.random.fold_in(jax.random.key(3), i))
    losses.append(float(m["loss"]))
  return np.asarray(state.table), losses


@pytest.mark.parametrize("kind", ["adversarial_ns"])
def test_tree_sampled_step_sharded_equals_single_device(kind):
  t1, l1 = _run((1, 1), kind)
  t8, l8 = _run((2, 4), kind)
  np.testing.assert_allclose(t8, t1, atol=2e-6)
  np.testing.assert_allclose(l8, l1, rtol=1e-5)
  assert l1[-1] < l1[0]  # the same batch: the loss goes down


def test_adversarial_run_learns_and_reports_log_likelihood(tmp_path):
  c = adversarial.get_config("bibtex,method=adversarial,runlocal")
  c.dataset.name = "synthetic"
  c.dataset.synthetic.num_labels = 64
  c.dataset.synthetic.num_train = 2000
  c.dataset.synthetic.num_test = 300
  c.dataset.synthetic.dim = 8
  c.adversarial.pca_dim = 4
  c.mesh.shape = (1, 1)
  c.train.num_steps = 60
  c.train.eval_every = 0
  c.train.checkpoint_every = -1
  results = train_and_evaluate(c, tmp_path)
  out = results["final"]
  # The tree's fit is recorded: rounds per level (6 levels for 64 labels), each converged.
  assert len(results["tree_rounds_per_level"]) == 6 and min(results["tree_rounds_per_level"]) >= 1
  assert results["tree_levels_converged"] == [True] * 6
  # log-likelihood of a uniform guess is -log 64 = -4.16; the model must beat it clearly.
  assert out["log_likelihood"] > -3.5, out
  assert out["P@1"] > 3 / 64
