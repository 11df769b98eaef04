"""Small shared set-up for train-step tests (a toy problem and a state factory)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from snm_jax import losses, sharding
from snm_jax.mining.samplers import StratifiedSampler
from snm_jax.models.towers import SNMTower
from snm_jax.train.core import row_optimizers
from snm_jax.train.core.step import LossSpec, TrainState, make_train_step

K, D, H, N, B, NNZ, V = 64, 20, 8, 16, 16, 4, 8


def toy_batch(seed=0):
  rng = np.random.default_rng(seed)
  label = rng.integers(0, K, N).astype(np.int32)
  extra = rng.integers(0, K, N).astype(np.int32)
  return {
      "feat_ids": rng.integers(0, D, (N, NNZ)).astype(np.int32),
      "feat_vals": rng.random((N, NNZ)).astype(np.float32),
      "label": label,
      "label_set": np.stack([label, extra, np.full(N, -1, np.int32)], 1),
      "valid": np.ones(N, bool),
      "example_id": np.arange(N, dtype=np.int32),
  }


def loss_spec(kind="bowl", k=4, vartheta=None, reduction="mean", k_prime=0):
  vt = losses.top_k_vartheta(k, B, K, scale="mean") if vartheta is None else vartheta
  head, tail = losses.split_vartheta(vt)
  return LossSpec(kind=kind, phi=losses.hinge, head_minus_tail=tuple(float(h - tail) for h in head),
                  tail=float(tail), reduction=reduction, k_prime=k_prime)


def commit(state, mesh):
  """`state` placed as the trainer's loop places it (classification.py's init): every leaf not
  already on a mesh sharding replicated over `mesh`. A state left on the host is committed to
  devices by the first step, whose output shardings then differ from its inputs' and compile the
  step a second time; committed, the step compiles once (same values, same program)."""
  replicated = sharding.named(mesh, sharding.REPLICATED)
  return jax.tree.map(
      lambda x: x if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
      else jax.device_put(x, replicated), state)


def make(mesh_shape, *, per_example=False, spec=None, row_opt="sgd", table_lr=0.5, tower_lr=0.1,
         sampler=None):
  """A toy step on `mesh_shape`; `sampler` (default: the stratified one of `per_example`) may be
  any sampler of `snm_jax.mining.negatives.for_sampler`."""
  mesh = sharding.make_mesh(mesh_shape)
  model = SNMTower(num_features=D, hidden=H, out=H)
  b = toy_batch()
  params = model.init(jax.random.key(0), b["feat_ids"], b["feat_vals"])
  tx = optax.sgd(tower_lr)
  ropt = row_optimizers.get_row_optimizer(row_opt)
  table = jax.random.normal(jax.random.key(1), (K, H))
  state = TrainState.create(params=params, opt_state=tx.init(params),
      table=jax.device_put(table, sharding.named(mesh, sharding.TABLE)),
      table_state=jax.tree.map(lambda x: jax.device_put(x, sharding.named(mesh, jax.P(sharding.MODEL))),
                               ropt.init(K, H)))
  state = commit(state, mesh)
  sampler = sampler or StratifiedSampler(K, B, num_strata=V, per_example=per_example)
  step = make_train_step(tower_apply=model.apply, tx=tx, row_opt=ropt, table_lr=lambda s: table_lr,
                         sampler=sampler, loss=spec or loss_spec(), mesh=mesh,
                         normalize_classes=True, donate=False)
  batch = {k: jax.device_put(v, sharding.named(mesh, jax.P(sharding.DATA))) for k, v in b.items()}
  return dict(mesh=mesh, model=model, state=state, step=step, batch=batch, sampler=sampler,
              tx=tx, ropt=ropt, raw_batch=b)
