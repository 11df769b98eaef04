"""Test set-up: 8 forced CPU devices, set before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data_dir():
  """The bundled real datasets (../shared/data); skips the test if absent."""
  if not SHARED_DATA.is_dir():
    pytest.skip(f"real datasets not found at {SHARED_DATA} (../shared/data missing)")
  return SHARED_DATA
