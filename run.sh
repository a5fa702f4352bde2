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
# (default log_output in this checkout; a relative LOG_DIR is taken from where run.sh is started). Several nodes (names as torchrun's): NNODES (default 1), NODE_RANK (0..NNODES-1),
# MASTER_ADDR (node 0's address, default 127.0.0.1), MASTER_PORT (default: a free local port; required
# with NNODES > 1); N is the number of workers on this node. HOSTFILE: passed to mpirun (--hostfile),
# which then starts all NNODES x N workers from node 0.
# Logs, whichever launcher runs: LOG_DIR/1/rank.<N>/stdout (the layout of the MindSpore tutorial's mpirun).
# Checkpoints: LOG_DIR/checkpoints/rank_<N>/ (every epoch; --save-steps S: every S steps too; --no-save: none).
# A new run clears LOG_DIR; with --resume its checkpoints are kept and training continues from the newest one that
# every rank completed, with the data order and result of a run never stopped. A LOG_DIR a running job uses is
# refused (one job per folder). Paths and commands printed work from the directory run.sh was started in.
set -euo pipefail
# Paths and commands run.sh prints work from where the user stands (its folder is the checkout's, below).
caller_dir="$PWD"
invocation="bash $0${*:+ $*}"
cd "$(dirname "$0")"
self="$PWD/$(basename "$0")"
shown() {   # an absolute path $1 as the user can type it where they stand: relative below that folder, else absolute
  case "$1" in
    "$caller_dir") echo "." ;;
    "$caller_dir"/*) echo "${1#"$caller_dir"/}" ;;
    *) echo "$1" ;;
  esac
}

# Every process of a job carries MS_GRADACCUM_JOB=<id> in its environment (the launchers pass the environment on, and
# msrun's workers keep it though they run in sessions of their own): that, not a process group, is how the job is found
# and stopped. run.sh itself and its forks do not show it (bash exports to the programs it starts, not to itself).
job_processes() {   # found_pids: the PIDs of job $1 (read with builtins: a program started for it would carry the mark)
  local proc env
  found_pids=()
  for proc in /proc/[0-9]*; do
    mapfile -d '' env 2>/dev/null <"$proc/environ" || continue
    [[ " ${env[*]} " == *" MS_GRADACCUM_JOB=$1 "* ]] && found_pids+=("${proc#/proc/}")
  done
  return 0
}
stop_processes() {   # job $1: SIGTERM, then SIGKILL after $2 seconds for what is left; returns when none is left
  local waited=0
  job_processes "$1"
  [ "${#found_pids[@]}" -eq 0 ] && return 0
  kill -TERM "${found_pids[@]}" 2>/dev/null || true
  while [ "$waited" -lt $(($2 * 4)) ]; do
    job_processes "$1"
    [ "${#found_pids[@]}" -eq 0 ] && return 0
    sleep 0.25
    waited=$((waited + 1))
  done
  job_processes "$1"
  [ "${#found_pids[@]}" -gt 0 ] && kill -KILL "${found_pids[@]}" 2>/dev/null
  return 0
}
if [ "${1:-}" = "--guard-job" ]; then
  # The guard (started by run.sh in a session of its own, without the job's mark): when run.sh is gone, killed by a
  # signal it cannot trap (SIGKILL), the job it left is stopped, so that nothing trains on as an orphan.
  alive() { local stat; read -r stat 2>/dev/null <"/proc/$1/stat" || return 1; [[ "${stat##*) }" != Z* ]]; }
  while alive "$2"; do sleep 2; done   # a zombie (killed, not yet reaped by its parent) is gone too
  stop_processes "$3" 5
  exit 0
fi

for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    # run.sh's own usage (its header), then the sample's options once, from the Python run.sh would use (nothing is
    # installed for this): not 8 workers each printing them.
    sed -n '2,/^set -euo/p' "$self" | sed '$d' | sed 's/^# \{0,1\}//'
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
requested_workers="$workers"
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
log_dir="${LOG_DIR:-$PWD/log_output}"   # a relative LOG_DIR is taken from where run.sh is started
case "$log_dir" in /*) ;; *) log_dir="$caller_dir/$log_dir" ;; esac
log_dir="${log_dir%/}"
checkpoint_dir="$log_dir/checkpoints"

script="sample_code/distributed_gradient_accumulation/train.py"

# 1. The Python to run with, and the checks before anything is launched, in one run of train.py --validate-only:
# bad train.py arguments, a missing or malformed DATA_PATH, a device target MindSpore cannot use here, semi-auto
# parallel on CPU, a resume with other settings (exit 2 with argparse's message). It writes the built-in dataset once,
# before the ranks start (so they do not all build it at the same time), and prints the Python's path and the data's.
# The checkout is used in place (PYTHONPATH), never installed into the active environment. Where that run fails
# because the Python cannot import what the job needs (the package's own import refuses a MindSpore outside its
# range), a virtual environment of its own gets them, once.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ranks=$((workers * nnodes))
needs="import ms_gradaccum"
[ -z "${DATA_PATH:-}" ] && needs="$needs, sklearn"     # the built-in digits are made with scikit-learn
validate() {   # $1: the python; prints "validated: python=..." and "validated: data=..." when the job may start
  MS_WORKER_NUM="$ranks" "$1" "$script" --validate-only --device-target "$device_target" --save-dir "$checkpoint_dir" \
    "${@:2}"
}
python="${PYTHON:-python3}"
checked="$(mktemp)"
status=0
validated="$(validate "$python" "$@" 2>"$checked")" || status=$?
refusal="$(cat "$checked")"; rm -f "$checked"
if [ "$status" -ne 0 ]; then
  # 2: argparse's refusal. Another status (an import that failed) is the arguments' only where the Python has what the
  # job needs.
  if [ "$status" -eq 2 ] || (cd / && "$python" -c "$needs") >/dev/null 2>&1; then
    printf '%s\n' "$refusal" >&2; exit 2
  fi
  venv="${RUN_SH_VENV:-$PWD/.venv}"
  if ! (cd / && "$venv/bin/python" -c "$needs") >/dev/null 2>&1; then
    echo "run.sh: $python has no supported MindSpore (or no scikit-learn); installing them into $venv (once):" \
         "about 2.8 GB and 1 to 4 minutes (53 s and 220 s measured on two fresh machines)..."
    { [ -x "$venv/bin/python" ] || python3 -m venv "$venv"; } &&
      "$venv/bin/python" -m pip install -q -e ".[sample]" ||
      { echo "run.sh: could not install MindSpore and scikit-learn into $venv (see pip's message above)." >&2; exit 2; }
  fi
  validated="$(validate "$venv/bin/python" "$@")" || exit 2
fi
python="$(sed -n 's/^validated: python=//p' <<<"$validated")"
DATA_PATH="$(sed -n 's/^validated: data=//p' <<<"$validated")"
export DATA_PATH
# msrun and its workers, and mpirun's, run the python first on PATH: make it this one.
export PATH="$(dirname "$python"):$PATH"
export GLOG_v="${GLOG_v:-3}"            # MindSpore: errors only, keeps the per-rank logs readable
export MS_NODE_TIMEOUT="${MS_NODE_TIMEOUT:-10}"   # a dead rank is noticed in seconds, not minutes
# MindSpore's CPU collectives give up on a peer after 30 s (MS_CPU_COMM_OP_TIMEOUT). A live rank can lag by more: the
# ranks compile their first step side by side, 8 of them on 2 cores, and the job failed in the first step's all-gather.
# Waiting longer delays nothing else: a dead rank is noticed by its heartbeats (MS_NODE_TIMEOUT). 300 s is MindSpore's
# own ceiling for this wait (kCollectiveCommMaxTimeout).
export MS_CPU_COMM_OP_TIMEOUT="${MS_CPU_COMM_OP_TIMEOUT:-300}"

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
# One job per folder: a job holds LOG_DIR/.run.sh.lock (flock) while run.sh runs; a second run.sh on the same folder
# refuses before clearing it, naming the job (the note in the lock file). The lock goes with its holder: a folder left
# by a job that died blocks nothing.
mkdir -p "$log_dir"
lock_file="$log_dir/.run.sh.lock"
exec {lock_fd}>>"$lock_file"
if command -v flock >/dev/null 2>&1; then
  locked() { flock -n "$lock_fd"; }
else   # no flock: the noted run.sh, if it still runs, holds the folder
  locked() {
    local pid; pid="$(sed -nE '1s/^PID ([0-9]+) .*/\1/p' "$lock_file" 2>/dev/null)"
    ! { [ -n "$pid" ] && [ "$pid" != "$$" ] && grep -qa "run.sh" "/proc/$pid/cmdline" 2>/dev/null; }
  }
