#!/usr/bin/env bash
# Runs N JAX processes on this machine over loopback, each with D forced CPU
# devices: a multi-host run without a cluster (how the tests prove multi-host
# correctness).
#
#   launch/local_multiprocess.sh N [--devices-per-process D] [--port P]
#       [--log-dir DIR] [--timeout SECONDS] [--dry-run] -- MODULE [ARGS...]
#
#   launch/local_multiprocess.sh 2 --devices-per-process 2 -- experiments.train \
#       --config=experiments/configs/default.py:paper,runlocal --config.mesh.shape='(2,2)' \
#       --workdir=/tmp/snm_mp
#
# Process i runs `$PYTHON -m MODULE ARGS...` with
#   JAX_PLATFORMS=cpu, XLA_FLAGS=... --xla_force_host_platform_device_count=D,
#   JAX_COORDINATOR_ADDRESS=127.0.0.1:P, JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=i
# (read by snm_jax/train/runtime/distributed.py), and logs to DIR/process_i.log.
# The script waits for all processes; as soon as one fails it kills the others
# and exits with that process's status (124 on --timeout). A process that exits
# 75 (preempted: it checkpointed) does not stop the others; SIGTERM to the script
# is passed on to every process; the script then exits 75 once all have ended.
# A leading `-m` after `--` is accepted and ignored.
#
# Environment: PYTHON (default: python3).
set -euo pipefail

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

die() { echo "local_multiprocess.sh: $*" >&2; exit 2; }

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

[[ $# -ge 1 ]] || usage
[[ "$1" == "-h" || "$1" == "--help" ]] && usage
NUM_PROCESSES="$1"; shift
is_uint "$NUM_PROCESSES" && (( NUM_PROCESSES >= 1 )) \
  || die "N must be a positive integer, got '$NUM_PROCESSES'"

DEVICES=1
PORT=""
LOG_DIR=""
TIMEOUT=0
DRY_RUN=0
PYTHON="${PYTHON:-python3}"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --devices-per-process) [[ $# -ge 2 ]] || die "$1 needs a value"; DEVICES="$2"; shift 2 ;;
    --devices-per-process=*) DEVICES="${1#*=}"; shift ;;
    --port) [[ $# -ge 2 ]] || die "$1 needs a value"; PORT="$2"; shift 2 ;;
    --port=*) PORT="${1#*=}"; shift ;;
    --log-dir) [[ $# -ge 2 ]] || die "$1 needs a value"; LOG_DIR="$2"; shift 2 ;;
    --log-dir=*) LOG_DIR="${1#*=}"; shift ;;
    --timeout) [[ $# -ge 2 ]] || die "$1 needs a value"; TIMEOUT="$2"; shift 2 ;;
    --timeout=*) TIMEOUT="${1#*=}"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage ;;
    --) shift; break ;;
    *) die "unknown option '$1' (the command goes after '--')" ;;
  esac
done

