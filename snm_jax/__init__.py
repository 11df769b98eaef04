"""snm-jax: learning with very large output spaces in JAX.

Sub-packages, lowest layer first (docs/ARCHITECTURE.md): `losses` (the one loss
layer: the trained sampled losses and their registry, exact OWL references,
S2M, distributed top-k), `metrics`, `models`, `adversarial` (the tree sampler),
`data`, `auprc` (SOPRC), `mining` (negative samplers, their layout on the mesh
and sharded retrieval), `train` (tasks, step, sparse table optimisers, the one
loop), plus `sharding` and `errors`.
"""

__version__ = "0.1.0"
