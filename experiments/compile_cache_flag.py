"""The `--compilation_cache` flag of experiments.train, experiments.demo and experiments.ablate (one
definition, so the apps can be imported together): JAX's persistent compilation cache
(snm_jax/train/runtime/compile_cache.py), on by default. ablate's default folder is the sweep's own,
WORKDIR/jax_cache."""

from absl import flags

COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None,
    "Folder of JAX's persistent compilation cache: a rerun of the same shapes loads its compiled "
    "programs instead of compiling. Default: $JAX_COMPILATION_CACHE_DIR, else "
    "~/.cache/snm_jax/jax_compilation_cache (experiments.ablate: WORKDIR/jax_cache); '' = off.")


def enable() -> str:
  """Turns the cache on as the flag says (call first thing in main); returns the folder ('' = off)."""
  # JAX imported here, not at module level: `ablate --print_commands` stays instant.
  from snm_jax.train.runtime import compile_cache  # pylint: disable=g-import-not-at-top
  return compile_cache.enable(COMPILATION_CACHE.value)
