"""The wide-and-deep step differentiates only the tower's query columns: the same update as the step
that scores the whole query as one product (and differentiates all of it), to float tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import xmc
from snm_jax import sharding
from snm_jax.models import towers
from snm_jax.train.config.overrides import with_overrides
from snm_jax.train.trainer.tasks import build_task


def _config():
  c = xmc.get_config("synthetic,runlocal")
  return with_overrides(c, {
      "recipe.name": "", "model.kind": "wide_deep", "model.hidden": 32, "model.out": 16,
      "model.dropout": 0.3, "model.bag_matmul": "dense", "loss.kind": "full_softmax",
      "mining.sampler": "full", "mining.num_samples": 64, "train.batch_size": 32, "train.num_steps": 3,
      "train.eval_every": 3, "table.learning_rate": 1.0, "loss.logit_scale": 1.0,
      "dataset.synthetic.num_labels": 64, "dataset.synthetic.dim": 16, "dataset.synthetic.num_train": 256,
      "dataset.synthetic.num_test": 64})


def _three_steps(config, constant_columns):
  mesh = sharding.make_mesh(config.mesh.shape)
  with pytest.MonkeyPatch.context() as mp:
    if constant_columns is not None:
      mp.setattr(towers.WideDeepQuery, "constant_query_columns", property(lambda self: constant_columns))
    task = build_task(config, mesh)
    state = task.state
    for i in range(3):
      batch = next(task.batches)
      state, metrics = task.train_step(state, batch, jax.random.fold_in(jax.random.key(1), i))
  return state, metrics


def test_wide_deep_queries_declare_their_parameter_free_columns():
  assert towers.WideDeepQuery(num_features=100).constant_query_columns == 101  # [x, 1]
  assert not hasattr(towers.LinearQuery(num_features=100), "constant_query_columns")


# (2, 4): the queries vary over `data` and the table's rows over `model` inside shard_map, so the
# split product's own gradient rule must sum each one's cotangent over the other's axis as autodiff does.
@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)], ids=["1x1", "2x4"])
def test_split_product_step_equals_the_single_product_step(mesh_shape):
  config = with_overrides(_config(), {"mesh.shape": mesh_shape})
  split, m_split = _three_steps(config, None)       # the shipped step: columns [0, d + 1) constant
  whole, m_whole = _three_steps(config, 0)          # one product, every column differentiated
  assert float(m_split["loss"]) == pytest.approx(float(m_whole["loss"]), rel=1e-5)
  np.testing.assert_allclose(np.asarray(split.table), np.asarray(whole.table), rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(split.params), jax.tree.leaves(whole.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  # and the tower did train (its gradient is not cut along with the constant columns)
  fresh = build_task(config, sharding.make_mesh(config.mesh.shape)).state
  moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(split.params),
                                                            jax.tree.leaves(fresh.params))]
  assert min(moved) > 0
