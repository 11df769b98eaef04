"""Greedy top-down fitting of the probabilistic tree (Bamler & Mandt, ICLR 2020, Sec. 3).

Per node n, with the node's training pairs (x_i, y_i) and the side zeta(y) in
{+1 (right), -1 (left)} currently assigned to each of its labels, the objective
(maximised) is

  L_n(w, b) = sum_i log_sigmoid(zeta(y_i) (w^T x_i + b)) - lambda_n (||w||^2 + b^2).

Fitting a node alternates (a) Newton's method on L_n (concave; each step is
followed by a batched line search over a few step sizes that include 0, so L_n
never decreases) and (b) re-assigning the node's labels: Delta_y = sum over y's
points of (w^T x + b) = w^T S_y + b n_y (S_y, n_y: per-label feature sum and
count), and the half of the labels with the larger Delta_y goes right (a median
split, halves equal in size), until no label changes side, then `polish_steps`
Newton steps, and again from (a) if a re-assignment under the polished parameters
would move a label (convergence: a further round moves nothing; the
`max_reassign_iters` safety cap, 1000 by default, is far above the rounds a level
takes: at most 25 at C = 10^4 on `planted_hierarchy`, where the old cap of 10 left 8
of 14 levels unconverged). w starts as the dominant eigenvector of the covariance of the
node's per-label sums S_y, b = 0; the first step is a re-assignment.

Each tree level is one jitted call over all 2^l nodes of the level (a
`lax.while_loop` over rounds): points are grouped by node with segment sums, and
labels are re-assigned by one lexsort of the (node, Delta) keys over all leaf
slots. The gradient and Hessian segment sums run over chunks of `_POINT_CHUNK`
points (`_chunked_segment_sums`), each chunk forming its own x x^T upper
triangles, so no (N, (k+1)(k+2)/2) array is ever held: precomputed, that array alone
was 6.1 GB for N = 10^7, k = 16 (C = 10^6), plus as much again for its weighted
copy. The chunks are scattered into the running sums in point order, and XLA:CPU's
scatter adds rows in order, so the sums are the same floats as one unchunked
segment sum (fitted trees at C = 10^4 and 10^5 were bit-identical to those of the
precomputing version). Node arrays are padded to a few bucket
sizes (`_bucket`), so a fit compiles the level function at most three times for
C <= 10^6. A node's set of points is fixed while its level is fitted (labels only
swap halves within a node), so rounds never move points between nodes.

Cost per Newton step: O(N k^2) (one chunked pass forming the products); per
re-assignment: O(N + L k). Defaults: rounds of one Newton step each until no label
moves (cap `max_reassign_iters` = 1000), then `polish_steps` = 3 more; a level
that hits the cap is reported (`LevelReport.labels_moved_last` > 0) and logged as a
warning naming it.

Layout during fitting: `label_at_slot_L[j]` is the label at leaf position j
(-1 = padding); at level l with D = depth, slot j lies in node j >> (D - l) and on
its right side iff bit D - l - 1 of j is set. Padding starts at the last L - C
slots and, sorting as +inf, stays at the right end of every node.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from snm_jax.adversarial import tree as tree_lib

_LINE_SEARCH_STEPS = (1.0, 0.5, 0.25, 0.125, 0.0)
_POWER_ITERS = 20
# Node arrays at level l are padded to a bucket size (see `_bucket`): a few compilations
# instead of one per level, and no L/2-sized Cholesky solves at the top levels.
_NODE_BUCKET = 32
# Points (or labels) per chunk of the O(N k^2) segment sums: the per-chunk temporaries
# are _POINT_CHUNK * (k+1)(k+2)/2 floats (10 MB for k = 16: chunks of 2^12 to 2^16 points
# measured alike; the scan adds 0 to 20% to a level's time against the unchunked sums).
_POINT_CHUNK = 1 << 14


@dataclasses.dataclass(frozen=True)
class LevelReport:
  """What fitting one tree level did.

  Attributes:
    level: l (the level has 2^l nodes).
    iterations: re-assignment rounds run (each followed by `newton_steps` Newton steps).
    labels_moved_last: labels a further re-assignment round would move under the level's
      final (polished) parameters (0 = converged; > 0 only when the level hit the
      `max_reassign_iters` cap; -1 = no re-assignment ran, i.e. max_reassign_iters == 0).
    seconds: wall time of the level, including compilation when its bucket is new.
  """
  level: int
  iterations: int
  labels_moved_last: int
  seconds: float

  @property
  def converged(self) -> bool:
    return self.labels_moved_last == 0


def node_objective(theta_MxK1, xa_NxK1, zeta_N, node_N, reg):
  """L_n of every node: (M,). theta = [w, b] per node; xa = [x, 1] per point."""
  s_N = jnp.sum(xa_NxK1 * theta_MxK1[node_N], -1)
  ll_M = jax.ops.segment_sum(jax.nn.log_sigmoid(zeta_N * s_N), node_N, theta_MxK1.shape[0])
  return ll_M - reg * jnp.sum(theta_MxK1**2, -1)


def upper_outer_products(xa_NxK1):
  """(N, T) upper triangles of x_i x_i^T, T = (k+1)(k+2)/2 (row-major `np.triu_indices`)."""
  iu, ju = np.triu_indices(xa_NxK1.shape[1])
  return xa_NxK1[:, iu] * xa_NxK1[:, ju]


def _chunked_segment_sums(make_updates, operands, segment_ids_N, num_segments,
                          chunk=_POINT_CHUNK):
  """`segment_sum(u, segment_ids_N, num_segments)` for each u in `make_updates(*operands)`,
  without ever forming the (N, ...) updates: `make_updates` is applied to chunks of
  `chunk` rows of the (N, ...) `operands` (a `lax.scan` over the full chunks, then the
  remainder), each chunk scattered into the running sums. The scatter adds the rows in
  their order, as one unchunked `segment_sum` does, so the result is the same.
  Out-of-range ids are dropped (like `segment_sum`). Returns a tuple of (num_segments, ...).
  """
  n = segment_ids_N.shape[0]
  shapes = jax.eval_shape(make_updates, *[a[:1] for a in operands])
  acc = tuple(jnp.zeros((num_segments,) + s.shape[1:], s.dtype) for s in shapes)

  def add(acc, rows, ids):
    return tuple(a.at[ids].add(u, mode="drop") for a, u in zip(acc, make_updates(*rows)))

  num_full = n // chunk
  if num_full:
    def body(acc, i):
      take = lambda a: jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk, 0)
      return add(acc, [take(a) for a in operands], take(segment_ids_N)), None
    acc, _ = jax.lax.scan(body, acc, jnp.arange(num_full, dtype=jnp.int32))
  if n % chunk:
    rest = slice(num_full * chunk, n)
    acc = add(acc, [a[rest] for a in operands], segment_ids_N[rest])
  return acc


def newton_step(theta_MxK1, xa_NxK1, zeta_N, node_N, reg, *, chunk=_POINT_CHUNK):
  """One damped Newton ascent step on every node's L_n at once.

  Args:
    theta_MxK1: (M, k+1) per-node [w, b].
    xa_NxK1: (N, k+1) points with a trailing 1.
    zeta_N: (N,) +1 / -1, the side of each point's label in its node.
    node_N: (N,) int node index in [0, M) of each point.
    reg: lambda_n.
    chunk: points per chunk of the gradient / Hessian segment sums (memory
      O(chunk k^2) instead of O(N k^2); the result does not depend on it).

  Returns:
    (M, k+1) new parameters: theta + t * H^-1 grad with, per node, the step size t
    among 1, 1/2, 1/4, 1/8, 0 that gives the largest L_n (so L_n never decreases).
  """
  m, k1 = theta_MxK1.shape
  s_N = jnp.sum(xa_NxK1 * theta_MxK1[node_N], -1)
  z_N = zeta_N * s_N
  g_N = zeta_N * jax.nn.sigmoid(-z_N)
  r_N = jax.nn.sigmoid(z_N) * jax.nn.sigmoid(-z_N)
  # Per node: sum of g x (gradient) and of r x x^T (upper triangle of -Hessian).
  sum_gx_MxK1, upper_MxT = _chunked_segment_sums(
      lambda xa, g, r: (g[:, None] * xa, r[:, None] * upper_outer_products(xa)),
      (xa_NxK1, g_N, r_N), node_N, m, chunk)
  grad_MxK1 = sum_gx_MxK1 - 2.0 * reg * theta_MxK1
  iu, ju = np.triu_indices(k1)
  sym_idx = np.zeros((k1, k1), np.int32)
  sym_idx[iu, ju] = sym_idx[ju, iu] = np.arange(len(iu))
  neg_hess_MxK1xK1 = upper_MxT[:, sym_idx] + 2.0 * reg * jnp.eye(k1, dtype=theta_MxK1.dtype)
  chol = jax.scipy.linalg.cho_factor(neg_hess_MxK1xK1, lower=True)
  step_MxK1 = jax.scipy.linalg.cho_solve(chol, grad_MxK1[..., None])[..., 0]

  ts_T = jnp.asarray(_LINE_SEARCH_STEPS, theta_MxK1.dtype)
  d_N = jnp.sum(xa_NxK1 * step_MxK1[node_N], -1)
  ll_TxM = jax.vmap(lambda t: jax.ops.segment_sum(
      jax.nn.log_sigmoid(zeta_N * (s_N + t * d_N)), node_N, m))(ts_T)
  cand_TxMxK1 = theta_MxK1 + ts_T[:, None, None] * step_MxK1
  obj_TxM = ll_TxM - reg * jnp.sum(cand_TxMxK1**2, -1)
  best_M = jnp.argmax(obj_TxM, axis=0)
  return jnp.take_along_axis(cand_TxMxK1, best_M[None, :, None], axis=0)[0]


def _slot_of_label(label_at_slot_L, num_labels):
  num_slots = label_at_slot_L.shape[0]
  idx = jnp.where(label_at_slot_L >= 0, label_at_slot_L, num_labels)
  return jnp.zeros(num_labels + 1, jnp.int32).at[idx].set(jnp.arange(num_slots, dtype=jnp.int32))[
      :num_labels]


def _reassign(theta_MxK1, label_at_slot_L, sums_Cxk, counts_C, shift):
  """Median split of each node's labels by Delta_y; returns (new label_at_slot, #labels moved)."""
  num_slots = label_at_slot_L.shape[0]
  c = sums_Cxk.shape[0]
  slot_L = jnp.arange(num_slots, dtype=jnp.int32)
  node_L = slot_L >> shift
  real_L = label_at_slot_L >= 0
  lab_L = jnp.where(real_L, label_at_slot_L, 0)
  theta_LxK1 = theta_MxK1[node_L]
  delta_L = jnp.sum(theta_LxK1[:, :-1] * sums_Cxk[lab_L], -1) + theta_LxK1[:, -1] * counts_C[lab_L]
  delta_L = jnp.where(real_L, delta_L, jnp.inf)
  new_L = label_at_slot_L[jnp.lexsort((delta_L, node_L))]
  side = lambda las: (_slot_of_label(las, c) >> (shift - 1)) & 1
  moved = jnp.sum(side(new_L) != side(label_at_slot_L)).astype(jnp.int32)
  return new_L, moved