[[ "${1:-}" == "-m" ]] && shift
[[ $# -ge 1 ]] || die "missing '-- MODULE [ARGS...]'"
MODULE="$1"; shift
[[ "$MODULE" =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || die "'$MODULE' is not a Python module name"

is_uint "$DEVICES" && (( DEVICES >= 1 )) || die "--devices-per-process must be >= 1, got '$DEVICES'"
is_uint "$TIMEOUT" || die "--timeout must be a whole number of seconds, got '$TIMEOUT'"
if [[ -z "$PORT" ]]; then
  if (( DRY_RUN )); then
    PORT=12355
  else
    PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  fi
fi
is_uint "$PORT" && (( PORT >= 1 && PORT <= 65535 )) || die "--port must be in 1..65535, got '$PORT'"
if [[ -z "$LOG_DIR" ]]; then
  LOG_DIR="$( (( DRY_RUN )) && echo "\${TMPDIR:-/tmp}/snm_jax_mp.XXXXXX" || mktemp -d -t snm_jax_mp.XXXXXX)"
fi

# Any inherited device-count flag (e.g. a test process forcing 8) is replaced.
BASE_XLA_FLAGS="$(sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g; s/  +/ /g; s/^ //; s/ $//' \
  <<< "${XLA_FLAGS:-}")"
PROC_XLA_FLAGS="${BASE_XLA_FLAGS:+$BASE_XLA_FLAGS }--xla_force_host_platform_device_count=$DEVICES"

env_of() {  # env_of I -> the KEY=VALUE words of process I
  printf '%s\n' "JAX_PLATFORMS=cpu" "XLA_FLAGS=$PROC_XLA_FLAGS" \
    "JAX_COORDINATOR_ADDRESS=127.0.0.1:$PORT" "JAX_NUM_PROCESSES=$NUM_PROCESSES" \
    "JAX_PROCESS_ID=$1"
}

if (( DRY_RUN )); then
  for ((i = 0; i < NUM_PROCESSES; i++)); do
    line=""
    while IFS= read -r kv; do line+="$(printf '%q' "$kv") "; done < <(env_of "$i")
    line+="$(printf '%q ' "$PYTHON" -m "$MODULE" "$@")"
    echo "${line}> $LOG_DIR/process_$i.log 2>&1"
  done
  exit 0
fi

mkdir -p "$LOG_DIR"
PIDS=()

kill_all() {  # TERM, then KILL after a grace period; only our own children, by pid.
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 50); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    (( alive )) || break
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap 'kill_all; exit 130' INT
# A preemption notice (SIGTERM) is passed on to every process, which checkpoints and exits 75.
trap 'for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done' TERM
PREEMPTED=0

echo "local_multiprocess.sh: $NUM_PROCESSES processes x $DEVICES CPU devices, coordinator" \
  "127.0.0.1:$PORT, logs in $LOG_DIR" >&2
for ((i = 0; i < NUM_PROCESSES; i++)); do
  mapfile -t ENV_I < <(env_of "$i")
  env "${ENV_I[@]}" "$PYTHON" -m "$MODULE" "$@" > "$LOG_DIR/process_$i.log" 2>&1 &
  PIDS+=("$!")
done

START=$SECONDS
REMAINING=("${PIDS[@]}")
while (( ${#REMAINING[@]} )); do
  STILL=()
  for idx in "${!PIDS[@]}"; do
    pid="${PIDS[$idx]}"
    [[ " ${REMAINING[*]} " == *" $pid "* ]] || continue
    if kill -0 "$pid" 2>/dev/null; then
      STILL+=("$pid")
      continue
    fi
    rc=0; wait "$pid" || rc=$?
    if (( rc == 75 )); then  # preempted after its checkpoint: the others are finishing theirs
      echo "local_multiprocess.sh: process $idx (pid $pid) was preempted (status 75)" >&2
      PREEMPTED=1
    elif (( rc != 0 )); then
      echo "local_multiprocess.sh: process $idx (pid $pid) failed with status $rc;" \
        "stopping the others. Last lines of $LOG_DIR/process_$idx.log:" >&2
      tail -n 30 "$LOG_DIR/process_$idx.log" >&2 || true
      kill_all
      exit "$rc"
    fi
  done
  REMAINING=("${STILL[@]+"${STILL[@]}"}")
  if (( TIMEOUT > 0 && SECONDS - START >= TIMEOUT && ${#REMAINING[@]} )); then
    echo "local_multiprocess.sh: timeout after ${TIMEOUT}s; stopping all processes" >&2
    kill_all
    exit 124
  fi
  (( ${#REMAINING[@]} )) && sleep 0.2
done
if (( PREEMPTED )); then
  echo "local_multiprocess.sh: preempted; run the same command again to resume" >&2
  exit 75
fi
echo "local_multiprocess.sh: all $NUM_PROCESSES processes finished successfully" >&2
