"""Adversarial negative sampling with a probabilistic decision tree (Bamler & Mandt, ICLR 2020).

`fit_projection` -> `fit_tree` -> `TreeTrainingSampler` (`fit_tree_sampler` does all three) for training with
`adversarial_ns_loss` (Eq. 6); `log_prob_all` / `log_prob_leaf_chunk` /
`log_prob_leaves` + `debias_scores` (Eq. 5) for prediction.
"""

from snm_jax.adversarial.fit import LevelReport, fit_tree
from snm_jax.adversarial.loss import adversarial_ns_loss, debias_scores
from snm_jax.adversarial.projection import fit_projection, project
from snm_jax.adversarial.synthetic import planted_hierarchy
from snm_jax.adversarial.training import TreeTrainingSampler, fit_tree_sampler
from snm_jax.adversarial.tree import (
    SATURATION_LOGIT,
    ProbabilisticTree,
    leaf_log_probs,
    log_prob,
    log_prob_all,
    log_prob_leaf_chunk,
    log_prob_leaves,
    make_tree,
    random_tree,
    sample,
    sample_with_log_prob,
)

__all__ = [
    "SATURATION_LOGIT", "LevelReport", "ProbabilisticTree", "TreeTrainingSampler",
    "adversarial_ns_loss", "debias_scores", "fit_projection", "fit_tree", "fit_tree_sampler", "leaf_log_probs",
    "log_prob", "log_prob_all", "log_prob_leaf_chunk", "log_prob_leaves", "make_tree",
    "planted_hierarchy", "project", "random_tree", "sample", "sample_with_log_prob",
]
