"""The run's files and host: workdir paths (local or remote), host transfers and cadence,
metric writers, figures, the run's progress record, console logging, `jax.distributed` start-up."""
