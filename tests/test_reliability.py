"""Non-finite steps (issue "Reliability", item 6): "stop" names the step as the
logs count it and the committed checkpoint, "skip" has a bounded budget, and
a non-finite gradient with a finite loss is caught too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snm_jax.errors import NonFiniteLossError
from snm_jax.train import loop
from snm_jax.train.loop import train_and_evaluate
from step_fixtures import make
from test_train_loop import synthetic_config


# ---- item 6: non-finite steps -------------------------------------------------------------------

def _poison_batches_from(monkeypatch, first_bad_step: int):
  """Feeds NaN feature values from the `first_bad_step`-th batch (1-based) on."""
  real = loop.make_global_batch
  calls = {"n": 0}

  def poisoned(host_batch, mesh):
    calls["n"] += 1
    if calls["n"] >= first_bad_step:
      host_batch = {**host_batch, "feat_vals": np.full_like(host_batch["feat_vals"], np.nan)}
    return real(host_batch, mesh)
  monkeypatch.setattr(loop, "make_global_batch", poisoned)


def test_stop_names_the_logged_step_and_the_committed_checkpoint(tmp_path, monkeypatch):
  _poison_batches_from(monkeypatch, 8)
  c = synthetic_config(**{"train.num_steps": 20, "train.checkpoint_every": 5, "train.log_every": 5})
  with pytest.raises(NonFiniteLossError, match=r"at step 8 of 20 .*the last good checkpoint \(step 5\)"):
    train_and_evaluate(c, tmp_path)
  ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
  assert ckpts == ["5"], ckpts  # committed, no *.orbax-checkpoint-tmp left behind


def test_skip_stops_once_its_budget_is_spent(tmp_path, monkeypatch):
  _poison_batches_from(monkeypatch, 4)
  c = synthetic_config(**{"train.num_steps": 20, "train.log_every": 2, "train.on_nonfinite": "skip",
                          "train.max_skipped_steps": 2})
  with pytest.raises(NonFiniteLossError, match=r"at step 4 of 20 .*3 steps skipped so far, more than "
                     r"train.max_skipped_steps=2"):
    train_and_evaluate(c, tmp_path)


def test_a_nonfinite_gradient_with_a_finite_loss_drops_the_step():
  s = make((1, 1))
  from snm_jax.train.step import make_train_step  # pylint: disable=g-import-not-at-top
  from step_fixtures import loss_spec  # pylint: disable=g-import-not-at-top

  def apply(params, ids, vals):  # d/dx sqrt(|x|) at 0 is inf: NaN gradients, finite output
    leaf = jax.tree.leaves(params)[0]
    return s["model"].apply(params, ids, vals) + 0.0 * jnp.sum(jnp.sqrt(jnp.abs(leaf - leaf)))

  step = make_train_step(tower_apply=apply, tx=s["tx"], row_opt=s["ropt"], table_lr=lambda _: 0.5,
                         sampler=s["sampler"], loss=loss_spec(), mesh=s["mesh"],
                         normalize_classes=True, donate=False)
  st, m = step(s["state"], s["batch"], jax.random.key(0))
  assert np.isfinite(float(m["loss"]))
  assert int(st.nonfinite_steps) == 1 and int(st.first_nonfinite_step) == 1
  for a, b in zip(jax.tree.leaves((st.params, st.opt_state, st.table)),
                  jax.tree.leaves((s["state"].params, s["state"].opt_state, s["state"].table))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
