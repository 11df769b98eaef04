"""Test set-up: 8 forced CPU devices, set before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One BLAS thread per process: `make test` runs 2 workers on 2 cores, and OpenBLAS's threads stall
# each other when the other core is busy (Bibtex's 1836 x 1836 PCA in a tree fit: 2.6-13 s of CPU
# with 2 threads against 0.7 s with one, 2026-11-28). Set before numpy loads; subprocesses inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import atexit  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# One persistent XLA compilation cache per test run: many tests (and the runs they start as
# subprocesses) compile the same programs, and a hit skips XLA's compile (`make test` with the
# sweeps paused, 2026-11-26: 10:45 without it, 8:06 with it). The pytest process that gets here
# first makes it; the xdist workers and subprocesses inherit the environment. An entry is looked
# up by the program, compile options, XLA_FLAGS, devices and jax/jaxlib versions, so a hit runs the
# program a fresh compile would have built. JAX writes entries in place and never replaces one: an
# entry left half-written (a run killed mid-write, or read while the other worker writes it) makes
# every later compile of that program warn and recompile, correct but slower. A pytest killed
# before exit leaves the folder in the temp dir.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="snm_jax_tests_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data_dir():
  """The bundled real datasets (../shared/data); skips the test if absent."""
  if not SHARED_DATA.is_dir():
    pytest.skip(f"real datasets not found at {SHARED_DATA} (../shared/data missing)")
  return SHARED_DATA


# The files that take longest (`--durations`, 2 cores), run first: `make test` hands whole files to
# its 2 workers (--dist=loadfile) in collection order, so a long file collected last (alphabetical
# order put test_multihost / test_train_step / test_tree_* at the end) kept one worker busy alone
# for minutes after the other ran out of files. Longest first, the short files fill in at the end
# (per-file seconds of the 2026-11-27 --durations=0 profile at -O0, below).
# Order only: every test still runs, each file's tests in their own order.
SLOW_FIRST = ("test_bf16.py", "test_preemption.py", "test_sharded_data.py", "test_train_step.py",
              "test_configs.py", "test_train_step_quality.py", "test_sparse_input.py",
              "test_fault_injection.py", "test_leaf_order_eval.py", "test_trainer_theorem1.py",
              "test_multihost.py", "test_recipes.py", "test_mined_softmax.py",
              "test_sharded_eval_and_restore.py", "test_exact_sampler.py",
              "test_num_samples_schedule.py", "test_auprc_experiment.py", "test_auprc_estimator.py",
              "test_diagnostics.py", "test_candidate_group.py", "test_reliability.py",
              "test_adversarial_fit.py", "test_snm_loss.py", "test_peers.py", "test_index_shuffle.py",
              "test_dense_features_run.py", "test_config_validation.py", "test_ablate_report.py",
              "test_adversarial_training.py", "test_data_pipeline.py")


# The tests run small programs, so much of their time is XLA:CPU compiling them. Two flags cut it:
# LLVM at -O0, and XLA:CPU's classic elemental emitters instead of its newer MLIR fusion emitters.
# A wide-and-deep train step compiles in 0.22-0.26 s with both against 1.06-1.10 s by default (and
# 0.8 s with -O0 alone; quiet, its run time alike). Seven of the slowest files (`-n 2`, 2026-11-27):
# 274 / 262 s by default, 211 / 207 s at -O0 (interleaved); in a later back-to-back pair 165 s at
# -O0 and 121 s with both. The flags change the last bits of float results, so a test that compares
# bits with a run in a subprocess passes the subprocess the same flags (`SNM_JAX_TEST_XLA_FLAGS`; set
# it, to "" for XLA's defaults, to choose). The timing tests (`-m timing`, run apart by `make test`)
# measure what users run: XLA's defaults.
# LLVM -O0 is set through JAX's `jax_disable_most_optimizations` (JAX_DISABLE_MOST_OPTIMIZATIONS=1,
# the same backend level 0), not XLA_FLAGS, because JAX reads it at each compile: a module of tests
# that run long loops through the library (many steps of a recipe) marks itself
# `pytestmark = pytest.mark.optimized` and its programs compile at XLA's default level
# (`_optimized_module`), or a single test asks for the `optimized` fixture. Measured per file, both
# ways twice (one process, 2026-11-28): it pays in test_configs.py (35.6 / 35.2 s -> 21.4 / 25.5 s:
# the paper-scale smoke's 325k-label table), and cost time in the 13 other step-heavy files tried
# (e.g. test_bf16.py 40.3 / 37.1 -> 61.3 / 60.7 s: their compiles outweigh their steps). In
# test_sharded_data.py it pays for the recipe test only (13.7 s of CPU against 29.3 s at -O0), which
# asks for the fixture; its other tests mostly compile.
# Subprocesses inherit the variable, so their bits match this process's unmarked modules.
# One LLVM module per program (--xla_cpu_parallel_codegen_split_count=1, not 32 parts compiled on
# threads): with two test workers on two cores the parts only contend. XLA's compile seconds over
# the same test files, alternated (2026-11-28): 13.8 / 14.9 -> 12.6 / 11.9 s (test_train_step.py)
# and 23.9 / 18.7 -> 17.2 / 17.0 s (test_leaf_order_eval.py with test_num_samples_schedule.py).
# MLIR location metadata without Python tracebacks (JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0): lowering
# spends less time building it (two heavy files: 47.5 s against 49.7 s, two alternated pairs).
FAST_COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"


def pytest_configure(config):
  timing = (config.option.markexpr or "").strip() == "timing"
  flags = os.environ.setdefault("SNM_JAX_TEST_XLA_FLAGS", "" if timing else FAST_COMPILE_FLAGS)  # set it to choose
  if flags and flags not in os.environ["XLA_FLAGS"]:  # (xdist workers inherit the controller's)
    os.environ["XLA_FLAGS"] += " " + flags
  if not timing and os.environ["SNM_JAX_TEST_XLA_FLAGS"] == FAST_COMPILE_FLAGS:
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
    os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")
  # pytest-xdist (>= 3.2) re-sorts --dist=loadfile's files by their number of tests, most first
  # (--loadscope-reorder, its default), which undid the order above: the 2-test test_multihost
  # and test_preemption ran last, alone on one worker. Keep the collection order.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def _at_default_optimization():
  """Programs compiled at XLA's default optimisation level for the duration (a generator, for the
  two fixtures below); nothing to do when the suite itself runs at the defaults."""
  if not os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS"):
    yield
    return
  import jax  # pylint: disable=g-import-not-at-top
  # The setting is not part of JAX's jit cache key: the executables compiled before (and kept by the
  # library's program caches) are dropped on the way in and out, so no test runs a program
  # compiled at the other level (their last bits may differ).
  jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", True)
    jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _optimized_module(request):
  """Programs compiled at XLA's default optimisation level in a module marked `optimized`."""
  if request.node.get_closest_marker("optimized") is None:
    yield
    return
  yield from _at_default_optimization()


@pytest.fixture
def optimized():
  """One test's programs compiled at XLA's default optimisation level (a test that trains long
  enough in a module that mostly compiles)."""
  yield from _at_default_optimization()


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOW_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: same order within a file