def _points_in_level(label_at_slot_L, labels_N, num_labels, shift):
  slot_N = _slot_of_label(label_at_slot_L, num_labels)[labels_N]
  zeta_N = jnp.where((slot_N >> (shift - 1)) & 1 == 1, 1.0, -1.0).astype(jnp.float32)
  return zeta_N, slot_N >> shift


def _eig_init(label_at_slot_L, sums_Cxk, shift, num_nodes):
  """[w, b] = [dominant eigenvector of the covariance of the node's S_y, 0] per node."""
  c, k = sums_Cxk.shape
  node_C = _slot_of_label(label_at_slot_L, c) >> shift
  cnt_M = jnp.maximum(jax.ops.segment_sum(jnp.ones(c), node_C, num_nodes), 1.0)
  mean_Mxk = jax.ops.segment_sum(sums_Cxk, node_C, num_nodes) / cnt_M[:, None]
  # Chunked: the (C, k, k) products would be 1 GB for C = 10^6, k = 16.
  second_Mxkxk, = _chunked_segment_sums(lambda s: (s[:, :, None] * s[:, None, :],),
                                        (sums_Cxk,), node_C, num_nodes)
  second_Mxkxk = second_Mxkxk / cnt_M[:, None, None]
  cov_Mxkxk = second_Mxkxk - mean_Mxk[:, :, None] * mean_Mxk[:, None, :]
  # Power iteration: batched eigh on up to L/2 tiny matrices per level is far slower.
  cov_Mxkxk = cov_Mxkxk / jnp.maximum(jnp.trace(cov_Mxkxk, axis1=1, axis2=2), 1e-30)[:, None, None]
  v0_k = 1.0 + jnp.arange(k, dtype=jnp.float32) / k

  def power_step(_, v_Mxk):
    v_Mxk = jnp.einsum("mij,mj->mi", cov_Mxkxk, v_Mxk)
    return v_Mxk / jnp.maximum(jnp.linalg.norm(v_Mxk, axis=-1, keepdims=True), 1e-30)

  w_Mxk = jax.lax.fori_loop(0, _POWER_ITERS, power_step, jnp.broadcast_to(v0_k, (num_nodes, k)))
  return jnp.concatenate([w_Mxk, jnp.zeros((num_nodes, 1), w_Mxk.dtype)], -1)


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _fit_level(xa_NxK1, labels_N, label_at_slot_L, sums_Cxk, counts_C, shift, reg,
               max_iters, newton_steps, polish_steps, *, num_nodes):
  """Fits all nodes of one level; returns (theta (num_nodes, k+1), label_at_slot, iters, moved)."""
  c = sums_Cxk.shape[0]

  def newton(n_steps, theta, las):
    zeta_N, node_N = _points_in_level(las, labels_N, c, shift)
    return jax.lax.fori_loop(
        0, n_steps, lambda _, th: newton_step(th, xa_NxK1, zeta_N, node_N, reg), theta)

  def body(carry):
    theta, las, it, _ = carry
    las, moved = _reassign(theta, las, sums_Cxk, counts_C, shift)
    return newton(newton_steps, theta, las), las, it + 1, moved

  def cond(carry):
    _, _, it, moved = carry
    return (it < max_iters) & (moved != 0)

  def rounds_then_polish(carry):
    """Rounds until one moves no label, then the polish steps, then one more re-assignment
    under the polished parameters: its moves (0 = converged) decide whether to go on."""
    theta, las, it, _ = jax.lax.while_loop(cond, body, carry)
    theta = newton(polish_steps, theta, las)
    _, moved = _reassign(theta, las, sums_Cxk, counts_C, shift)
    return theta, las, it, jnp.where(it > 0, moved, jnp.int32(-1))

  def polished_cond(carry):
    _, _, it, moved = carry
    return (it < max_iters) & (moved > 0)

  theta0 = _eig_init(label_at_slot_L, sums_Cxk, shift, num_nodes)
  # A level is converged when a further round would move no label: after the last round's
  # Newton and the polish steps the median split by Delta must not change.
  return jax.lax.while_loop(polished_cond, rounds_then_polish,
                            rounds_then_polish((theta0, label_at_slot_L, jnp.int32(0), jnp.int32(-1))))


