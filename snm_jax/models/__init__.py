"""Query towers (Flax). The class table lives in the train state, not here."""
from snm_jax.models.towers import EmbeddingBag, EmbeddingTower, LinearQuery, SNMTower, WideDeepQuery, l2_normalize

__all__ = ["EmbeddingBag", "EmbeddingTower", "LinearQuery", "SNMTower", "WideDeepQuery", "l2_normalize"]
