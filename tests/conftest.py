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


# The modules with the most seconds per test (a 2-core run's `--durations`), slowest first. `make test`
# hands whole modules to its two xdist workers (`--dist=loadfile --no-loadscope-reorder`) in the order
# below: these first, then the rest by number of tests, largest first (xdist's own default order), so
# the run does not end with one worker alone on a 60-second module while the other idles.
HEAVY_MODULES = ("test_fault_injection", "test_bf16", "test_num_samples_schedule", "test_recipes",
                 "test_multihost", "test_trainer_theorem1", "test_sparse_input",
                 "test_sharded_eval_and_restore", "test_dense_features_run", "test_model_selection",
                 "test_adversarial_training", "test_tree_cache", "test_tree_sampler_bench")


def pytest_collection_modifyitems(config, items):
  del config
  count = {}
  for item in items:
    count[item.path.stem] = count.get(item.path.stem, 0) + 1
  rank = {name: i for i, name in enumerate(HEAVY_MODULES)}

  def key(item):
    name = item.path.stem
    return (rank.get(name, len(rank)), -count[name], name)  # stable: a module's own order is kept

  items.sort(key=key)