@functools.partial(jax.jit, static_argnames=("num_labels",))
def _label_stats(x_Nxk, labels_N, num_labels):
  """Per-label feature sums S_y (C, k) and point counts n_y (C,)."""
  return (jax.ops.segment_sum(x_Nxk, labels_N, num_labels),
          jax.ops.segment_sum(jnp.ones_like(labels_N, jnp.float32), labels_N, num_labels))


@jax.jit
def _append_ones(x_Nxk):
  return jnp.concatenate([x_Nxk, jnp.ones((x_Nxk.shape[0], 1), x_Nxk.dtype)], -1)


def _bucket(num_nodes, max_nodes):
  """The smallest max_nodes / _NODE_BUCKET^j (j >= 0) >= num_nodes, but >= _NODE_BUCKET."""
  size = max_nodes
  while size // _NODE_BUCKET >= max(num_nodes, _NODE_BUCKET):
    size //= _NODE_BUCKET
  return size


def fit_tree(x_Nxk, labels_N, num_labels: int, *, reg: float = 0.1,
             max_reassign_iters: int = 1000, newton_steps: int = 1, polish_steps: int = 3,
             init_leaf_of_label=None, projection=None,
             ) -> tuple[tree_lib.ProbabilisticTree, list[LevelReport]]:
  """Fits the tree greedily top-down, one batched jitted computation per level.

  Args:
    x_Nxk: (N, k) float features, already projected (e.g. `fit_projection` + `project`).
      Multi-label data: pass one row per (point, label) pair.
    labels_N: (N,) int labels in [0, num_labels).
    num_labels: C >= 2.
    reg: lambda_n of the regulariser lambda_n (||w||^2 + b^2) (0.1 in the paper).
    max_reassign_iters: safety cap on re-assignment rounds per level (a level stops when
      no label moves; hitting the cap is a logged warning); 0 keeps the initial
      label -> leaf map and only fits the node parameters (a fixed-structure tree).
    newton_steps: Newton steps after each re-assignment.
    polish_steps: extra Newton steps once a level has stopped re-assigning.
    init_leaf_of_label: optional (C,) initial leaf of each label (default: label y at leaf y).
    projection: optional (mean (d,), components (k, d)) stored in the tree for `tree.project`.

  Returns:
    The tree and one `LevelReport` per level (levels that hit the cap are logged).
  """
  x_Nxk = jnp.asarray(x_Nxk, jnp.float32)
  labels_np = np.asarray(labels_N)
  if x_Nxk.ndim != 2 or labels_np.shape != (x_Nxk.shape[0],):
    raise ValueError(f"expected x (N, k) and labels (N,), got {x_Nxk.shape} and {labels_np.shape}")
  if labels_np.size and (labels_np.min() < 0 or labels_np.max() >= num_labels):
    raise ValueError(f"labels must lie in [0, {num_labels})")
  num_leaves = tree_lib.num_leaves_for(num_labels)
  depth = num_leaves.bit_length() - 1
  k = x_Nxk.shape[1]

  label_at_slot = np.full(num_leaves, -1, np.int32)
  leaf0 = np.arange(num_labels) if init_leaf_of_label is None else np.asarray(init_leaf_of_label)
  if (leaf0.shape != (num_labels,) or leaf0.min() < 0 or leaf0.max() >= num_leaves
      or len(np.unique(leaf0)) != num_labels):
    raise ValueError(
        f"init_leaf_of_label must hold {num_labels} distinct leaves in [0, {num_leaves})")
  label_at_slot[leaf0] = np.arange(num_labels, dtype=np.int32)
  label_at_slot = jnp.asarray(label_at_slot)

  labels = jnp.asarray(labels_np, jnp.int32)
  sums_Cxk, counts_C = _label_stats(x_Nxk, labels, num_labels=num_labels)
  xa_NxK1 = _append_ones(x_Nxk)
  del x_Nxk  # only xa is used from here on (frees the device copy of x)
  theta_LxK1 = np.zeros((num_leaves, k + 1), np.float32)
  reports = []
  for level in range(depth):
    t0 = time.perf_counter()
    theta, label_at_slot, iters, moved = _fit_level(
        xa_NxK1, labels, label_at_slot, sums_Cxk, counts_C, jnp.int32(depth - level),
        jnp.float32(reg), jnp.int32(max_reassign_iters), jnp.int32(newton_steps),
        jnp.int32(polish_steps), num_nodes=_bucket(1 << level, num_leaves // 2))
    theta_LxK1[1 << level:2 << level] = np.asarray(theta)[:1 << level]
    reports.append(LevelReport(level, int(iters), int(moved), time.perf_counter() - t0))
    if reports[-1].iterations >= max_reassign_iters > 0 and not reports[-1].converged:
      logging.warning("tree level %d: %d labels still moving after %d re-assignment rounds (the "
                      "max_reassign_iters cap): the level is not converged",
                      level, reports[-1].labels_moved_last, max_reassign_iters)

  label_at_slot = np.asarray(label_at_slot)
  leaf_of_label = np.empty(num_labels, np.int32)
  real = label_at_slot >= 0
  leaf_of_label[label_at_slot[real]] = np.nonzero(real)[0]
  tree = tree_lib.make_tree(theta_LxK1[:, :k], theta_LxK1[:, k], leaf_of_label, projection)
  return tree, reports
