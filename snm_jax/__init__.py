"""snm-jax: learning with very large output spaces in JAX.

Sub-packages: `losses` (OWL/SNM/S2M/softmax family/SOPRC), `metrics`, `data`,
`models`, `mining` (negative samplers and top-k mining), `adversarial` (tree
sampler), `train` (step, sparse table optimisers, loop), `sharding`.
"""

__version__ = "0.1.0"
