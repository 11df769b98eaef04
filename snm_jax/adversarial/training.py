"""The tree sampler inside the trainer: projection of padded sparse batches, and
draws of negatives with their log p_n: the `draw` of a global sampler
(`snm_jax.mining.negatives.GlobalNegatives`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from snm_jax.adversarial import tree as tree_lib
from snm_jax.adversarial.fit import LevelReport, fit_tree
from snm_jax.adversarial.projection import fit_projection, project


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tree"],
                   meta_fields=["num_samples"])
@dataclasses.dataclass(frozen=True)
class TreeTrainingSampler:
  """Draws `num_samples` negatives per example from p_n(.|x) (per-example, not stratified).

  The tree's PCA projection is applied to the padded sparse rows on device:
  x_proj = sum_i v_i C[:, id_i] - C mean, O(nnz k) per example.
  """
  tree: tree_lib.ProbabilisticTree
  num_samples: int

  @property
  def num_labels(self) -> int:
    return self.tree.num_labels

  def project_sparse(self, feat_ids_NxZ, feat_vals_NxZ):
    """(N, nnz) padded sparse rows -> (N, k) projected features."""
    comps_dxk = jnp.asarray(self.tree.proj_components_kxd).T
    x = jnp.einsum("nz,nzk->nk", feat_vals_NxZ, comps_dxk[feat_ids_NxZ])
    return x - jnp.asarray(self.tree.proj_mean_d) @ comps_dxk

  def project_sparse_host(self, features) -> np.ndarray:
    """Host-side projection of a CSR/dense feature matrix (N, d) -> (N, k)."""
    comps = np.asarray(self.tree.proj_components_kxd)
    return project(features, (np.asarray(self.tree.proj_mean_d), comps))

  def draw(self, key, batch):
    """batch: 'feat_ids', 'feat_vals' (N, nnz), 'label' (N,). Returns (ids (N, S), log_q (N, S),
    log_q_pos (N,)).

    As for every sampler of the trainer, log_q is the log *expected count* of
    a label among the example's S draws, log(S p_n(y|x)) here, for draws and
    positives alike (the sampled-softmax / NCE convention); Eq. 6 subtracts log S.
    """
    x = self.project_sparse(batch["feat_ids"], batch["feat_vals"])
    ids, log_p = tree_lib.sample_with_log_prob(self.tree, x, key, self.num_samples)
    log_p_pos = tree_lib.log_prob(self.tree, x, batch["label"][:, None])[:, 0]
    log_s = jnp.log(float(self.num_samples))
    return ids, log_p + log_s, log_p_pos + log_s

  def log_prob_leaf_block(self, x_proj_NxK, leaf_ids_R):
    """log p_n(y|x) (N, R) of the labels at a contiguous block of leaves (R,): the Eq. 5 bias of
    the evaluation, which scans the class table in leaf order; padding leaves <= -1e4 (saturated),
    ids must be < L. O((R + log C) k) per query for a block aligned to a power-of-two R
    (`tree.log_prob_leaves`)."""
    return tree_lib.log_prob_leaves(self.tree, x_proj_NxK, leaf_ids_R[0], leaf_ids_R.shape[0])


def fit_tree_sampler(features, labels_N, num_labels: int, *, pca_dim: int, reg: float,
                     num_samples: int, max_reassign_iters: int = 1000
                     ) -> tuple[TreeTrainingSampler, list[LevelReport]]:
  """PCA-`pca_dim` projection + greedy tree fit on (feature row, label) training pairs.
  Returns the sampler and `fit_tree`'s report of each level (rounds, convergence)."""
  projection = fit_projection(features, pca_dim)
  x = project(features, projection)
  tree, reports = fit_tree(x, np.asarray(labels_N), num_labels, reg=reg,
                           max_reassign_iters=max_reassign_iters, projection=projection)
  return TreeTrainingSampler(tree=tree, num_samples=num_samples), reports
