"""The probabilistic binary decision tree p_n(y|x) of Bamler & Mandt (ICLR 2020, Sec. 3).

Layout (heap order). A tree over C labels has L = 2^D leaves, D = ceil(log2 C),
so L - C leaves are padding. Internal node n (1 <= n < L) has children 2n and
2n + 1; node 1 is the root; leaf j (0 <= j < L) is heap node L + j. Row n of
`weights_Lxk` / `biases_L` holds node n (row 0 is unused), so the tables have
exactly L rows.

At node n the decision zeta in {+1, -1} ("right" = child 2n + 1 is +1) has
likelihood sigmoid(zeta * (w_n^T x + b_n)), and

  log p_n(y|x) = sum over the nodes n on the root-to-leaf path of y of
                 log_sigmoid(zeta_n(y) * (w_n^T x + b_n)).

Padding. Every node one of whose children holds only padding gets w_n = 0 and
b_n = -/+ SATURATION_LOGIT (towards the real child). Then log p of a padding
leaf is <= -1e4 (finite, so no inf - inf anywhere), exp(log p) == 0.0 exactly in
float32, the real side's log_sigmoid(1e4) == 0.0 exactly, and ancestral sampling
(u < sigmoid(s) with u in [0, 1)) can never enter the padding side.

Features x are the k-dimensional PCA projections (`projection.py`); the tree can
carry the projection (`proj_mean_d`, `proj_components_kxd`) so `tree.project`
maps raw dense features to the x every other function here expects.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# |b| of a node with an all-padding child. exp(-1e4) underflows to exactly 0 in float32.
SATURATION_LOGIT = 1e4


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["weights_Lxk", "biases_L", "leaf_of_label_C", "label_of_leaf_L",
                 "proj_mean_d", "proj_components_kxd"],
    meta_fields=[])
@dataclasses.dataclass(frozen=True)
class ProbabilisticTree:
  """A balanced probabilistic binary tree over C labels (a pytree; see module docstring).

  Attributes:
    weights_Lxk: (L, k) float32, row n = w of heap node n; row 0 unused.
    biases_L: (L,) float32, b of heap node n.
    leaf_of_label_C: (C,) int32, the leaf position in [0, L) of each label.
    label_of_leaf_L: (L,) int32, the label at each leaf, -1 for padding.
    proj_mean_d: (d,) float32 PCA mean of the raw features, or None.
    proj_components_kxd: (k, d) float32 PCA components, or None.
  """
  weights_Lxk: jax.Array
  biases_L: jax.Array
  leaf_of_label_C: jax.Array
  label_of_leaf_L: jax.Array
  proj_mean_d: jax.Array | None = None
  proj_components_kxd: jax.Array | None = None

  @property
  def num_labels(self) -> int:
    return self.leaf_of_label_C.shape[0]

  @property
  def num_leaves(self) -> int:
    return self.label_of_leaf_L.shape[0]

  @property
  def depth(self) -> int:
    return self.num_leaves.bit_length() - 1

  @property
  def dim(self) -> int:
    return self.weights_Lxk.shape[1]

  def project(self, x_raw_Nxd: jax.Array) -> jax.Array:
    """Raw dense features (N, d) -> PCA features (N, k): (x - mean) @ components^T."""
    if self.proj_components_kxd is None:
      raise ValueError("this tree carries no projection; pass already-projected features")
    return (x_raw_Nxd - self.proj_mean_d) @ self.proj_components_kxd.T


def num_leaves_for(num_labels: int) -> int:
  """L = the smallest power of two >= C (and >= 2)."""
  if num_labels < 2:
    raise ValueError(f"a tree needs at least 2 labels, got {num_labels}")
  return 1 << (num_labels - 1).bit_length()


def make_tree(weights_Lxk, biases_L, leaf_of_label_C, projection=None) -> ProbabilisticTree:
  """Assembles a tree from node parameters and a label -> leaf map; saturates padding.

  Args:
    weights_Lxk: (L, k) node weights (row n = heap node n).
    biases_L: (L,) node biases.
    leaf_of_label_C: (C,) distinct leaf positions in [0, L), L = num_leaves_for(C).
    projection: optional (mean (d,), components (k, d)) from `fit_projection`.
  """
  leaf_of_label = np.asarray(leaf_of_label_C, np.int32)
  c = leaf_of_label.shape[0]
  num_leaves = num_leaves_for(c)
  weights = np.array(weights_Lxk, np.float32)
  biases = np.array(biases_L, np.float32)
  if weights.shape[0] != num_leaves or biases.shape != (num_leaves,):
    raise ValueError(f"expected ({num_leaves}, k) weights and ({num_leaves},) biases for C={c}, "
                     f"got {weights.shape} and {biases.shape}")
  if (leaf_of_label.min() < 0 or leaf_of_label.max() >= num_leaves
      or len(np.unique(leaf_of_label)) != c):
    raise ValueError("leaf_of_label must hold distinct leaf positions in [0, L)")
  label_of_leaf = np.full(num_leaves, -1, np.int32)
  label_of_leaf[leaf_of_label] = np.arange(c, dtype=np.int32)
  _saturate_padding(weights, biases, label_of_leaf >= 0)
  mean, comps = (None, None) if projection is None else projection
  as_f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
  return ProbabilisticTree(jnp.asarray(weights), jnp.asarray(biases), jnp.asarray(leaf_of_label),
                           jnp.asarray(label_of_leaf), as_f32(mean), as_f32(comps))


def _saturate_padding(weights, biases, real_leaf_L):
  """In place: w = 0, b = -/+SATURATION_LOGIT at nodes with exactly one all-padding child."""
  num_leaves = real_leaf_L.shape[0]
  # has_real[n] for heap nodes n in [1, 2L): leaves at [L, 2L), built bottom-up.
  has_real = np.zeros(2 * num_leaves, bool)
  has_real[num_leaves:] = real_leaf_L
  for n in range(num_leaves - 1, 0, -1):
    has_real[n] = has_real[2 * n] or has_real[2 * n + 1]
  nodes = np.arange(1, num_leaves)
  left, right = has_real[2 * nodes], has_real[2 * nodes + 1]
  to_left = left & ~right
  to_right = right & ~left
  weights[nodes[to_left | to_right]] = 0.0
  biases[nodes[to_left]] = -SATURATION_LOGIT
  biases[nodes[to_right]] = SATURATION_LOGIT


def random_tree(seed: int, num_labels: int, dim: int, scale: float = 1.0,
                projection=None) -> ProbabilisticTree:
  """A tree with N(0, scale^2) node parameters and a random label -> leaf map (padding anywhere)."""
  rng = np.random.default_rng(seed)
  num_leaves = num_leaves_for(num_labels)
  weights = scale * rng.normal(size=(num_leaves, dim))
  biases = scale * rng.normal(size=num_leaves)
  return make_tree(weights, biases, rng.permutation(num_leaves)[:num_labels], projection)


@jax.jit
def log_prob(tree: ProbabilisticTree, x_Nxk: jax.Array, labels_NxS: jax.Array) -> jax.Array:
  """log p_n(y|x) for given labels (paper Sec. 3); O(k log C) per label.

  Args:
    tree: the tree.
    x_Nxk: (N, k) projected features.
    labels_NxS: (N, S) int label ids in [0, C).

  Returns:
    (N, S) float32 log-probabilities.
  """
  d = tree.depth
  heap_NxS = tree.num_leaves + tree.leaf_of_label_C[labels_NxS]
  logp_NxS = jnp.zeros(labels_NxS.shape, jnp.float32)
  for level in range(d):
    node_NxS = heap_NxS >> (d - level)
    go_right_NxS = (heap_NxS >> (d - level - 1)) & 1
    s_NxS = (jnp.einsum("nk,nsk->ns", x_Nxk, tree.weights_Lxk[node_NxS])
             + tree.biases_L[node_NxS])
    logp_NxS += jax.nn.log_sigmoid(jnp.where(go_right_NxS == 1, s_NxS, -s_NxS))
  return logp_NxS


@jax.jit
def leaf_log_probs(tree: ProbabilisticTree, x_Nxk: jax.Array) -> jax.Array:
  """log p of every leaf, level by level: (N, L); O(L k) per query, padding leaves <= -1e4."""
  n = x_Nxk.shape[0]
  logp = jnp.zeros((n, 1), jnp.float32)
  for level in range(tree.depth):
    nodes = slice(1 << level, 2 << level)
    s_NxM = x_Nxk @ tree.weights_Lxk[nodes].T + tree.biases_L[nodes]
    children = jnp.stack([logp + jax.nn.log_sigmoid(-s_NxM), logp + jax.nn.log_sigmoid(s_NxM)], -1)
    logp = children.reshape(n, 2 << level)
  return logp


@jax.jit
def log_prob_all(tree: ProbabilisticTree, x_Nxk: jax.Array) -> jax.Array:
  """log p_n(y|x) for all C labels: (N, C), O(C k) per query (level-by-level)."""
  return leaf_log_probs(tree, x_Nxk)[:, tree.leaf_of_label_C]


@functools.partial(jax.jit, static_argnames=("size",))
def log_prob_leaves(tree: ProbabilisticTree, x_Nxk: jax.Array, start, size: int) -> jax.Array:
  """log p of the leaves start, ..., start + size - 1 (needs start + size <= L): (N, size).

  A padding leaf keeps its saturated log p <= -1e4 (no -inf mask: exp() of it is exactly 0 in
  float32, so it never enters a top-k or a log-sum-exp; a where() on the subtree expansion made
  XLA:CPU's fused loop ~3x slower). For chunked evaluation in the tree's leaf order (the Eq. 5
  bias of `train/evaluate.py`): when `start` is a multiple of a power-of-two `size`, the range
  is a whole subtree, expanded level by level as in `log_prob_leaf_chunk`, O((size + log C) k)
  per query, so a sweep over all leaves costs O(C k); any other range (checked at run time by
  `lax.cond`, e.g. a retrieval block shifted back to stay in range) walks each leaf's path,
  O(size k log C). `start` may be traced; `size` is static (1: one leaf's path = `log_prob`).
  """
  leaves = jnp.minimum(start + jnp.arange(size), tree.num_leaves - 1)
  per_path = lambda x: _log_prob_at_leaves(tree, x, leaves)  # pylint: disable=unnecessary-lambda-assignment
  if size & (size - 1) or size > tree.num_leaves:  # never a whole subtree
    return per_path(x_Nxk)
  subtree = lambda x: _subtree_log_probs(tree, x, start // size, size)  # pylint: disable=unnecessary-lambda-assignment
  return subtree(x_Nxk) if size == 1 else jax.lax.cond(start % size == 0, subtree, per_path, x_Nxk)


def _subtree_log_probs(tree: ProbabilisticTree, x_Nxk: jax.Array, chunk, size: int) -> jax.Array:
  """log p (N, size) of the leaves [chunk * size, (chunk + 1) * size), a whole subtree (size a
  power of two): its root's path walked once, then expanded level by level. Padding leaves keep
  their saturated log p (<= -1e4)."""
  sub_depth = size.bit_length() - 1
  root_depth = tree.depth - sub_depth
  root = (tree.num_leaves >> sub_depth) + chunk  # heap index of the chunk's subtree root
  n = x_Nxk.shape[0]
  logp = jnp.zeros((n, 1), jnp.float32)
  for level in range(root_depth):
    node = root >> (root_depth - level)
    s_N1 = x_Nxk @ tree.weights_Lxk[node][:, None] + tree.biases_L[node]
    go_right = (root >> (root_depth - level - 1)) & 1
    logp += jax.nn.log_sigmoid(jnp.where(go_right == 1, s_N1, -s_N1))
  for level in range(sub_depth):
    nodes = (root << level) + jnp.arange(1 << level)
    s_NxM = x_Nxk @ tree.weights_Lxk[nodes].T + tree.biases_L[nodes]
    children = jnp.stack([logp + jax.nn.log_sigmoid(-s_NxM), logp + jax.nn.log_sigmoid(s_NxM)], -1)
    logp = children.reshape(n, 2 << level)
  return logp


def log_prob_shared(tree: ProbabilisticTree, x_Nxk: jax.Array, labels_S: jax.Array) -> jax.Array:
  """`log_prob` for the same labels (S,) at every query: (N, S), O(N S k log C) FLOPs.

  The labels' path nodes do not depend on the query, so each level is one (N, k) x (k, S)
  matmul against the S gathered node rows, where `log_prob`'s per-query labels gather an
  (N, S, k) array per level: measured at C = 10^5, N = 256, S = 4,096 (the evaluation's Eq. 5
  bias block in label order, before `log_prob_leaves`), 46 ms against 335 ms per block, same values within 2.3e-5."""
  return _log_prob_at_leaves(tree, x_Nxk, tree.leaf_of_label_C[labels_S])


def _log_prob_at_leaves(tree: ProbabilisticTree, x_Nxk: jax.Array, leaves_S: jax.Array) -> jax.Array:
  """log p of the same leaves (S,) in [0, L) at every query: (N, S), each leaf's path walked."""
  d = tree.depth
  heap_S = tree.num_leaves + leaves_S
  logp_NxS = jnp.zeros((x_Nxk.shape[0], leaves_S.shape[0]), jnp.float32)
  for level in range(d):
    node_S = heap_S >> (d - level)
    go_right_S = (heap_S >> (d - level - 1)) & 1
    s_NxS = x_Nxk @ tree.weights_Lxk[node_S].T + tree.biases_L[node_S]
    logp_NxS += jax.nn.log_sigmoid(jnp.where(go_right_S == 1, s_NxS, -s_NxS))
  return logp_NxS


@functools.partial(jax.jit, static_argnames=("size",))
def log_prob_leaf_chunk(tree: ProbabilisticTree, x_Nxk: jax.Array, chunk, size: int,
                        ) -> tuple[jax.Array, jax.Array]:
  """log p_n for the labels at leaves [chunk * size, (chunk + 1) * size): O((size + log C) k).

  The chunk is a whole subtree, so its root's path is walked once and the subtree
  is expanded level by level: a sweep over all L / size chunks costs O(C k) per
  query without ever holding an (N, C) array. Chunks follow the tree's leaf order,
  so a chunked top-k scores the labels `labels_S` of each chunk (gathering their
  rows of the score model).

  Args:
    tree: the tree.
    x_Nxk: (N, k) projected features.
    chunk: int (may be traced), 0 <= chunk < L / size.
    size: static power of two, 1 <= size <= L.

  Returns:
    labels_S: (size,) int32 label ids of the chunk's leaves, -1 for padding.
    logp_NxS: (N, size) float32 log p_n(label | x); -inf at padding leaves.
  """
  if size < 1 or size & (size - 1) or size > tree.num_leaves:
    raise ValueError(f"size must be a power of two in [1, {tree.num_leaves}], got {size}")
  logp = _subtree_log_probs(tree, x_Nxk, chunk, size)
  labels_S = jax.lax.dynamic_slice(tree.label_of_leaf_L, (chunk * size,), (size,))
  return labels_S, jnp.where(labels_S >= 0, logp, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("num_samples",))
def sample_with_log_prob(tree: ProbabilisticTree, x_Nxk: jax.Array, rng: jax.Array,
                         num_samples: int) -> tuple[jax.Array, jax.Array]:
  """Ancestral sampling y ~ p_n(.|x), O(k log C) per draw (paper Sec. 3).

  Args:
    tree: the tree.
    x_Nxk: (N, k) projected features.
    rng: PRNG key.
    num_samples: S, i.i.d. draws per row of x.

  Returns:
    labels: (N, S) int32 in [0, C) (padding is never drawn).
    log_p: (N, S) float32, log p_n(label | x), accumulated along the path.
  """
  n = x_Nxk.shape[0]
  u_DxNxS = jax.random.uniform(rng, (tree.depth, n, num_samples))
  node_NxS = jnp.ones((n, num_samples), jnp.int32)
  logp_NxS = jnp.zeros((n, num_samples), jnp.float32)
  for level in range(tree.depth):
    if (1 << level) <= num_samples:
      # Fewer nodes than draws: one dense (N, 2^l) logit table, then a scalar gather.
      first = 1 << level
      s_NxM = x_Nxk @ tree.weights_Lxk[first:2 * first].T + tree.biases_L[first:2 * first]
      s_NxS = jnp.take_along_axis(s_NxM, node_NxS - first, axis=1)
    else:
      s_NxS = (jnp.einsum("nk,nsk->ns", x_Nxk, tree.weights_Lxk[node_NxS])
               + tree.biases_L[node_NxS])
    go_right = u_DxNxS[level] < jax.nn.sigmoid(s_NxS)
    logp_NxS += jax.nn.log_sigmoid(jnp.where(go_right, s_NxS, -s_NxS))
    node_NxS = 2 * node_NxS + go_right.astype(jnp.int32)
  return tree.label_of_leaf_L[node_NxS - tree.num_leaves], logp_NxS


def sample(tree: ProbabilisticTree, x_Nxk: jax.Array, rng: jax.Array,
           num_samples: int) -> jax.Array:
  """(N, S) int32 labels drawn from p_n(.|x); see `sample_with_log_prob`."""
  return sample_with_log_prob(tree, x_Nxk, rng, num_samples)[0]
