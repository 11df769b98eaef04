#!/usr/bin/env bash
# Runs one training process on every worker of a Cloud TPU VM pod slice.
#
#   launch/tpu_pod.sh [--dry-run] [--setup] [--tpu NAME] [--zone ZONE] [--project P]
#       [-- MODULE [ARGS...]]
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b launch/tpu_pod.sh -- experiments.train \
#       --config=experiments/configs/default.py --config.mesh.shape='(-1,4)' \
#       --workdir=/mnt/shared/snm_run1
#
# Training data larger than one host: convert it once into ArrayRecord shards in a bucket
# (python -m experiments.convert --out=gs://BUCKET/DATA) and add
#   --config.dataset.format=sharded --config.dataset.shards=gs://BUCKET/DATA
# every worker then reads only its slice of each batch (docs/data-at-scale.md). A worker sent
# SIGTERM (a maintenance event) checkpoints at a step all workers agree on and exits 75; rerun the
# same command to resume.
#
# Every worker runs, from REPO_DIR, `$PYTHON -m MODULE ARGS... $INIT_FLAGS` via
# `gcloud compute tpus tpu-vm ssh --worker=all`. JAX finds the coordinator,
# the process count and this worker's id itself on TPU VMs; INIT_FLAGS makes
# experiments.train call jax.distributed.initialize() unconditionally.
# --setup first clones REPO_URL into REPO_DIR and installs it (with jax[tpu])
# on every worker. The workdir must be a filesystem all workers share (NFS /
# Filestore / gcsfuse mount): every process writes its shards of each orbax
# checkpoint. --dry-run prints the gcloud command lines instead of running them.
set -euo pipefail

# ---- variables (environment overrides) ---------------------------------------
TPU_NAME="${TPU_NAME:-}"                  # the TPU VM (pod slice) name
ZONE="${ZONE:-us-central2-b}"             # its zone
PROJECT="${PROJECT:-}"                    # GCP project ("" = gcloud's default)
REPO_URL="${REPO_URL:-}"                  # git URL of this project (for --setup)
REPO_DIR="${REPO_DIR:-snm-jax}"           # checkout on the workers, relative to their home
PYTHON="${PYTHON:-.venv/bin/python}"      # interpreter on the workers, relative to REPO_DIR
INIT_FLAGS="${INIT_FLAGS:---config.distributed.initialize=yes}"
DEFAULT_MODULE="experiments.train"
DEFAULT_ARGS=(--config=experiments/configs/default.py --workdir=/mnt/shared/snm_jax_run)
GCLOUD="${GCLOUD:-gcloud}"

die() { echo "tpu_pod.sh: $*" >&2; exit 2; }
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

DRY_RUN=0
SETUP=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --setup) SETUP=1; shift ;;
    --tpu) [[ $# -ge 2 ]] || die "$1 needs a value"; TPU_NAME="$2"; shift 2 ;;
    --tpu=*) TPU_NAME="${1#*=}"; shift ;;
    --zone) [[ $# -ge 2 ]] || die "$1 needs a value"; ZONE="$2"; shift 2 ;;
    --zone=*) ZONE="${1#*=}"; shift ;;
    --project) [[ $# -ge 2 ]] || die "$1 needs a value"; PROJECT="$2"; shift 2 ;;
    --project=*) PROJECT="${1#*=}"; shift ;;
    -h|--help) usage ;;
    --) shift; break ;;
    *) die "unknown option '$1' (the command goes after '--')" ;;
  esac
done
[[ -n "$TPU_NAME" ]] || die "no TPU name: set TPU_NAME or pass --tpu NAME"
[[ -n "$ZONE" ]] || die "no zone: set ZONE or pass --zone ZONE"
(( SETUP )) && [[ -z "$REPO_URL" ]] && die "--setup needs REPO_URL (the git URL to clone)"

[[ "${1:-}" == "-m" ]] && shift
if [[ $# -ge 1 ]]; then
  MODULE="$1"; shift; ARGS=("$@")
else
  MODULE="$DEFAULT_MODULE"; ARGS=("${DEFAULT_ARGS[@]}")
fi
[[ "$MODULE" =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || die "'$MODULE' is not a Python module name"

# The remote commands; every word is quoted for the workers' shell.
q() { printf '%q' "$1"; }
read -r -a INIT_WORDS <<< "$INIT_FLAGS"
REMOTE_CMD="cd $(q "$REPO_DIR") && $(q "$PYTHON") -m $MODULE"
for a in "${ARGS[@]+"${ARGS[@]}"}" "${INIT_WORDS[@]+"${INIT_WORDS[@]}"}"; do
  REMOTE_CMD+=" $(printf '%q' "$a")"
done

GCLOUD_COMMON=(--zone="$ZONE" --worker=all)
[[ -n "$PROJECT" ]] && GCLOUD_COMMON+=(--project="$PROJECT")

COMMANDS=()
if (( SETUP )); then
  SETUP_CMD="(test -d $(q "$REPO_DIR") || git clone $(q "$REPO_URL") $(q "$REPO_DIR"))"
  SETUP_CMD+=" && cd $(q "$REPO_DIR") && python3 -m venv .venv"
  SETUP_CMD+=" && .venv/bin/pip install --quiet -e . 'jax[tpu]'"
  COMMANDS+=("$(printf '%q ' "$GCLOUD" compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_COMMON[@]}" \
    --command="$SETUP_CMD")")
fi
COMMANDS+=("$(printf '%q ' "$GCLOUD" compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_COMMON[@]}" \
  --command="$REMOTE_CMD")")

for cmd in "${COMMANDS[@]}"; do
  if (( DRY_RUN )); then
    echo "${cmd% }"
  else
    echo "tpu_pod.sh: $cmd" >&2
    eval "$cmd"
  fi
done