fi
if ! locked; then
  echo "run.sh: LOG_DIR $(shown "$log_dir") is in use by a job that is running: $(head -n 1 "$lock_file" 2>/dev/null)." \
       "This run would clear its logs and checkpoints: nothing was touched. Either stop that job first (Ctrl-C where" \
       "it runs, or kill the PID above), or give this run a folder of its own: LOG_DIR=<another folder> $invocation" >&2
  exit 2
fi
printf 'PID %s on %s, started %s in %s: %s\n' "$$" "$(uname -n)" "$(date '+%Y-%m-%d %H:%M:%S')" "$caller_dir" \
  "$invocation" >"$lock_file"
# Clear the folder (it holds this job's lock); with --resume, keep the checkpoints to resume from.
kept_name=.run.sh.lock
[ "$resuming" -eq 1 ] && kept_name=checkpoints
find "$log_dir" -mindepth 1 -maxdepth 1 ! -name .run.sh.lock ! -name "$kept_name" -exec rm -rf {} + 2>/dev/null || true
# One layout for every launcher: LOG_DIR/1/rank.<N>/stdout (mpirun's --output-filename writes it itself).
rank_log() { echo "$log_dir/1/rank.$1/stdout"; }
for ((rank = first_rank; rank < first_rank + workers; rank++)); do mkdir -p "$log_dir/1/rank.$rank"; done
scheduler_log="$log_dir/scheduler.log"
port="${MASTER_PORT:-$(free_port)}"
echo "run.sh: $workers worker(s) on $device_target with $launcher (node $node_rank of $nnodes, $total in all, master $master_addr:$port), logs in $(shown "$log_dir")/, timeout ${run_timeout}s"

