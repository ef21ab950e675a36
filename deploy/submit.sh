#!/usr/bin/env bash
# Submit a training run to a running Ray cluster as a Ray job; the job runs workers.cli.
#
#   deploy/submit.sh CONFIG.yaml [key=value ...] [--resume latest|PATH]
#   deploy/submit.sh examples/seed_config.yaml output_dir=/shared/runs/seed --resume latest
#
# Environment:
#   RAY_ADDRESS    the cluster's dashboard URL (default http://127.0.0.1:8265, e.g. through
#                  `ray dashboard deploy/ray-cluster.yaml` or a kubectl port-forward)
#   RAY_JOB_ARGS   extra `ray job submit` flags, e.g. "--no-wait --submission-id seed-1"
#   PYTHON         the python that runs the CLI on the cluster (default: python)
#   DRY_RUN=1      print the command instead of running it
# It submits this repo (deploy/runtime_env.yaml's excludes apply) and the job runs from a copy
# of it, so CONFIG is a path relative to the repo root. Use an absolute output_dir on storage
# every node sees: the job's current folder is temporary.
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 2
fi
cd "$(dirname "$0")/.."
export RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
read -r -a job_args <<< "${RAY_JOB_ARGS:-}"
cmd=(ray job submit --address "$RAY_ADDRESS" --runtime-env deploy/runtime_env.yaml
     --working-dir . "${job_args[@]}" -- "${PYTHON:-python}" -m workers.cli "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
