"""SOPRC: stochastic optimisation of AUPRC with a sampling-rate-invariant estimator.

Wen et al., "Exploring the Algorithm-Dependent Generalization of AUPRC
Optimization with List Stability", NeurIPS 2022. Equation numbers in the
docstrings refer to that paper.
"""
from snm_jax.auprc.aux_vector import AuxVectorState
from snm_jax.auprc.aux_vector import ema_update
from snm_jax.auprc.aux_vector import init_aux_vector
from snm_jax.auprc.aux_vector import interpolate_to_quantiles
from snm_jax.auprc.aux_vector import quantile_positions
from snm_jax.auprc.aux_vector import update_aux_vector
from snm_jax.auprc.aux_vector import within_group_targets
from snm_jax.auprc.estimator import ap_loss
from snm_jax.auprc.estimator import smooth_ap_loss
from snm_jax.auprc.estimator import soprc_loss
from snm_jax.auprc.losses import METHODS
from snm_jax.auprc.losses import batch_loss
from snm_jax.auprc.losses import class_priors
from snm_jax.auprc.regularizer import semi_variance
from snm_jax.auprc.sampling import ClassBalancedSampler
from snm_jax.auprc.surrogates import one_sided_huber
from snm_jax.auprc.surrogates import one_sided_sigmoid

__all__ = [
    "AuxVectorState",
    "METHODS",
    "ClassBalancedSampler",
    "ap_loss",
    "batch_loss",
    "class_priors",
    "ema_update",
    "init_aux_vector",
    "interpolate_to_quantiles",
    "one_sided_huber",
    "one_sided_sigmoid",
    "quantile_positions",
    "semi_variance",
    "smooth_ap_loss",
    "soprc_loss",
    "update_aux_vector",
    "within_group_targets",
]