launch() {   # the job, by the launcher chosen; its status is the launcher's
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
      "$script" --device-target "$device_target" --save-dir "$checkpoint_dir" "$@" >"$log_dir/msrun.log" 2>&1 </dev/null || status=$?
    ;;
  mpirun)
    # MindSpore's collectives on CPU do not come up under plain mpirun: each rank joins MindSpore's own
    # dynamic cluster instead, through the variables below, with one extra scheduler process.
    export MS_WORKER_NUM="$total" MS_SCHED_HOST="$master_addr" MS_SCHED_PORT="$port"
    MS_ROLE=MS_SCHED "$python" "$script" --device-target "$device_target" --save-dir "$checkpoint_dir" "$@" >"$log_dir/scheduler.log" 2>&1 </dev/null &
    scheduler=$!
    hostfile=()
    [ -n "${HOSTFILE:-}" ] && hostfile=(--hostfile "$HOSTFILE")
    timeout --kill-after=10 "$run_timeout" mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$total" \
      "${hostfile[@]}" --output-filename "$log_dir" --merge-stderr-to-stdout \
      -x MS_WORKER_NUM -x MS_SCHED_HOST -x MS_SCHED_PORT -x DATA_PATH -x GLOG_v -x MS_NODE_TIMEOUT -x MS_CPU_COMM_OP_TIMEOUT \
      bash -c 'export MS_ROLE=MS_WORKER MS_NODE_ID="$OMPI_COMM_WORLD_RANK" RANK_ID="$OMPI_COMM_WORLD_RANK"; exec "$0" "$@"' \
      "$python" "$script" --device-target "$device_target" --save-dir "$checkpoint_dir" "$@" >"$log_dir/mpirun.log" 2>&1 </dev/null || status=$?
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
      MS_ROLE=MS_SCHED "$python" "$script" --device-target "$device_target" --save-dir "$checkpoint_dir" "$@" >"$log_dir/scheduler.log" 2>&1 </dev/null &
      pids+=($!)
    fi
    for ((i = 0; i < workers; i++)); do
      rank=$((first_rank + i))
      MS_ROLE=MS_WORKER MS_NODE_ID="$rank" RANK_ID="$rank" \
        "$python" "$script" --device-target "$device_target" --save-dir "$checkpoint_dir" "$@" >"$(rank_log "$rank")" 2>&1 </dev/null &
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
return "$status"
}


