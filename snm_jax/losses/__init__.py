"""Losses for very large output spaces: OWL, SNM, S2M, softmax family.

The losses the trainer runs are in `snm_jax.losses.sampled` (over positive
scores (N,), sampled negative scores (N, S), validity and log proposal arrays,
with an optional `axis_name` for the sharded reduction), looked up by
`loss.kind` in `snm_jax.losses.registry`; `softmax.py` and
`adversarial.adversarial_ns_loss` wrap them. The exact O(K) forms (`owl.py`)
are references. `topk.py` holds the distributed top-k merge.

Per-example functions (`powl`, `bowl`, `snm_loss`) take one score vector and
are batched with `jax.vmap`; the softmax family and `avg_top_k` reduce the last
axis and broadcast over leading dims. SOPRC lives in `snm_jax.auprc`.
"""

from snm_jax.losses.contrastive import cosine_contrastive_loss
from snm_jax.losses.owl import bowl, owl_loss, powl, sorted_other_scores
from snm_jax.losses.ranking import masked_top_k, phi_terms
from snm_jax.losses.s2m import avg_top_k, s2m_loss
from snm_jax.losses.snm import snm_loss
from snm_jax.losses.softmax import (
    mined_softmax,
    nce_loss,
    negative_sampling_loss,
    sampled_softmax,
    softmax_cross_entropy,
)
from snm_jax.losses.surrogates import (
    PHIS,
    exponential,
    get_phi,
    hinge,
    logistic,
    ramp,
    squared_hinge,
)
from snm_jax.losses.vartheta import (
    expected_owl_theta,
    negative_sampling_vartheta,
    power_law_vartheta,
    split_vartheta,
    top_k_vartheta,
    validate_vartheta,
)

__all__ = [
    "PHIS", "avg_top_k", "bowl", "cosine_contrastive_loss", "expected_owl_theta",
    "exponential", "get_phi", "hinge", "logistic",
    "masked_top_k", "mined_softmax", "nce_loss", "negative_sampling_loss",
    "negative_sampling_vartheta", "owl_loss",
    "phi_terms", "power_law_vartheta", "powl", "ramp", "s2m_loss",
    "sampled_softmax", "snm_loss", "softmax_cross_entropy",
    "sorted_other_scores", "split_vartheta", "squared_hinge",
    "top_k_vartheta", "validate_vartheta",
]
