"""The evaluator scores with the trained logits, logit_scale x (q . row), where the scale matters:
the predictive log-likelihood (and Eq. 5's bias, added to the same logits)."""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from snm_jax import sharding
from snm_jax.train.core.evaluate import Evaluator


def test_log_likelihood_uses_the_logit_scale():
  rng = np.random.default_rng(0)
  n, d, k = 12, 6, 40
  features = sp.csr_matrix(rng.normal(size=(n, d)).astype(np.float32))
  labels = sp.csr_matrix((np.ones(n, np.float32), rng.integers(0, k, n), np.arange(n + 1)), shape=(n, k))
  w = rng.normal(size=(d, 5)).astype(np.float32)
  table = rng.normal(size=(k, 5)).astype(np.float32)

  def tower_apply(params, ids, vals):  # a linear map of the densified rows
    dense = jnp.zeros((ids.shape[0], d)).at[jnp.arange(ids.shape[0])[:, None], ids].add(vals)
    return dense @ params

  mesh = sharding.make_mesh((1, 1))
  got = {}
  for scale in (1.0, 3.0):
    ev = Evaluator(tower_apply=tower_apply, features=features, labels=labels, mesh=mesh, num_labels=k, k=5,
                   query_chunk=8, row_block=16, normalize_classes=True, max_nnz=d, max_labels=1,
                   with_loglik=True, logit_scale=scale)
    pred, loglik = ev.predict(jnp.asarray(w), jax.device_put(table, sharding.named(mesh, sharding.TABLE)))
    got[scale] = (pred, loglik)
    logits = scale * (features.toarray() @ w) @ (table / np.linalg.norm(table, axis=1, keepdims=True)).T
    ref = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    np.testing.assert_allclose(loglik, ref[np.arange(n), labels.indices], rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(got[1.0][0], got[3.0][0])  # the ranking does not depend on the scale
  assert np.all(got[3.0][1] != got[1.0][1])


def test_evaluators_of_equal_towers_share_their_jitted_programs():
  from snm_jax.mining.retrieval import make_top_k_retrieval
  from snm_jax.models.towers import LinearQuery

  mesh = sharding.make_mesh((1, 1))
  kwargs = dict(k=5, num_labels=40, row_block=16)
  assert make_top_k_retrieval(mesh, **kwargs) is make_top_k_retrieval(mesh, **kwargs)
  assert make_top_k_retrieval(mesh, **kwargs) is not make_top_k_retrieval(mesh, **{**kwargs, "k": 6})
  rng = np.random.default_rng(0)
  features = sp.csr_matrix(rng.normal(size=(12, 6)).astype(np.float32))
  labels = sp.csr_matrix((np.ones(12, np.float32), rng.integers(0, 40, 12), np.arange(13)), shape=(12, 40))

  def evaluator(module, scale=1.0):
    return Evaluator(tower_apply=module.apply, features=features, labels=labels, mesh=mesh, num_labels=40,
                     k=5, query_chunk=8, row_block=16, normalize_classes=True, max_nnz=6, max_labels=1,
                     logit_scale=scale)

  a, b = evaluator(LinearQuery(num_features=6)), evaluator(LinearQuery(num_features=6))
  assert a.embed is b.embed  # equal modules: one jitted embedding
  assert evaluator(LinearQuery(num_features=7)).embed is not a.embed
  assert evaluator(LinearQuery(num_features=6), 2.0).embed is not a.embed


def test_evaluation_chunks_are_read_once_while_small(monkeypatch):
  """The evaluation set's chunks (tower inputs, first-label rows) stay on the devices after the
  first pass while they are small: later passes give the same predictions and log-likelihoods
  without reading the batcher; above EVAL_CACHE_MAX_BYTES every pass reads it again."""
  from snm_jax.train.core import evaluate as evaluate_lib
  rng = np.random.default_rng(1)
  n, d, k = 20, 6, 40  # 3 chunks of 8 queries
  features = sp.csr_matrix(rng.normal(size=(n, d)).astype(np.float32))
  labels = sp.csr_matrix((np.ones(n, np.float32), rng.integers(0, k, n), np.arange(n + 1)), shape=(n, k))
  w = jnp.asarray(rng.normal(size=(d, 5)).astype(np.float32))
  mesh = sharding.make_mesh((1, 1))
  table = jax.device_put(rng.normal(size=(k, 5)).astype(np.float32), sharding.named(mesh, sharding.TABLE))

  def tower_apply(params, ids, vals):
    dense = jnp.zeros((ids.shape[0], d)).at[jnp.arange(ids.shape[0])[:, None], ids].add(vals)
    return dense @ params

  def evaluator():
    return Evaluator(tower_apply=tower_apply, features=features, labels=labels, mesh=mesh, num_labels=k,
                     k=5, query_chunk=8, row_block=16, normalize_classes=True, max_nnz=d, max_labels=1,
                     with_loglik=True)

  class Unreadable:
    def set_state(self, state):
      raise AssertionError("the batcher was read again")

  ev = evaluator()
  first = ev.predict(w, table)
  assert first[0].shape == (n, 5)
  ev.batcher = Unreadable()
  again = ev.predict(w, table)
  np.testing.assert_array_equal(again[0], first[0])
  np.testing.assert_array_equal(again[1], first[1])

  monkeypatch.setattr(evaluate_lib, "EVAL_CACHE_MAX_BYTES", 0)
  uncached = evaluator()
  np.testing.assert_array_equal(uncached.predict(w, table)[0], first[0])
  reads = []
  original = uncached.batcher.set_state
  uncached.batcher.set_state = lambda state: (reads.append(state), original(state))
  np.testing.assert_array_equal(uncached.predict(w, table)[1], first[1])
  assert len(reads) == 1
