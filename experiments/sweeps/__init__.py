"""Sweeps for `experiments.ablate`: one module per sweep, each defining
`get_sweep() -> spec.Sweep`; `spec` holds the types and loaders."""

from experiments.sweeps.spec import Point, Sweep, apply_overrides, load_config, load_sweep

__all__ = ["Point", "Sweep", "apply_overrides", "load_config", "load_sweep"]
