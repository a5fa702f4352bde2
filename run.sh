#!/usr/bin/env bash
# The main job: train the sample (sample_code/distributed_gradient_accumulation/train.py) with gradient
# accumulation on N worker processes (default 8), then print where the logs are and a per-rank summary.
#
#   bash run.sh                # 8 workers
#   bash run.sh 2              # 2 workers
#   bash run.sh 1 --epochs 2   # arguments after N go to train.py
#   bash run.sh --check        # the equivalence check instead of training (8 workers): exit 0 on PASS
#   bash run.sh 2 --resume     # continue a stopped job from its newest checkpoint (LOG_DIR/checkpoints)
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=8118 bash run.sh 8   # on each node: 16 workers
#
# Python: the active python3 (or $PYTHON) when it has a MindSpore that ms_gradaccum supports (and scikit-learn for
# the built-in data), with this checkout on PYTHONPATH; nothing is installed into it. Otherwise a private virtual
# environment, $RUN_SH_VENV (default .venv in this checkout, git-ignored), created and filled once.
#
# Environment: DATA_PATH (MNIST in idx format; default: built-in digits), DEVICE_TARGET (CPU|GPU|Ascend,
# default CPU), LAUNCHER (mpirun|msrun|cluster; default: cluster for several nodes, else mpirun when
# installed and working, else msrun), RUN_TIMEOUT (seconds for the whole job, default 1800), LOG_DIR
# (default log_output). Several nodes (names as torchrun's): NNODES (default 1), NODE_RANK (0..NNODES-1),
# MASTER_ADDR (node 0's address, default 127.0.0.1), MASTER_PORT (default: a free local port; required
# with NNODES > 1); N is the number of workers on this node. HOSTFILE: passed to mpirun (--hostfile),
# which then starts all NNODES x N workers from node 0.
# Logs, whichever launcher runs: LOG_DIR/1/rank.<N>/stdout (the layout of the MindSpore tutorial's mpirun).
# Checkpoints: LOG_DIR/checkpoints/rank_<N>/ (every epoch; --save-steps S: every S steps too; --no-save: none).
# A new run clears LOG_DIR; with --resume its checkpoints are kept and training continues from the newest one that
# every rank completed, with the data order and result of a run never stopped.
set -euo pipefail
cd "$(dirname "$0")"

for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    # run.sh's own usage (its header), then the sample's options once, from the Python run.sh would use (nothing is
    # installed for this): not 8 workers each printing them.
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    echo
    echo "Options of sample_code/distributed_gradient_accumulation/train.py (given after N):"
    for candidate in "${PYTHON:-python3}" "${RUN_SH_VENV:-$PWD/.venv}/bin/python"; do
      if PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$candidate" sample_code/distributed_gradient_accumulation/train.py \
           --help 2>/dev/null | sed -n '/^options:/,$p' | sed '1d'; then
        [ "${PIPESTATUS[0]:-1}" = 0 ] && exit 0
      fi
    done
    echo "  (listed once a Python with MindSpore is found: after a first 'bash run.sh', or with PYTHON=<that python>)"
    exit 0
  fi
done

workers=8
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then workers="$1"; shift; fi
usage="Usage: [NNODES=.. NODE_RANK=.. MASTER_ADDR=.. MASTER_PORT=..] bash run.sh [N] [train.py args...]"
fail_usage() { echo "run.sh: $1 $usage" >&2; exit 2; }
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
  fail_usage "the number of workers must be a positive integer, but got '$workers'."
fi
nnodes="${NNODES:-1}"
node_rank="${NODE_RANK:-0}"
master_addr="${MASTER_ADDR:-127.0.0.1}"
[[ "$nnodes" =~ ^[0-9]+$ ]] && [ "$nnodes" -ge 1 ] || fail_usage "NNODES must be a positive integer, but got '$nnodes'."
[[ "$node_rank" =~ ^[0-9]+$ ]] || fail_usage "NODE_RANK must be a non-negative integer, but got '$node_rank'."
[ "$node_rank" -lt "$nnodes" ] || fail_usage "NODE_RANK must be less than NNODES=$nnodes, but got '$node_rank'."
if [ -n "${MASTER_PORT:-}" ]; then
  if ! [[ "$MASTER_PORT" =~ ^[0-9]+$ ]] || [ "$MASTER_PORT" -lt 1 ] || [ "$MASTER_PORT" -gt 65535 ]; then
    fail_usage "MASTER_PORT must be an integer from 1 to 65535, but got '$MASTER_PORT'."
  fi
