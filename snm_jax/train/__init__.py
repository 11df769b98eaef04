"""Training, in five layers (each imports only the ones above it):

  runtime/  the run's files and host (workdir paths, writers, logging, distributed start-up)
  core/     the jitted step, table optimisers, evaluation, diagnostics, the Task interface
  config/   overrides, validation of every field, construction of a run's objects
  trainer/  the loop, the classification and retrieval tasks, data of a run, checkpoints
  recipes/  recipes chosen on validation, ensembles, several runs into sub-workdirs
"""
