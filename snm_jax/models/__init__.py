"""Query towers (Flax). The class table lives in the train state, not here."""
from snm_jax.models.towers import (EmbeddingBag, EmbeddingTower, LinearQuery, MLPTower, SNMTower, WideDeepQuery,
                                l2_normalize, tower_inputs)

__all__ = ["EmbeddingBag", "EmbeddingTower", "LinearQuery", "MLPTower", "SNMTower", "WideDeepQuery", "l2_normalize",
           "tower_inputs"]