elif [ "$nnodes" -gt 1 ]; then
  fail_usage "MASTER_PORT must be set (the same on every node) when NNODES=$nnodes > 1."
fi
launcher="${LAUNCHER:-}"
case "$launcher" in
  ""|mpirun|msrun|cluster) ;;
  *) fail_usage "LAUNCHER must be 'mpirun', 'msrun' or 'cluster', but got '$launcher'." ;;
esac
checking=0
resuming=0
for arg in "$@"; do
  [ "$arg" = "--check" ] && checking=1
  [ "$arg" = "--resume" ] && resuming=1
done
device_target="${DEVICE_TARGET:-CPU}"
run_timeout="${RUN_TIMEOUT:-1800}"
log_dir="${LOG_DIR:-log_output}"
case "$log_dir" in /*) checkpoint_dir="$log_dir/checkpoints" ;; *) checkpoint_dir="$PWD/$log_dir/checkpoints" ;; esac
script="sample_code/distributed_gradient_accumulation/train.py"

# 1. The Python to run with. The package's own import refuses a MindSpore outside its range, so "it imports" is
# the test; the checkout is used in place (PYTHONPATH), never installed into the active environment.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
needs="import ms_gradaccum"
[ -z "${DATA_PATH:-}" ] && needs="$needs, sklearn"     # the built-in digits are made with scikit-learn
python="${PYTHON:-python3}"
if ! (cd / && "$python" -c "$needs") >/dev/null 2>&1; then
  venv="${RUN_SH_VENV:-$PWD/.venv}"
  if ! (cd / && "$venv/bin/python" -c "$needs") >/dev/null 2>&1; then
    echo "run.sh: $python has no supported MindSpore (or no scikit-learn); installing them into $venv (once)..."
    { [ -x "$venv/bin/python" ] || python3 -m venv "$venv"; } &&
      "$venv/bin/python" -m pip install -q -e ".[sample]" ||
      { echo "run.sh: could not install MindSpore and scikit-learn into $venv (see pip's message above)." >&2; exit 2; }
  fi
  python="$venv/bin/python"
fi
python="$(cd / && "$python" -c "import sys; print(sys.executable)")"
# msrun and its workers, and mpirun's, run the python first on PATH: make it this one.
export PATH="$(dirname "$python"):$PATH"

# 2. Checks before anything is launched: bad train.py arguments, a missing or malformed DATA_PATH, a device
# target MindSpore cannot use here, semi-auto parallel on CPU. Exit 2 with argparse's message.
# Write the built-in dataset once, before the ranks start, so they do not all build it at the same time.
if [ -z "${DATA_PATH:-}" ]; then
  DATA_PATH="$("$python" -c "import sys; sys.path.insert(0, 'sample_code/distributed_gradient_accumulation'); \
from builtin_digits import ensure_digits_mnist; print(ensure_digits_mnist())")"
fi
export DATA_PATH
ranks=$((workers * nnodes))
MS_WORKER_NUM="$ranks" "$python" "$script" --validate-only --device-target "$device_target" "$@" >/dev/null || exit 2
export GLOG_v="${GLOG_v:-3}"            # MindSpore: errors only, keeps the per-rank logs readable
export MS_NODE_TIMEOUT="${MS_NODE_TIMEOUT:-10}"   # a dead rank is noticed in seconds, not minutes

free_port() { "$python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

mpirun_works() {
  command -v mpirun >/dev/null 2>&1 || return 1
  timeout 20 mpirun --allow-run-as-root --oversubscribe -n 2 true >/dev/null 2>&1
}

if [ -z "$launcher" ]; then
  if [ "$nnodes" -gt 1 ]; then launcher=cluster; elif mpirun_works; then launcher=mpirun; else launcher=msrun; fi
fi
total=$((workers * nnodes))
first_rank=$((node_rank * workers))
if [ "$launcher" = mpirun ] && [ "$nnodes" -gt 1 ]; then
  [ -n "${HOSTFILE:-}" ] || fail_usage "with LAUNCHER=mpirun and NNODES=$nnodes, set HOSTFILE (mpirun starts every node's workers)."
  [ "$node_rank" -eq 0 ] || fail_usage "with LAUNCHER=mpirun, start run.sh on node 0 only (NODE_RANK=0), not on node $node_rank."
  workers=$total
fi
if [ "$resuming" -eq 1 ]; then
  # Keep the checkpoints to resume from; the logs are those of this run.
  find "$log_dir" -mindepth 1 -maxdepth 1 ! -name checkpoints -exec rm -rf {} + 2>/dev/null || true
else
  rm -rf "$log_dir"
fi
mkdir -p "$log_dir"
# One layout for every launcher: LOG_DIR/1/rank.<N>/stdout (mpirun's --output-filename writes it itself).
rank_log() { echo "$log_dir/1/rank.$1/stdout"; }
for ((rank = first_rank; rank < first_rank + workers; rank++)); do mkdir -p "$log_dir/1/rank.$rank"; done
scheduler_log="$log_dir/scheduler.log"
port="${MASTER_PORT:-$(free_port)}"
echo "run.sh: $workers worker(s) on $device_target with $launcher (node $node_rank of $nnodes, $total in all, master $master_addr:$port), logs in $log_dir/, timeout ${run_timeout}s"

status=0
case "$launcher" in
  msrun)
    # msrun names its logs worker_<N>.log in its own folder: each rank's standard place links to its file.
    for ((rank = first_rank; rank < first_rank + workers; rank++)); do
      ln -s "../../msrun/worker_$rank.log" "$(rank_log "$rank")"
    done
    scheduler_log="$log_dir/msrun/scheduler.log"
    timeout --kill-after=10 "$run_timeout" msrun --worker_num="$total" --local_worker_num="$workers" \
      --node_rank="$node_rank" --master_addr="$master_addr" --master_port="$port" --log_dir="$log_dir/msrun" \
      --join=True --cluster_time_out=60 \
      "$script" --device-target "$device_target" --save-dir "$checkpoint_dir" "$@" >"$log_dir/msrun.log" 2>&1 || status=$?
    ;;
  mpirun)
    # MindSpore's collectives on CPU do not come up under plain mpirun: each rank joins MindSpore's own
    # dynamic cluster instead, through the variables below, with one extra scheduler process.
    export MS_WORKER_NUM="$total" MS_SCHED_HOST="$master_addr" MS_SCHED_PORT="$port"
    MS_ROLE=MS_SCHED "$python" "$script" --device-target "$device_target" --save-dir "$checkpoint_dir" "$@" >"$log_dir/scheduler.log" 2>&1 &
    scheduler=$!
    hostfile=()
    [ -n "${HOSTFILE:-}" ] && hostfile=(--hostfile "$HOSTFILE")
    timeout --kill-after=10 "$run_timeout" mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$total" \
      "${hostfile[@]}" --output-filename "$log_dir" --merge-stderr-to-stdout \
      -x MS_WORKER_NUM -x MS_SCHED_HOST -x MS_SCHED_PORT -x DATA_PATH -x GLOG_v -x MS_NODE_TIMEOUT \
      bash -c 'export MS_ROLE=MS_WORKER MS_NODE_ID="$OMPI_COMM_WORLD_RANK" RANK_ID="$OMPI_COMM_WORLD_RANK"; exec "$0" "$@"' \
      "$python" "$script" --device-target "$device_target" --save-dir "$checkpoint_dir" "$@" >"$log_dir/mpirun.log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then kill "$scheduler" 2>/dev/null || true; fi
    wait "$scheduler" 2>/dev/null || true
    ;;
  cluster)
    # MindSpore's dynamic cluster, started by hand: one scheduler (on node 0) and this node's workers, each told
    # its global rank. This is what msrun does on each node, minus msrun's scheduler on every node whose
    # MASTER_ADDR is local (two msrun "nodes" on one host both try to bind it).
    export MS_WORKER_NUM="$total" MS_SCHED_HOST="$master_addr" MS_SCHED_PORT="$port"
    pids=()
    if [ "$node_rank" -eq 0 ]; then
      MS_ROLE=MS_SCHED "$python" "$script" --device-target "$device_target" --save-dir "$checkpoint_dir" "$@" >"$log_dir/scheduler.log" 2>&1 &
      pids+=($!)
    fi
    for ((i = 0; i < workers; i++)); do
      rank=$((first_rank + i))
      MS_ROLE=MS_WORKER MS_NODE_ID="$rank" RANK_ID="$rank" \
        "$python" "$script" --device-target "$device_target" --save-dir "$checkpoint_dir" "$@" >"$(rank_log "$rank")" 2>&1 &
      pids+=($!)
    done
    deadline=$((SECONDS + run_timeout))
    for pid in "${pids[@]}"; do
      while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 1; done
      if kill -0 "$pid" 2>/dev/null; then status=124; break; fi
      wait "$pid" || { status=$?; break; }
    done
    if [ "$status" -ne 0 ]; then
      # One process failed or time ran out: stop the others on this node, then wait for them.
      for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
      for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    fi
    ;;
esac

done_line="final loss"
[ "$checking" -eq 1 ] && done_line="equivalence check (PASS|FAIL)"
last_rank=$((first_rank + workers - 1))
[ "$launcher" = mpirun ] && { first_rank=0; last_rank=$((total - 1)); }
summary_ok=1
for ((rank = first_rank; rank <= last_rank; rank++)); do
  log="$(rank_log "$rank")"
  if [ ! -f "$log" ] || ! grep -qE "$done_line" "$log"; then summary_ok=0; fi
done

if [ "$checking" -eq 1 ] && [ "$summary_ok" -eq 1 ]; then
  # The check's own report, from this node's first rank, then every rank's verdict.
  grep -hE "^equivalence check|^  " "$(rank_log "$first_rank")" || true
  for ((rank = first_rank; rank <= last_rank; rank++)); do grep -hE "equivalence check (PASS|FAIL)" "$(rank_log "$rank")"; done
  if grep -qE "equivalence check FAIL" "$(rank_log "$first_rank")"; then
    echo "run.sh: equivalence check FAILED. Logs: $log_dir/" >&2
    exit 1
  fi
  echo "run.sh: equivalence check passed on every rank of this node. Logs: $log_dir/"
  exit 0
fi

if [ "$status" -ne 0 ] || [ "$summary_ok" -ne 1 ]; then
  [ "$status" -eq 124 ] && echo "run.sh: the job did not finish within ${run_timeout}s and was stopped." >&2
  echo "run.sh: FAILED ($launcher exit status $status). Logs: $log_dir/" >&2
  # The launcher's and scheduler's own account: msrun's "Worker process N exit with exception. Error code: -9",
  # mpirun's "mpirun noticed that process rank N ... exited on signal 9", the scheduler's timed-out nodes.
  grep -hE "ERROR|noticed that|exited on signal" "$log_dir/$launcher.log" "$scheduler_log" 2>/dev/null \
    | sed -E 's/^\[ERROR\] [^ ]+ \[[^]]*\] ?//' | tail -n 6 >&2 || true
  for ((rank = first_rank; rank <= last_rank; rank++)); do
    log="$(rank_log "$rank")"
    if [ ! -f "$log" ] || ! grep -qE "$done_line" "$log"; then
      echo "---- rank $rank did not finish; last lines of $log:" >&2
      if [ -f "$log" ]; then tail -n 25 "$log" >&2; else echo "(no log file)" >&2; fi
    fi
  done
  if [ "$checking" -eq 0 ] && ls "$log_dir"/checkpoints/rank_*/*.ckpt >/dev/null 2>&1; then
    echo "run.sh: checkpoints are kept in $log_dir/checkpoints/; continue from the newest with the same command" \
         "and --resume (bash run.sh $workers ${*:+$* }--resume)." >&2
  fi
  [ "$status" -ne 0 ] && exit "$status"
  exit 1
fi

echo "run.sh: done. Per-rank logs: $(rank_log "$first_rank") ... $(rank_log "$last_rank")"
for ((rank = first_rank; rank <= last_rank; rank++)); do
  grep -h "final loss" "$(rank_log "$rank")" | tail -n 1
done
