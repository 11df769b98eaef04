"""Eq. 5 (tree-debiased) evaluation in the tree's leaf order equals the label-order evaluation
and a dense NumPy reference (argsort of q W^T + log p_n, float64), on 1 device and sharded meshes
(8 forced CPU devices), for predictions and the predictive log-likelihood; and
`tree.log_prob_leaves` is right for any contiguous range of leaves (aligned subtrees or not;
padding leaves keep their saturated log p <= -1e4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

from snm_jax import adversarial as adv
from snm_jax import sharding
from snm_jax.adversarial import tree as tree_lib
from snm_jax.train.core.evaluate import Evaluator, leaf_order_rows

C = 203          # labels: L = 256 leaves, 53 of them padding (at random positions)
K_PAD = 216      # class-table rows (a multiple of 8 and of 3 model shards)
N, D, H, KDIM = 20, 6, 8, 4   # points, raw features, embedding, tree features
TOP_K = 5


def _np_leaf_log_probs(tree, x):
  """Float64 reference: log p of every leaf (n, L) level by level (padding leaves <= -1e4)."""
  w = np.asarray(tree.weights_Lxk, np.float64)
  b = np.asarray(tree.biases_L, np.float64)
  logp = np.zeros((x.shape[0], 1))
  for level in range(tree.depth):
    nodes = np.arange(1 << level, 2 << level)
    s = np.asarray(x, np.float64) @ w[nodes].T + b[nodes]
    # log_sigmoid(-s) = -logaddexp(0, s): left child (zeta = -1), then right.
    logp = np.stack([logp - np.logaddexp(0, s), logp - np.logaddexp(0, -s)], -1).reshape(len(x), -1)
  return logp


@pytest.fixture(scope="module")
def tree():
  return adv.random_tree(3, num_labels=C, dim=KDIM, scale=1.0)


@pytest.mark.parametrize("size", [1, 3, 4, 16, 40, 256])
def test_log_prob_leaves_any_contiguous_range(tree, size):
  rng = np.random.default_rng(size)
  x = rng.normal(size=(5, KDIM)).astype(np.float32)
  ref = _np_leaf_log_probs(tree, x)
  real = np.asarray(tree.label_of_leaf_L) >= 0
  # Aligned subtrees and ranges shifted off alignment (the per-path fallback), all within L.
  starts = {0, size, 1, size + 3, 256 - size, 256 - size - 1}
  for start in sorted(s for s in starts if 0 <= s and s + size <= 256):
    got = np.asarray(adv.log_prob_leaves(tree, jnp.asarray(x), jnp.int32(start), size))
    want, is_real = ref[:, start:start + size], real[start:start + size]
    np.testing.assert_allclose(got[:, is_real], want[:, is_real], rtol=1e-5, atol=1e-4)
    assert np.all(got[:, ~is_real] <= -adv.SATURATION_LOGIT + 50)


def test_leaf_order_rows_aligns_blocks_to_subtrees():
  label_of_leaf = np.arange(256) - 1
  rows, block = leaf_order_rows(label_of_leaf, 8, 4096)
  assert block == 32 and rows.shape == (256,)
  rows, block = leaf_order_rows(label_of_leaf, 3, 100)   # 64-leaf blocks, 3 x 2 x 64 rows
  assert block == 64 and rows.shape == (384,)
  np.testing.assert_array_equal(rows[:256], label_of_leaf)
  assert np.all(rows[256:] == -1)
  assert leaf_order_rows(label_of_leaf[:4], 8, 16)[1] == 1   # more shards than leaves


def _label_order_bias(tree):
  """The label-order Eq. 5 bias (the evaluation before leaf order): log p_n of a contiguous
  range of label ids, each label's path walked; ids >= C give -inf."""

  def bias_fn(x, ids):
    valid = ids < C
    return jnp.where(valid, tree_lib.log_prob_shared(tree, x, jnp.where(valid, ids, 0)), -jnp.inf)

  return bias_fn