# What a stop leaves: the newest checkpoint every rank of this node completed, and the command that goes on from it.
resume_command() {
  local kept=() arg prefix=""
  for arg in "$@"; do [ "$arg" = "--resume" ] || kept+=("$arg"); done
  [ -n "${LOG_DIR:-}" ] && prefix="LOG_DIR=$(shown "$log_dir") "
  [ -n "${LAUNCHER:-}" ] && prefix="${prefix}LAUNCHER=$LAUNCHER "
  echo "${prefix}bash $(shown "$self") $requested_workers ${kept[*]:+${kept[*]} }--resume"
}
report_saved() {
  [ "$checking" -eq 1 ] && return 0
  local rank names=() common="" name
  for ((rank = first_rank; rank <= last_rank; rank++)); do
    names=()
    for name in "$checkpoint_dir/rank_$rank"/train-*_*.ckpt; do [ -f "$name" ] && names+=("${name##*/}"); done
    if [ "$rank" -eq "$first_rank" ]; then common=" ${names[*]} "; else
      local kept=" "
      for name in "${names[@]}"; do [[ "$common" == *" $name "* ]] && kept+="$name "; done
      common="$kept"
    fi
  done
  local newest
  newest="$(tr ' ' '\n' <<<"$common" | sed -nE 's/^train-([0-9]+)_([0-9]+)\.ckpt$/\1 \2/p' | sort -n -k1,1 -k2,2 | tail -n 1)"
  if [ -z "$newest" ]; then
    echo "run.sh: no checkpoint was completed by every rank yet: nothing to resume from (start again with the same command)."
  else
    echo "run.sh: saved: epoch ${newest% *}, step ${newest#* } of that epoch, on every rank" \
         "($(shown "$checkpoint_dir")/rank_*/train-${newest% *}_${newest#* }.ckpt)."
    echo "run.sh: continue with: $(resume_command "$@")"
  fi
}

# Rank ${first_rank}'s progress, as it logs it (the start or resume point, one line per epoch), on the terminal.
shown=0
relay_progress() {
  local log lines=()
  log="$(rank_log "$first_rank")"
  [ -f "$log" ] || return 0
  mapfile -t lines < <(grep -aE "^\[rank $first_rank\] (epoch [0-9]+/[0-9]+|resumed|starting|--resume|the checkpoint|skipping checkpoint)" "$log" 2>/dev/null || true)
  while [ "$shown" -lt "${#lines[@]}" ]; do echo "${lines[$shown]}"; shown=$((shown + 1)); done
}

last_rank=$((first_rank + workers - 1))
[ "$launcher" = mpirun ] && { first_rank=0; last_rank=$((total - 1)); }
job_id="$$-$(date +%s%N)"
export MS_GRADACCUM_JOB="$job_id" MS_GRADACCUM_RUN_SH_PID="$$" MS_GRADACCUM_RUN_SH_HOST="$(uname -n)"
# The guard, in a session of its own and without the mark: a run.sh killed by SIGKILL leaves no job behind.
env -u MS_GRADACCUM_JOB setsid bash "$self" --guard-job "$$" "$job_id" </dev/null >/dev/null 2>&1 {lock_fd}>&- &
# Ctrl-C (SIGINT), SIGTERM, SIGHUP: the trap only notes the signal (bash runs a trap between commands, or ends a
# `read`/`wait` early for it); the loop below then stops every process of the job, says what was saved and exits 128+N.
stop_signal=""
trap 'stop_signal="SIGINT 130"' INT
trap 'stop_signal="SIGTERM 143"' TERM
trap 'stop_signal="SIGHUP 129"' HUP
# Bash's own notes ("Terminated") go to run_sh.log; the lock stays with run.sh alone (a rank left behind when run.sh is
# killed is stopped by the guard, and must not hold the folder after run.sh is gone).
launch "$@" 2>>"$log_dir/run_sh.log" {lock_fd}>&- &
launch_pid=$!
exec {tick}<> <(:)   # an empty pipe held open: `read -t` on it waits without starting a program, and a signal ends it
while [ -z "$stop_signal" ] && kill -0 "$launch_pid" 2>/dev/null; do
  relay_progress
  read -r -t 1 -u "$tick" || true
