"""Recipes (settings derived from the data, candidates chosen on validation), ensembles of
finished runs, and running several configs into sub-workdirs, reusing finished ones."""
