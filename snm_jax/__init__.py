"""snm-jax: learning with very large output spaces in JAX.

Sub-packages: `losses` (the one loss layer: the trained sampled losses and their
registry, exact OWL references, SNM/S2M, softmax family, distributed top-k),
`auprc` (SOPRC), `metrics`, `data`, `models`, `mining` (negative samplers and
sharded retrieval), `adversarial` (tree sampler), `train` (step, sparse table
optimisers, loop), `sharding`, `errors`.
"""

__version__ = "0.1.0"