done
if [ -n "$stop_signal" ]; then
  trap '' INT TERM HUP
  started=$SECONDS
  echo >&2
  echo "run.sh: ${stop_signal% *} received: stopping the job (the launcher and every rank of this node)..." >&2
  stop_processes "$job_id" 5
  wait "$launch_pid" 2>/dev/null || true
  relay_progress
  echo "run.sh: stopped within $((SECONDS - started + 1)) s; no process of the job is left." >&2
  report_saved "$@" >&2
  exit "${stop_signal#* }"
fi
status=0
wait "$launch_pid" || status=$?
relay_progress

done_line="final loss"
[ "$checking" -eq 1 ] && done_line="equivalence check (PASS|FAIL)"
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
    echo "run.sh: equivalence check FAILED. Logs: $(shown "$log_dir")/" >&2
    exit 1
  fi
  echo "run.sh: equivalence check passed on every rank of this node. Logs: $(shown "$log_dir")/"
  exit 0
fi

if [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && [ "$summary_ok" -eq 1 ]; then
  # Every rank printed its final line, which it prints once it has trained, saved and tested; the job then exited
  # non-zero. MindSpore's CPU cluster sometimes crashes so in its own shutdown (SIGSEGV, 139) on a loaded machine:
  # what was asked is complete, so say what happened and report the run as done.
  echo "run.sh: note: $launcher exited with status $status after every rank of this node had printed its final line" \
       "(which comes once it has trained, saved and tested): a crash on the way out; the run itself is complete." >&2
  status=0
fi

if [ "$status" -ne 0 ] || [ "$summary_ok" -ne 1 ]; then
  [ "$status" -eq 124 ] && echo "run.sh: the job did not finish within ${run_timeout}s and was stopped." >&2
  echo "run.sh: FAILED ($launcher exit status $status). Logs: $(shown "$log_dir")/" >&2
  # The launcher's and scheduler's own account: msrun's "Worker process N exit with exception. Error code: -9",
  # mpirun's "mpirun noticed that process rank N ... exited on signal 9", the scheduler's timed-out nodes.
  grep -hE "ERROR|noticed that|exited on signal" "$log_dir/$launcher.log" "$scheduler_log" 2>/dev/null \
    | sed -E 's/^\[ERROR\] [^ ]+ \[[^]]*\] ?//' | tail -n 6 >&2 || true
  for ((rank = first_rank; rank <= last_rank; rank++)); do
    log="$(rank_log "$rank")"
    if [ ! -f "$log" ] || ! grep -qE "$done_line" "$log"; then
      echo "---- rank $rank did not finish; last lines of $(shown "$log"):" >&2
      if [ -f "$log" ]; then tail -n 25 "$log" >&2; else echo "(no log file)" >&2; fi
    fi
  done
  [ "$checking" -eq 0 ] && report_saved "$@" >&2
  [ "$status" -ne 0 ] && exit "$status"
  exit 1
fi

echo "run.sh: done. Per-rank logs: $(shown "$(rank_log "$first_rank")") ... $(shown "$(rank_log "$last_rank")")"
finals=()
for ((rank = first_rank; rank <= last_rank; rank++)); do
  finals+=("$(grep -h "final loss" "$(rank_log "$rank")" | tail -n 1)")
  echo "${finals[-1]%%; the loss is*}"
done
# Each rank's "final loss" is its own last batch, on its own shard of the data; the weights are the same on every
# rank (data parallel), so the test accuracy is one figure. Say so once, with the mean of the ranks' losses.
if [ "${#finals[@]}" -gt 1 ]; then
  printf '%s\n' "${finals[@]}" | sed -nE 's/.*final loss ([0-9.]+) .*/\1/p' | awk -v n="${#finals[@]}" \
    '{ s += $1 } END { if (NR == n) printf "run.sh: each final loss is that rank'"'"'s last batch of its own shard; their mean is %.6f. Every rank holds the same weights.\n", s / n }'
fi
if [ "$checking" -eq 0 ] && [ -d "$checkpoint_dir" ]; then
  echo "run.sh: checkpoints: $(du -sh "$checkpoint_dir" | cut -f1) in $(shown "$checkpoint_dir") (go on with more epochs:" \
       "$(resume_command "$@" | sed -E 's/--epochs [0-9]+ ?//') --epochs N; remove the folder when done)."
fi
