"""Negative sampler adapter: the tree behind the (ids, log_q) interface of the trainer."""

from __future__ import annotations

import dataclasses
import functools

import jax

from snm_jax.adversarial import tree as tree_lib


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tree"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TreeNegativeSampler:
  """Draws negatives y' ~ p_n(.|x) from a fitted `ProbabilisticTree`.

  `log_q` is log p_n(y'|x), the per-draw probability Eq. 6 needs (for a
  sampled-softmax logQ correction with S draws, add log S). All methods are pure
  and jit-compatible; the sampler (like the tree) is a pytree, so jitted callers
  may pass it as an argument instead of closing over it.
  """
  tree: tree_lib.ProbabilisticTree

  @property
  def num_labels(self) -> int:
    return self.tree.num_labels

  def project(self, x_raw_Nxd: jax.Array) -> jax.Array:
    """Raw features (N, d) -> (N, k), with the PCA projection stored in the tree."""
    return self.tree.project(x_raw_Nxd)

  def sample(self, rng: jax.Array, x_proj_Nxk: jax.Array,
             num_samples: int) -> tuple[jax.Array, jax.Array]:
    """(ids (N, S) int32, log_q (N, S) float32), S = num_samples i.i.d. draws per row."""
    return tree_lib.sample_with_log_prob(self.tree, x_proj_Nxk, rng, num_samples)

  def log_prob(self, x_proj_Nxk: jax.Array, labels_NxS: jax.Array) -> jax.Array:
    """(N, S) log p_n(label | x) of given labels (e.g. the positives)."""
    return tree_lib.log_prob(self.tree, x_proj_Nxk, labels_NxS)
