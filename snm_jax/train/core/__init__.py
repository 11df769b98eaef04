"""The jitted pieces every run is built from: the train step, row-wise table optimisers, the
input table, evaluation, sampler diagnostics, the `Task` interface, post-hoc logit adjustment."""
