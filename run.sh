#!/usr/bin/env bash
# The main job: train the sample (sample_code/distributed_gradient_accumulation/train.py) with gradient
# accumulation on N worker processes (default 8), then print where the logs are and a per-rank summary.
#
#   bash run.sh            # 8 workers
#   bash run.sh 2          # 2 workers
#   bash run.sh 1 --epochs 2   # arguments after N go to train.py
#
# Environment: DATA_PATH (MNIST in idx format; default: built-in digits), DEVICE_TARGET (CPU|GPU|Ascend,
# default CPU), LAUNCHER (mpirun|msrun, default: mpirun when installed and working, else msrun),
# RUN_TIMEOUT (seconds for the whole job, default 1800), LOG_DIR (default log_output).
set -euo pipefail
cd "$(dirname "$0")"

workers="${1:-8}"
[ $# -gt 0 ] && shift
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
  echo "run.sh: the number of workers must be a positive integer, but got '$workers'. Usage: bash run.sh [N] [train.py args...]" >&2
  exit 2
fi
device_target="${DEVICE_TARGET:-CPU}"
run_timeout="${RUN_TIMEOUT:-1800}"
log_dir="${LOG_DIR:-log_output}"
script="sample_code/distributed_gradient_accumulation/train.py"
python="${PYTHON:-python3}"

# 1. Set up what the job needs (a fresh machine has only python3 and pip).
if ! (cd / && "$python" -c "import ms_gradaccum, mindspore, sklearn") >/dev/null 2>&1; then
  echo "run.sh: installing ms_gradaccum with the sample's dependencies (mindspore, scikit-learn)..."
  "$python" -m pip install -q -e ".[sample]"
fi
# Write the built-in dataset once, before the ranks start, so they do not all build it at the same time.
if [ -z "${DATA_PATH:-}" ]; then
  DATA_PATH="$("$python" -c "import sys; sys.path.insert(0, 'sample_code/distributed_gradient_accumulation'); \
from builtin_digits import ensure_digits_mnist; print(ensure_digits_mnist())")"
fi
export DATA_PATH
export GLOG_v="${GLOG_v:-3}"            # MindSpore: errors only, keeps the per-rank logs readable
export MS_NODE_TIMEOUT="${MS_NODE_TIMEOUT:-10}"   # a dead rank is noticed in seconds, not minutes

free_port() { "$python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

mpirun_works() {
  command -v mpirun >/dev/null 2>&1 || return 1
  timeout 20 mpirun --allow-run-as-root --oversubscribe -n 2 true >/dev/null 2>&1
}

launcher="${LAUNCHER:-}"
if [ -z "$launcher" ]; then
  if mpirun_works; then launcher=mpirun; else launcher=msrun; fi
fi
rm -rf "$log_dir"
mkdir -p "$log_dir"
port="$(free_port)"
echo "run.sh: $workers worker(s) on $device_target with $launcher, logs in $log_dir/, timeout ${run_timeout}s"

status=0
case "$launcher" in
  msrun)
    timeout --kill-after=10 "$run_timeout" msrun --worker_num="$workers" --local_worker_num="$workers" \
      --master_addr=127.0.0.1 --master_port="$port" --log_dir="$log_dir" --join=True --cluster_time_out=60 \
      "$script" --device-target "$device_target" "$@" >"$log_dir/msrun.log" 2>&1 || status=$?
    rank_log() { echo "$log_dir/worker_$1.log"; }
    ;;
  mpirun)
    # MindSpore's collectives on CPU do not come up under plain mpirun: each rank joins MindSpore's own
    # dynamic cluster instead, through the variables below, with one extra scheduler process.
    export MS_WORKER_NUM="$workers" MS_SCHED_HOST=127.0.0.1 MS_SCHED_PORT="$port"
    MS_ROLE=MS_SCHED "$python" "$script" --device-target "$device_target" "$@" >"$log_dir/scheduler.log" 2>&1 &
    scheduler=$!
    timeout --kill-after=10 "$run_timeout" mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$workers" \
      --output-filename "$log_dir" --merge-stderr-to-stdout \
      -x MS_WORKER_NUM -x MS_SCHED_HOST -x MS_SCHED_PORT -x DATA_PATH -x GLOG_v -x MS_NODE_TIMEOUT \
      bash -c 'export MS_ROLE=MS_WORKER MS_NODE_ID="$OMPI_COMM_WORLD_RANK" RANK_ID="$OMPI_COMM_WORLD_RANK"; exec "$0" "$@"' \
      "$python" "$script" --device-target "$device_target" "$@" >"$log_dir/mpirun.log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then kill "$scheduler" 2>/dev/null || true; fi
    wait "$scheduler" 2>/dev/null || true
    rank_log() { echo "$log_dir/1/rank.$1/stdout"; }
    ;;
  *)
    echo "run.sh: LAUNCHER must be 'mpirun' or 'msrun', but got '$launcher'." >&2
    exit 2
    ;;
esac

summary_ok=1
for ((rank = 0; rank < workers; rank++)); do
  log="$(rank_log "$rank")"
  if [ ! -f "$log" ] || ! grep -q "final loss" "$log"; then summary_ok=0; fi
done

if [ "$status" -ne 0 ] || [ "$summary_ok" -ne 1 ]; then
  [ "$status" -eq 124 ] && echo "run.sh: the job did not finish within ${run_timeout}s and was stopped." >&2
  echo "run.sh: FAILED ($launcher exit status $status). Logs: $log_dir/" >&2
  # The launcher's and scheduler's own account: msrun's "Worker process N exit with exception. Error code: -9",
  # mpirun's "mpirun noticed that process rank N ... exited on signal 9", the scheduler's timed-out nodes.
  grep -hE "ERROR|noticed that|exited on signal" "$log_dir/$launcher.log" "$log_dir/scheduler.log" 2>/dev/null \
    | sed -E 's/^\[ERROR\] [^ ]+ \[[^]]*\] ?//' | tail -n 6 >&2 || true
  for ((rank = 0; rank < workers; rank++)); do
    log="$(rank_log "$rank")"
    if [ ! -f "$log" ] || ! grep -q "final loss" "$log"; then
      echo "---- rank $rank did not finish; last lines of $log:" >&2
      if [ -f "$log" ]; then tail -n 25 "$log" >&2; else echo "(no log file)" >&2; fi
    fi
  done
  [ "$status" -ne 0 ] && exit "$status"
  exit 1
fi

echo "run.sh: done. Per-rank logs: $(rank_log 0) ... $(rank_log $((workers - 1)))"
for ((rank = 0; rank < workers; rank++)); do
  grep -h "final loss" "$(rank_log "$rank")" | tail -n 1
done
