"""Test set-up: 8 forced CPU devices, set before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