@pytest.fixture(scope="module")
def problem(tree):
  rng = np.random.default_rng(7)
  features = sp.csr_matrix(rng.normal(size=(N, D)).astype(np.float32))
  first = rng.integers(0, C, N)
  labels = sp.csr_matrix((np.ones(N, np.float32), first, np.arange(N + 1)), shape=(N, C))
  w = (2.0 * rng.normal(size=(D, H))).astype(np.float32)
  proj = rng.normal(size=(D, KDIM)).astype(np.float32)
  table = rng.normal(size=(K_PAD, H)).astype(np.float32)
  x_proj = (features @ proj).astype(np.float32)
  q = features.toarray().astype(np.float64) @ w
  table_n = table[:C] / np.linalg.norm(table[:C], axis=1, keepdims=True)
  logp = _np_leaf_log_probs(tree, x_proj)[:, np.asarray(tree.leaf_of_label_C)]
  scores = q @ table_n.T + logp                                        # Eq. 5, (N, C)
  lse = np.log(np.exp(scores - scores.max(1, keepdims=True)).sum(1)) + scores.max(1)
  ref = {"scores": scores, "pred": np.argsort(-scores, axis=1, kind="stable")[:, :TOP_K],
         "loglik": scores[np.arange(N), first] - lse}
  # The bias matters: it changes the top-k (else the test could not see a wrong bias).
  assert (np.argsort(-(q @ table_n.T), axis=1, kind="stable")[:, :TOP_K] != ref["pred"]).any()
  return features, labels, w, x_proj, table, ref


def _tower_apply(params, ids, vals):  # a linear map of the densified rows
  dense = jnp.zeros((ids.shape[0], D)).at[jnp.arange(ids.shape[0])[:, None], ids].add(vals)
  return dense @ params


def _predict(problem, mesh, bias_fn, row_block, row_labels=None):
  features, labels, w, x_proj, table, _ = problem
  ev = Evaluator(tower_apply=_tower_apply, features=features, labels=labels, mesh=mesh, num_labels=C,
                 k=TOP_K, query_chunk=8, row_block=row_block, normalize_classes=True, max_nnz=D,
                 max_labels=1, bias_fn=bias_fn, extra_fn=lambda rows: x_proj[np.maximum(rows, 0)],
                 with_loglik=True, row_labels=row_labels)
  return ev.predict(jnp.asarray(w), jax.device_put(table, sharding.named(mesh, sharding.TABLE)))


_LABEL_ORDER = {}
# The meshes the label-order evaluation itself runs on: one device, and both axes sharded. The
# leaf-order cases on other meshes are compared with the one-device result (each label-order
# evaluation costs ~7 s of compile; its value does not depend on the mesh, up to float32 sums).
LABEL_ORDER_MESHES = ((1, 1), (2, 4))


def _label_order_predict(tree, problem, mesh_shape):
  """The label-order evaluation (row block 12) on `mesh_shape` if one of LABEL_ORDER_MESHES, else on
  one device; computed once per mesh (it does not depend on the leaf-order case)."""
  mesh_shape = mesh_shape if mesh_shape in LABEL_ORDER_MESHES else (1, 1)
  if mesh_shape not in _LABEL_ORDER:
    _LABEL_ORDER[mesh_shape] = _predict(problem, sharding.make_mesh(mesh_shape), _label_order_bias(tree), 12)
  return _LABEL_ORDER[mesh_shape]


# (mesh, configured row block, row block given to the retrieval: None = leaf_order_rows's).
# (1, 3): L = 256 is not divisible by 3 model shards: rows padded to 288 past L. The last case
# forces misaligned blocks (96 rows per shard in blocks of 64, the last shifted back by 32): the
# bias then falls back to per-leaf paths for those blocks.
@pytest.mark.parametrize("mesh_shape,row_block,forced_block", [
    ((1, 1), 16, None), ((2, 4), 16, None), ((1, 8), 4096, None), ((1, 3), 16, None), ((1, 3), 16, 64)])
def test_leaf_order_eval_equals_label_order_and_reference(tree, problem, mesh_shape, row_block,
                                                          forced_block):
  ref = problem[-1]
  mesh = sharding.make_mesh(mesh_shape)
  sampler = adv.TreeTrainingSampler(tree=tree, num_samples=1)
  row_labels, block = leaf_order_rows(np.asarray(tree.label_of_leaf_L), mesh.shape[sharding.MODEL],
                                      row_block)
  new_pred, new_ll = _predict(problem, mesh, sampler.log_prob_leaf_block, forced_block or block,
                              row_labels)
  old_pred, old_ll = _label_order_predict(tree, problem, mesh_shape)
  for pred, ll in ((new_pred, new_ll), (old_pred, old_ll)):
    assert pred.shape == (N, TOP_K) and (pred >= 0).all() and (pred < C).all()
    # The reference's top-k, up to float32 near-ties (compare the reference scores of the ids).
    np.testing.assert_allclose(np.take_along_axis(ref["scores"], pred, 1),
                               np.take_along_axis(ref["scores"], ref["pred"], 1), rtol=0, atol=1e-4)
    np.testing.assert_allclose(ll, ref["loglik"], rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(new_pred, old_pred)   # no near-ties in this draw
  np.testing.assert_allclose(new_ll, old_ll, rtol=1e-5, atol=1e-5)
