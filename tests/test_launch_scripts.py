"""launch/: argument handling and the exact command lines of the three launchers
(their --dry-run output, parsed back with a POSIX shell lexer), and the local
launcher's process management on tiny jax-free Python modules."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.configs import default
from snm_jax.train.runtime import distributed

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "launch" / "local_multiprocess.sh"
TPU = REPO / "launch" / "tpu_pod.sh"
SLURM = REPO / "launch" / "slurm.sbatch"
JAX_ENV = ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
           "JAX_PROCESS_ID")


def run(script, *args, env=None, cwd=REPO, timeout=60):
  full_env = {k: v for k, v in os.environ.items()
              if k not in ("TPU_NAME", "REPO_URL", "PROJECT", "CONFIG", "WORKDIR", "PYTHON")}
  full_env.update(env or {})
  return subprocess.run(["bash", str(script), *map(str, args)], cwd=cwd, env=full_env,
                        capture_output=True, text=True, timeout=timeout)


def split_env(words):
  """Leading KEY=VALUE words -> (dict, rest)."""
  env = {}
  while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
    k, v = words.pop(0).split("=", 1)
    env[k] = v
  return env, words


@pytest.mark.parametrize("script", [LOCAL, TPU, SLURM], ids=lambda p: p.name)
def test_scripts_are_valid_executable_bash(script):
  assert os.access(script, os.X_OK)
  assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


# ---------------------------------------------------------------------------
# local_multiprocess.sh
# ---------------------------------------------------------------------------

def test_local_dry_run_command_lines():
  args = ["--config=experiments/configs/default.py:paper,runlocal", "--config.mesh.shape=(2, 2)",
          "--workdir=/tmp/a dir"]
  out = run(LOCAL, 3, "--devices-per-process", 2, "--port=4567", "--log-dir", "/tmp/logs",
            "--dry-run", "--", "-m", "experiments.train", *args,
            env={"PYTHON": "/opt/py", "XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"})
  assert out.returncode == 0, out.stderr
  lines = out.stdout.strip().splitlines()
  assert len(lines) == 3
  for i, line in enumerate(lines):
    env, rest = split_env(shlex.split(line))
    assert env == {"JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2",
                   "JAX_COORDINATOR_ADDRESS": "127.0.0.1:4567", "JAX_NUM_PROCESSES": "3",
                   "JAX_PROCESS_ID": str(i)}
    assert rest == ["/opt/py", "-m", "experiments.train", *args, ">", f"/tmp/logs/process_{i}.log", "2>&1"]


def test_local_environment_is_what_distributed_py_reads(monkeypatch):
  """The launcher's variables make maybe_initialize pass exactly coordinator, count and id."""
  out = run(LOCAL, 2, "--port", 999, "--dry-run", "--", "experiments.train")
  env, _ = split_env(shlex.split(out.stdout.splitlines()[1]))
  for k in ("SLURM_NTASKS", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(k, raising=False)
  for k in JAX_ENV[2:]:
    monkeypatch.setenv(k, env[k])
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(distributed.logging, "info", lambda *a, **k: None)
  dist = default.get_config("runlocal").distributed
  assert distributed.wants_distributed(dist)
  distributed.maybe_initialize(dist)
  assert calls == [{"coordinator_address": "127.0.0.1:999", "num_processes": 2, "process_id": 1}]


@pytest.mark.parametrize("args,message", [
    ([], "Runs N JAX processes"),
    (["0", "--", "m"], "N must be a positive integer"),
    (["two", "--", "m"], "N must be a positive integer"),
    (["2", "--bogus", "--", "m"], "unknown option '--bogus'"),
    (["2", "experiments.train"], "unknown option 'experiments.train'"),
    (["2", "--"], "missing '-- MODULE"),
    (["2", "--devices-per-process", "0", "--", "m"], "--devices-per-process must be >= 1"),
    (["2", "--devices-per-process"], "needs a value"),
    (["2", "--port", "70000", "--", "m"], "--port must be in 1..65535"),
    (["2", "--timeout", "1.5", "--", "m"], "--timeout must be a whole number"),
    (["2", "--", "experiments/train.py"], "is not a Python module name"),
])
def test_local_rejects_bad_arguments(args, message):
  out = run(LOCAL, *args[:1], *(["--dry-run"] if args else []), *args[1:])
  assert out.returncode == 2
  assert message in out.stderr
  assert out.stdout == ""


ENV_DUMP = """
import json, os, sys
keys = {keys!r}
print(json.dumps({{"env": {{k: os.environ.get(k) for k in keys}}, "argv": sys.argv[1:]}}))
"""

FAILER = """
import os, pathlib, sys, time
i = os.environ["JAX_PROCESS_ID"]
pathlib.Path(f"pid_{i}").write_text(str(os.getpid()))
if i == "1":
  time.sleep(0.5)
  sys.exit(3)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_local_runs_all_processes_with_their_environment(tmp_path):
  (tmp_path / "envdump.py").write_text(ENV_DUMP.format(keys=JAX_ENV))
  logs = tmp_path / "logs"
  out = run(LOCAL, 3, "--devices-per-process", 4, "--log-dir", logs, "--", "envdump", "a b", "--x=1",
            env={"PYTHON": sys.executable}, cwd=tmp_path)
  assert out.returncode == 0, out.stderr
  ports = set()
  for i in range(3):
    rec = json.loads((logs / f"process_{i}.log").read_text())
    assert rec["argv"] == ["a b", "--x=1"]
    env = rec["env"]
    assert env["JAX_PROCESS_ID"] == str(i) and env["JAX_NUM_PROCESSES"] == "3"
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"].split().count("--xla_force_host_platform_device_count=4") == 1
    assert "device_count=8" not in env["XLA_FLAGS"]  # the test process's own flag is replaced
    host, port = env["JAX_COORDINATOR_ADDRESS"].split(":")
    assert host == "127.0.0.1" and 1 <= int(port) <= 65535
    ports.add(port)
  assert len(ports) == 1


def test_local_failure_kills_the_others_and_propagates_the_status(tmp_path):
  (tmp_path / "failer.py").write_text(FAILER)
  t0 = time.monotonic()
  out = run(LOCAL, 2, "--log-dir", tmp_path / "logs", "--", "failer", env={"PYTHON": sys.executable},
            cwd=tmp_path)
  assert out.returncode == 3
  assert time.monotonic() - t0 < 30  # did not wait for process 0's 120 s sleep
  assert "process 1" in out.stderr and "failed with status 3" in out.stderr
  survivor = int((tmp_path / "pid_0").read_text())
  assert not _alive(survivor)


PREEMPTED = """import os, pathlib, signal, sys, time
i = os.environ["JAX_PROCESS_ID"]
pathlib.Path("pid_" + i).write_text(str(os.getpid()))
def on_term(*_):  # as experiments.train: checkpoint (here: a marker, after a while), then exit 75
  time.sleep(1.0)
  pathlib.Path("saved_" + i).write_text("1")
  sys.exit(75)
signal.signal(signal.SIGTERM, on_term)
time.sleep(60)
"""


def test_local_passes_sigterm_on_and_waits_for_every_preempted_process(tmp_path):
  (tmp_path / "preempted.py").write_text(PREEMPTED)
  env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
  proc = subprocess.Popen(["bash", str(LOCAL), "2", "--log-dir", str(tmp_path / "logs"), "--", "preempted"],
                          cwd=tmp_path, env={**env, "PYTHON": sys.executable}, stderr=subprocess.PIPE,
                          text=True)
  deadline = time.monotonic() + 30
  while not all((tmp_path / f"pid_{i}").exists() for i in range(2)) and time.monotonic() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=30)
  assert proc.returncode == 75, err
  assert all((tmp_path / f"saved_{i}").exists() for i in range(2))  # both finished their "checkpoint"
  assert "preempted; run the same command again" in err


def test_local_timeout_stops_everything(tmp_path):
  (tmp_path / "sleeper.py").write_text(
      "import os, pathlib, time\npathlib.Path('pid_' + os.environ['JAX_PROCESS_ID'])"
      ".write_text(str(os.getpid()))\ntime.sleep(120)\n")
  out = run(LOCAL, 2, "--timeout", 2, "--log-dir", tmp_path / "logs", "--", "sleeper",
            env={"PYTHON": sys.executable}, cwd=tmp_path)
  assert out.returncode == 124 and "timeout" in out.stderr
  for i in range(2):
    assert not _alive(int((tmp_path / f"pid_{i}").read_text()))


# ---------------------------------------------------------------------------
# tpu_pod.sh
# ---------------------------------------------------------------------------

def _gcloud_argv(line):
  argv = shlex.split(line)
  assert argv[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
  command = [a for a in argv if a.startswith("--command=")]
  assert len(command) == 1
  return argv, shlex.split(command[0][len("--command="):])


def test_tpu_dry_run_builds_the_worker_all_ssh_line():
  args = ["--config=experiments/configs/default.py", "--config.mesh.shape=(-1, 4)",
          "--workdir=/mnt/shared/run 1"]
  out = run(TPU, "--dry-run", "--zone", "europe-west4-a", "--", "experiments.train", *args,
            env={"TPU_NAME": "my-pod", "PROJECT": "proj-1"})
  assert out.returncode == 0, out.stderr
  lines = out.stdout.strip().splitlines()
  assert len(lines) == 1
  argv, remote = _gcloud_argv(lines[0])
  assert argv[5] == "my-pod"
  assert {"--zone=europe-west4-a", "--worker=all", "--project=proj-1"} <= set(argv)
  assert remote == ["cd", "snm-jax", "&&", ".venv/bin/python", "-m", "experiments.train", *args,
                    "--config.distributed.initialize=yes"]


def test_tpu_defaults_and_setup_line():
  out = run(TPU, "--tpu=p2", "--setup", "--dry-run",
            env={"REPO_URL": "https://example.org/snm-jax.git", "REPO_DIR": "code/snm"})
  assert out.returncode == 0, out.stderr
  setup, train = out.stdout.strip().splitlines()
  argv, remote = _gcloud_argv(setup)
  assert "--project" not in " ".join(argv)  # empty PROJECT -> gcloud's default
  assert "git clone https://example.org/snm-jax.git code/snm" in " ".join(remote)
  assert "jax[tpu]" in remote
  _, remote = _gcloud_argv(train)
  assert remote[:6] == ["cd", "code/snm", "&&", ".venv/bin/python", "-m", "experiments.train"]
  assert remote[6].startswith("--config=") and remote[-1] == "--config.distributed.initialize=yes"


@pytest.mark.parametrize("args,env,message", [
    (["--", "experiments.train"], {}, "no TPU name"),
    (["--setup"], {"TPU_NAME": "p"}, "--setup needs REPO_URL"),
    (["--frobnicate"], {"TPU_NAME": "p"}, "unknown option"),
    (["--", "a/b.py"], {"TPU_NAME": "p"}, "is not a Python module name"),
])
def test_tpu_rejects_bad_arguments(args, env, message):
  out = run(TPU, "--dry-run", *args, env=env)
  assert out.returncode == 2 and message in out.stderr and out.stdout == ""


# ---------------------------------------------------------------------------
# slurm.sbatch
# ---------------------------------------------------------------------------

def test_sbatch_directives_precede_every_command():
  lines = SLURM.read_text().splitlines()
  assert lines[0].startswith("#!")
  first_command = next(i for i, l in enumerate(lines) if l.strip() and not l.startswith("#"))
  directives = [l for l in lines if l.startswith("#SBATCH")]
  assert all(lines.index(d) < first_command for d in directives)
  opts = dict(d.split()[1].lstrip("-").split("=", 1) for d in directives)
  assert opts["ntasks-per-node"] == "1" and int(opts["nodes"]) >= 2
  assert re.fullmatch(r"\d+:\d\d:\d\d", opts["time"])


def test_sbatch_dry_run_builds_the_srun_line(tmp_path):
  out = run(SLURM, "--dry-run", "--config.mesh.shape=(-1, 8)", "--config.train.num_steps=10",
            env={"CONFIG": "experiments/configs/default.py:runlocal", "WORKDIR": "/shared/run 1",
                 "REPO_DIR": str(tmp_path), "SLURM_JOB_ID": "42"})
  assert out.returncode == 0, out.stderr
  cd, srun = out.stdout.strip().splitlines()
  assert shlex.split(cd) == ["cd", str(tmp_path)]
  assert shlex.split(srun) == [
      "srun", "--kill-on-bad-exit=1", "--cpu-bind=none", f"{tmp_path}/.venv/bin/python", "-m",
      "experiments.train", "--config=experiments/configs/default.py:runlocal",
      "--workdir=/shared/run 1", "--config.mesh.shape=(-1, 8)", "--config.train.num_steps=10"]


def test_sbatch_default_workdir_uses_the_job_id(tmp_path):
  out = run(SLURM, "--dry-run", env={"SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(tmp_path)})
  assert out.returncode == 0, out.stderr
  argv = shlex.split(out.stdout.strip().splitlines()[1])
  assert f"--workdir={tmp_path}/runs/snm_jax_77" in argv
  assert "--config=experiments/configs/default.py" in argv


def test_slurm_environment_triggers_distributed_initialize(monkeypatch):
  for k in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(k, raising=False)
  dist = default.get_config("runlocal").distributed
  monkeypatch.setenv("SLURM_NTASKS", "1")
  assert not distributed.wants_distributed(dist)
  monkeypatch.setenv("SLURM_NTASKS", "16")
  assert distributed.wants_distributed(dist)
