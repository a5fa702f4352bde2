"""run.sh, the main job's launcher: a rank that dies makes it fail fast, loudly, never hang."""
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from typing import Optional

import pytest

from launch import REPO, free_port, repo_env, require_ranks, suite_device

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _processes_with_env(marker: str, rank: int) -> list:
    """PIDs of train.py processes of this test run (found by a marker variable) with RANK_ID=rank."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if b"train.py" not in handle.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as handle:
                env = handle.read().split(b"\0")
        except OSError:
            continue
        if f"MS_GRADACCUM_TEST_RUN={marker}".encode() in env and f"RANK_ID={rank}".encode() in env:
            found.append(int(pid))
    return found


def _wait_for(condition, timeout: float, what: str, report=None) -> None:
    """Polls `condition` until it holds; fails after `timeout` s, with what ``report()`` says where given."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            said = "" if report is None else f"\n{report()}"
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{said}")
        time.sleep(0.5)


def _log_tail(path) -> str:
    return f"last lines of {path}:\n" + "".join(_read(str(path)).splitlines(keepends=True)[-15:])


def _still_running(job, what: str) -> bool:
    """True while run.sh runs; fails at once, with its output, when it ended before `what`."""
    if job.poll() is not None:
        raise AssertionError(f"run.sh ended (exit {job.returncode}) before {what}:\n{job.communicate()[0][-3000:]}")
    return True


def _kill_rank_1_when(job, worker_1, text: str, marker: str, what: str) -> tuple:
    """Waits until rank 1's log holds `text`, kills rank 1 with SIGKILL and waits for run.sh: ``(its output, seconds
    from the kill to its end)``. run.sh is killed if it is still running when this ends."""
    try:
        _wait_for(lambda: _still_running(job, what) and text in _read(str(worker_1)), 240, what,
                  report=lambda: _log_tail(worker_1))
        pids = _processes_with_env(marker, 1)
        assert len(pids) == 1, f"expected one rank-1 process, found {pids}"
        os.kill(pids[0], 9)
        killed_at = time.monotonic()
        output, _ = job.communicate(timeout=90)
        return output, time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()


LAUNCHERS = {
    # launcher: (rank 1's log, what the launcher says about a rank killed with signal 9). msrun says one of two
    # things, whichever of its checks sees the dead rank first: its process monitor (the exit code) or its
    # scheduler (heartbeats stop; seen in a CI run on 2 cores, where it then declares every node timed out).
    "msrun": ("1/rank.1/stdout", r"Worker process \d+ exit with exception\. Error code: -9"
                                 r"|The node: 1 is timed out"),
    "mpirun": ("1/rank.1/stdout", r"process rank 1 with PID \d+ on node \S+ exited on signal 9"),
}


def _mpirun_works() -> bool:
    try:
        return subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", "true"],
                              capture_output=True, timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank's process through /proc")
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_run_sh_killed_rank_fails_fast_with_its_log(tmp_path, launcher):
    require_ranks(2)
    if launcher == "mpirun" and not _mpirun_works():
        pytest.skip("mpirun is not installed or does not start processes here (run.sh then uses msrun)")
    rank_1_log, launcher_says = LAUNCHERS[launcher]
    marker = uuid.uuid4().hex
    log_dir = tmp_path / "logs"
    env = repo_env(MS_GRADACCUM_TEST_RUN=marker, LOG_DIR=str(log_dir), LAUNCHER=launcher, RUN_TIMEOUT="300")
    job = subprocess.Popen(["bash", os.path.join(REPO, "run.sh"), "2", "--epochs", "500", "--loss-every", "1"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, elapsed = _kill_rank_1_when(job, log_dir / rank_1_log, "loss is", marker, "rank 1 to start training")
    assert job.returncode != 0, output
    assert elapsed < 60, f"run.sh took {elapsed:.0f}s to notice the dead rank"
    assert "run.sh: FAILED" in output
    assert re.search(launcher_says, output), output
    assert "rank 1 did not finish; last lines of" in output and "loss is" in output
    assert not _processes_with_env(marker, 0), "rank 0 was left running"


def _job_processes(marker: str) -> list:
    """PIDs of every process of a run.sh job of this test (launchers, scheduler, ranks: found by a marker variable)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if f"MS_GRADACCUM_TEST_RUN={marker}".encode() in handle.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


# A terminal starts its foreground command with SIGHUP and SIGINT at their defaults. A test run started under nohup,
# or in the background of a script, ignores them, and bash cannot trap a signal ignored when it started (POSIX): so
# the job's bash gets the defaults back first, then replaces the helper (exec: the same process).
_AS_A_TERMINAL = ("import os, signal, sys\n"
                  "for number in (signal.SIGHUP, signal.SIGINT):\n"
                  "    signal.signal(number, signal.SIG_DFL)\n"
                  "os.execvp('bash', ['bash'] + sys.argv[1:])\n")


def _start_job(tmp_path, launcher: str, marker: str, *args: str) -> subprocess.Popen:
    """run.sh with 2 workers in a process group of its own, as a terminal runs a foreground command."""
    env = _run_sh_env(tmp_path, "logs", MS_GRADACCUM_TEST_RUN=marker, LAUNCHER=launcher)
    return subprocess.Popen([sys.executable, "-c", _AS_A_TERMINAL, os.path.join(REPO, "run.sh"), "2", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _stop_and_time(job, marker: str, send, bound: float) -> tuple:
    """`send()` once rank 0 has trained an epoch; ``(run.sh's output, seconds from the signal until no process of the
    job is left, the job's processes found just before)``."""
    log = None
    try:
        _wait_for(lambda: _still_running(job, "rank 0 trained") and "epoch 2/" in _read(_rank_0_log(job)), 240,
                  "rank 0 to train", report=lambda: _log_tail(_rank_0_log(job)))
        log = _read(_rank_0_log(job))
        before = _job_processes(marker)
        sent = time.monotonic()
        send()
        output = job.communicate(timeout=bound)[0]   # reaped, as a shell reaps its foreground command
        left = max(bound - (time.monotonic() - sent), 1)
        _wait_for(lambda: not _job_processes(marker), left, "no process of the job left")
        gone = time.monotonic() - sent
        return output, gone, before
    finally:
        for pid in _job_processes(marker):
            os.kill(pid, 9)
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.communicate()
        assert log is None or "[rank 0] epoch 1/" in log


def _rank_0_log(job) -> str:
    return os.path.join(job.args_log_dir, "1", "rank.0", "stdout")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


STOPS = {
    # What a person does, and the exit status run.sh owes: Ctrl-C in a terminal reaches the whole foreground process
    # group; SIGTERM and SIGHUP (a closed terminal, a scheduler's stop) reach run.sh.
    "ctrl-c": (lambda job: os.killpg(job.pid, signal.SIGINT), 130, "SIGINT"),
    "sigterm": (lambda job: os.kill(job.pid, signal.SIGTERM), 143, "SIGTERM"),
    "sighup": (lambda job: os.kill(job.pid, signal.SIGHUP), 129, "SIGHUP"),
}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the job's processes through /proc")
# Ctrl-C reaches the launcher too (the whole process group), so each launcher gets it; SIGTERM and SIGHUP reach
# run.sh alone, whose one trap handles both: each is sent once, one per launcher.
@pytest.mark.parametrize("launcher, stop", [("mpirun", "ctrl-c"), ("msrun", "ctrl-c"), ("msrun", "sigterm"),
                                            ("mpirun", "sighup")])
def test_run_sh_signal_stops_every_process_of_the_job(tmp_path, launcher, stop):
    require_ranks(2)
    if launcher == "mpirun" and not _mpirun_works():
        pytest.skip("mpirun is not installed or does not start processes here (run.sh then uses msrun)")
    send, status, name = STOPS[stop]
    marker = uuid.uuid4().hex
    job = _start_job(tmp_path, launcher, marker, "--epochs", "500", "--max-steps", "3")
    job.args_log_dir = str(tmp_path / "logs")
    output, gone, before = _stop_and_time(job, marker, lambda: send(job), 10)
    # Control: the job was there to stop (launcher, scheduler or msrun's own processes, and both ranks).
    assert len(before) >= 3, before
    assert job.returncode == status, output[-3000:]
    assert f"run.sh: {name} received: stopping the job" in output and "no process of the job is left" in output
    assert re.search(r"run\.sh: saved: epoch \d+, step 3 of that epoch, on every rank", output), output[-3000:]
    assert f"run.sh: continue with: LOG_DIR={tmp_path / 'logs'} LAUNCHER={launcher} bash run.sh 2 --epochs 500 " \
           f"--max-steps 3 --resume" in output
    assert "[rank 0] epoch 1/500: step 3/1500, loss " in output   # the progress reached the terminal
    print(f"{launcher} {stop}: no process of the job left {gone:.1f} s after the signal")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the job's processes through /proc")
@pytest.mark.parametrize("launcher, guard", [("mpirun", "guard"), ("msrun", "ranks")])
def test_run_sh_killed_with_sigkill_leaves_no_orphan(tmp_path, launcher, guard):
    # run.sh killed by SIGKILL cannot stop its job: the guard it started in a session of its own does ("guard"); with
    # the guard killed too, the ranks see that run.sh is gone and stop themselves ("ranks"), and the launcher ends.
    # (Each mechanism is the same under either launcher: each runs under one, the ranks under msrun, the slower end.)
    require_ranks(2)
    if launcher == "mpirun" and not _mpirun_works():
        pytest.skip("mpirun is not installed or does not start processes here (run.sh then uses msrun)")
    marker = uuid.uuid4().hex
    job = _start_job(tmp_path, launcher, marker, "--epochs", "500", "--max-steps", "3")
    job.args_log_dir = str(tmp_path / "logs")

    def kill():
        guards = [pid for pid in _guards_of(job.pid)] if guard == "ranks" else []
        assert guard == "guard" or guards, "run.sh's guard was not found"
        os.killpg(job.pid, 9)   # run.sh and everything in its process group
        for pid in guards:
            os.kill(pid, 9)
    output, gone, before = _stop_and_time(job, marker, kill, 40)
    assert len(before) >= 3, before
    assert job.returncode == -9
    if guard == "ranks":
        # The rank that sees it first says so and stops; the launcher then stops the other (which may not get to say
        # it: under load rank 1 was first once).
        logs = [_read(os.path.join(job.args_log_dir, "1", f"rank.{rank}", "stdout")) for rank in range(2)]
        assert any("run.sh (pid" in log and "is gone: stopping this rank" in log for log in logs), logs
    print(f"{launcher}, run.sh SIGKILLed ({guard}): no process of the job left {gone:.1f} s after")


def _guards_of(run_sh_pid: int) -> list:
    """The guard run.sh started (its command line names run.sh's PID after --guard-job)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                args = handle.read().split(b"\0")
        except OSError:
            continue
        if b"--guard-job" in args and args[args.index(b"--guard-job") + 1] == str(run_sh_pid).encode():
            found.append(int(pid))
    return found


def _with_hook(tmp_path, source: str, env: dict) -> dict:
    """`env` with `source` as the sitecustomize module of every Python the job starts (first on PYTHONPATH)."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(source)
    return dict(env, PYTHONPATH=os.pathsep.join([str(hook), env.get("PYTHONPATH", "")]))


# Loaded by every Python of a job through PYTHONPATH (a sitecustomize module): each rank, once every rank's log holds
# its final line, ends with SIGSEGV on its way out, as MindSpore's CPU cluster sometimes does in its own shutdown.
_CRASH_ON_THE_WAY_OUT = """
import atexit, glob, os, signal, sys, time

def _crash_once_every_rank_finished():
    logs = os.environ["CRASH_AFTER_FINAL_LOGS"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = glob.glob(logs)
        if len(found) == int(os.environ["CRASH_AFTER_FINAL_RANKS"]) and all(
                "final loss" in open(log, errors="replace").read() for log in found):
            break
        time.sleep(0.2)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGSEGV)

if sys.argv[0].endswith("train.py") and "--validate-only" not in sys.argv and os.environ.get("MS_ROLE") != "MS_SCHED":
    atexit.register(_crash_once_every_rank_finished)
"""


def test_run_sh_crash_on_the_way_out_after_every_rank_finished_is_a_finished_run(tmp_path):
    # Every rank trains, saves and prints its final line, then dies of SIGSEGV: run.sh reports the run as done (the
    # results are complete) with a note of the launcher's status, not as FAILED. Control: a rank killed before its
    # final line fails the job (test_run_sh_killed_rank_fails_fast_with_its_log, the killed-job test).
    require_ranks(2)
    env = _with_hook(tmp_path, _CRASH_ON_THE_WAY_OUT,
                     _run_sh_env(tmp_path, "job", CRASH_AFTER_FINAL_RANKS="2",
                                 CRASH_AFTER_FINAL_LOGS=str(tmp_path / "job" / "1" / "rank.*" / "stdout")))
    done = subprocess.run(["bash", os.path.join(REPO, "run.sh"), "2", "--epochs", "1", "--max-steps", "2"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    note = re.search(r"run.sh: note: \w+ exited with status (\d+) after every rank of this node had printed its "
                     r"final line", done.stderr)
    assert note and int(note.group(1)) != 0 and "FAILED" not in done.stderr, done.stderr[-3000:]
    assert "run.sh: done." in done.stdout and done.stdout.count("final loss") >= 2, done.stdout[-3000:]
    for rank in (0, 1):
        assert (tmp_path / "job" / "checkpoints" / f"rank_{rank}" / "train-1_2.ckpt").exists()


# Loaded by every Python of a job through PYTHONPATH (a sitecustomize module): rank 1 starts training LATE_RANK_SECONDS
# after the others, as a rank still compiling its first step on a loaded machine does.
_LATE_RANK = """
import os, sys, time

if sys.argv[0].endswith("train.py") and "--validate-only" not in sys.argv and os.environ.get("MS_ROLE") != "MS_SCHED" \\
        and os.environ.get("RANK_ID") == "1":
    import mindspore
    _train = mindspore.train.Model.train

    def _late_train(self, *args, **kwargs):
        seconds = float(os.environ["LATE_RANK_SECONDS"])
        print(f"[late rank] rank 1 starts training {seconds:g} s late", flush=True)
        time.sleep(seconds)
        return _train(self, *args, **kwargs)

    mindspore.train.Model.train = _late_train
"""


@pytest.mark.skipif(suite_device() != "CPU", reason="MS_CPU_COMM_OP_TIMEOUT governs MindSpore's CPU collectives only")
def test_run_sh_waits_for_a_rank_late_to_its_first_step(tmp_path):
    # Rank 1 starts training 50 s after rank 0, which waits for it in the first step's all-gather (the replica check).
    # MindSpore's CPU collectives give up after 30 s by default; run.sh's 300 s lets the job train. Control: the same
    # lag with a 20 s wait given from outside (which run.sh keeps) fails the job in that collective.
    require_ranks(2)

    def late_job(folder: str, wait: Optional[str]) -> subprocess.CompletedProcess:
        """The job with rank 1 late; `wait` is MS_CPU_COMM_OP_TIMEOUT given from outside (None: run.sh's own, not the
        suite's from conftest.py)."""
        environment = _with_hook(tmp_path, _LATE_RANK, _run_sh_env(tmp_path, folder, LATE_RANK_SECONDS="50"))
        environment.pop("MS_CPU_COMM_OP_TIMEOUT", None)
        if wait is not None:
            environment["MS_CPU_COMM_OP_TIMEOUT"] = wait
        return subprocess.run(["bash", os.path.join(REPO, "run.sh"), "2", "--epochs", "1", "--max-steps", "2"],
                              env=environment, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)

    waited = late_job("waited", None)
    assert waited.returncode == 0, waited.stdout[-3000:] + waited.stderr[-3000:]
    late_log = _read(str(tmp_path / "waited" / "1" / "rank.1" / "stdout"))
    assert "[late rank] rank 1 starts training 50 s late" in late_log, late_log[-2000:]
    assert "run.sh: done." in waited.stdout and waited.stdout.count("] final loss") == 2, waited.stdout[-3000:]
    refused = late_job("control", "20")
    logs = "".join(_read(str(log)) for log in sorted((tmp_path / "control").glob("1/rank.*/stdout")))
    assert refused.returncode != 0 and "run.sh: FAILED" in refused.stderr + refused.stdout, \
        refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "CollectiveWait" in logs and "AllGather" in logs, logs[-3000:]


def _final_line(log) -> tuple:
    found = re.search(r"final loss ([0-9.]+) test accuracy ([0-9.]+)", log.read_text(errors="replace"))
    assert found, log.read_text(errors="replace")[-2000:]
    return float(found.group(1)), float(found.group(2))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank's process through /proc")
def test_run_sh_killed_job_resumes_and_ends_as_the_uninterrupted_run(tmp_path):
    # 2 ranks, 4 epochs of 23 steps, windows of 3 batches (AccumulatingTrainOneStepCell), a checkpoint every 5 steps.
    # One job runs through; another has rank 1 killed (SIGKILL) in epoch 2 and is resumed with --resume: the same final
    # weights on every rank (optimizer state and accumulation buffers included) and the same final lines.
    require_ranks(2)
    import mindspore as ms   # pylint: disable=import-outside-toplevel
    import numpy as np       # pylint: disable=import-outside-toplevel
    args = ["2", "--epochs", "4", "--save-steps", "5", "--accumulate-steps", "3", "--loss-every", "1"]
    done = subprocess.run(["bash", os.path.join(REPO, "run.sh"), *args], env=_run_sh_env(tmp_path, "whole"),
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    marker = uuid.uuid4().hex
    log_dir = tmp_path / "stopped"
    job = subprocess.Popen(["bash", os.path.join(REPO, "run.sh"), *args], cwd=REPO,
                           env=_run_sh_env(tmp_path, "stopped", MS_GRADACCUM_TEST_RUN=marker),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker_1 = log_dir / "1" / "rank.1" / "stdout"
    output, ended_after = _kill_rank_1_when(job, worker_1, "epoch: 2 step: 5,", marker, "rank 1 to reach epoch 2")
    assert job.returncode != 0 and "run.sh: FAILED" in output, output[-3000:]
    assert "final loss" not in worker_1.read_text(errors="replace"), "rank 1 finished before it was killed"
    assert f"run.sh: continue with: LOG_DIR={log_dir} bash run.sh {' '.join(args)} --resume" in output, output[-3000:]
    resumed = subprocess.run(["bash", os.path.join(REPO, "run.sh"), *args, "--resume"],
                             env=_run_sh_env(tmp_path, "stopped"), cwd=REPO, capture_output=True, text=True,
                             timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    steps = {}
    for rank in (0, 1):
        log = log_dir / "1" / f"rank.{rank}" / "stdout"
        found = re.search(r"resumed from \S+: global step (\d+) \(epoch (\d+), step (\d+) of 23\)",
                          log.read_text(errors="replace"))
        assert found, log.read_text(errors="replace")[-2000:]
        steps[rank] = int(found.group(1))
        # Bit for bit when the job runs alone; beside a loaded suite the resumed run's final loss was once 1e-6 off
        # (1.955755 against 1.955756, the last printed digit: MindSpore's CPU kernels under contention), so the
        # comparisons allow float32's last bits (1e-6 on weights of order 0.1-1), not a resume's mistake.
        assert abs(np.subtract(_final_line(log), _final_line(tmp_path / "whole" / "1" / f"rank.{rank}" / "stdout"))
                   ).max() <= 5e-6
        final, reference = (ms.load_checkpoint(str(folder / "checkpoints" / f"rank_{rank}" / "train-4_23.ckpt"))
                            for folder in (log_dir, tmp_path / "whole"))
        assert sorted(final) == sorted(reference)
        worst = max(float(np.abs(final[name].asnumpy() - reference[name].asnumpy()).max()) for name in reference)
        assert worst <= 1e-6, f"rank {rank}: the resumed run's final weights differ from the whole run's by {worst:g}"
    assert steps[0] == steps[1] and 23 < steps[0] < 92, steps   # one checkpoint for both ranks, in the killed epoch
    print(f"killed rank 1 at epoch 2 step 5 or later; run.sh ended {ended_after:.1f}s after the kill; resumed from "
          f"global step {steps[0]} of 92")


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_run_sh_help_prints_its_usage_and_the_samples_options_once(flag):
    done = subprocess.run(["bash", os.path.join(REPO, "run.sh"), "4", flag], capture_output=True, text=True,
                          timeout=120, check=False, env=repo_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("The main job: train the sample") == 1           # run.sh's own usage
    assert done.stdout.count("--micro-size MICRO_SIZE") == 1                   # the sample's options, once
    assert "bash run.sh 2 --resume" in done.stdout and "--save-steps SAVE_STEPS" in done.stdout   # checkpoints
    assert "worker(s) on" not in done.stdout and "FAILED" not in done.stdout   # nothing launched


def test_run_sh_rejects_bad_worker_count():
    done = subprocess.run(["bash", os.path.join(REPO, "run.sh"), "two"], capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 2
    assert "the number of workers must be a positive integer, but got 'two'" in done.stderr


def _run_sh_env(tmp_path, name, **extra):
    """run.sh's environment on the device of this test run (unless a test sets DEVICE_TARGET itself)."""
    return repo_env(**{"LOG_DIR": str(tmp_path / name), "RUN_TIMEOUT": "300", "DEVICE_TARGET": suite_device(), **extra})


# A device target this machine lacks (run.sh must refuse it before launching).
_MISSING_DEVICE = "Ascend" if suite_device() == "GPU" else "GPU"


@pytest.mark.parametrize("env, args, message", [
    (dict(NNODES="two"), [], "NNODES must be a positive integer, but got 'two'"),
    (dict(NNODES="0"), [], "NNODES must be a positive integer, but got '0'"),
    (dict(NNODES="2", NODE_RANK="-1", MASTER_PORT="8118"), [],
     "NODE_RANK must be a non-negative integer, but got '-1'"),
    (dict(NNODES="2", NODE_RANK="2", MASTER_PORT="8118"), [], "NODE_RANK must be less than NNODES=2, but got '2'"),
    (dict(MASTER_PORT="70000"), [], "MASTER_PORT must be an integer from 1 to 65535, but got '70000'"),
    (dict(NNODES="2", NODE_RANK="1"), [], "MASTER_PORT must be set (the same on every node) when NNODES=2 > 1"),
    ({}, ["--check", "--batch-size", "8", "--micro-size", "16"],
     "argument --micro-size: must be at most --batch-size (8) so that every micro-batch holds at least one sample, "
     "but got 16"),
    ({}, ["--check", "--micro-size", "0"], "argument --micro-size: must be a positive integer, but got 0"),
    (dict(DATA_PATH="/nonexistent"), [],
     "--data-path / DATA_PATH '/nonexistent' must be a folder with MNIST's four idx files (train-images-idx3-ubyte, "),
    (dict(DEVICE_TARGET="CPU"), ["--parallel-mode", "semi_auto_parallel"],
     "--parallel-mode semi_auto_parallel cannot run on CPU (MindSpore compiles these modes for GPU and Ascend only)"),
    (dict(DEVICE_TARGET=_MISSING_DEVICE), [], f"--device-target {_MISSING_DEVICE} cannot be used here: "),
    (dict(LAUNCHER="foo"), [], "LAUNCHER must be 'mpirun', 'msrun' or 'cluster', but got 'foo'."),
])
def test_run_sh_rejects_bad_settings_at_once_before_launching(tmp_path, env, args, message):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "earlier_run.txt").write_text("kept")   # what a refused run must not delete
    started = time.monotonic()
    done = subprocess.run(["bash", os.path.join(REPO, "run.sh"), "2", *args], env=_run_sh_env(tmp_path, "logs", **env),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert sorted(os.listdir(logs)) == ["earlier_run.txt"], "nothing may be launched or deleted"
    assert time.monotonic() - started < 30, "refused only after a launch"


@pytest.mark.parametrize("workers", [None])
def test_run_sh_check_passes_and_prints_the_table(tmp_path, workers):
    require_ranks(workers or 8)
    # Without a worker count, --check runs the default 8 workers.
    count = [] if workers is None else [str(workers)]
    done = subprocess.run(["bash", os.path.join(REPO, "run.sh"), *count, "--check", "--check-steps", "2"],
                          env=_run_sh_env(tmp_path, "logs", LAUNCHER="msrun"), cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^equivalence check: PASS \(tolerance", done.stdout, re.M), done.stdout
    assert len(re.findall(r"\[rank \d\] equivalence check PASS", done.stdout)) == (workers or 8)
    assert "layers.0.weight" in done.stdout


def test_run_sh_check_fails_for_batch_norm(tmp_path):
    require_ranks(2)
    done = subprocess.run(["bash", os.path.join(REPO, "run.sh"), "2", "--check", "--check-steps", "2",
                           "--check-network", "batchnorm"], env=_run_sh_env(tmp_path, "logs", LAUNCHER="msrun"),
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "equivalence check: FAIL" in done.stdout and "likely cause: batch normalisation" in done.stdout
    assert "valid tokens" not in done.stdout   # no label is ignore_index: batch normalisation is the one cause
    assert "run.sh: equivalence check FAILED" in done.stderr


def _start_node(tmp_path, node_rank, port, marker, *args, **env):
    env = _run_sh_env(tmp_path, f"node{node_rank}", NNODES="2", NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), MS_GRADACCUM_TEST_RUN=marker, **env)
    return subprocess.Popen(["bash", os.path.join(REPO, "run.sh"), "2", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _nodes_report(tmp_path, nodes, outputs) -> str:
    """Each node's exit status (with the signal's name), run.sh's output and every log's tail: what a failure says."""
    lines = []
    for node_rank, (node, output) in enumerate(zip(nodes, outputs)):
        status = node.returncode
        signal_name = signal.Signals(status - 128).name if status and 128 < status < 160 else ""
        lines.append(f"==== node {node_rank}: run.sh exit {status} {signal_name}\n{output[-1500:]}")
        folder = tmp_path / f"node{node_rank}"
        for log in sorted(folder.glob("1/rank.*/stdout")) + sorted(folder.glob("scheduler.log")):
            lines.append(f"---- {log.relative_to(tmp_path)}:\n" + "".join(
                log.read_text(errors="replace").splitlines(keepends=True)[-15:]))
    return "\n".join(lines)


def test_run_sh_two_nodes_of_two_workers_train_one_job(tmp_path):
    require_ranks(4)
    # Five MindSpore processes on this machine's two cores: under load a rank busy compiling can miss heartbeats for
    # more than run.sh's 10 s (MS_NODE_TIMEOUT), and the scheduler would then declare a live node dead. This test is
    # about one job across nodes, not failure detection (the killed-node test below, with 30 s).
    # run.sh reports a crash on the way out after every rank finished as a finished run (tested above).
    folder, port, marker = tmp_path, free_port(), uuid.uuid4().hex
    nodes = [_start_node(folder, rank, port, marker, "--epochs", "1", "--max-steps", "6", MS_NODE_TIMEOUT="60")
             for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
    assert all(node.returncode == 0 for node in nodes), _nodes_report(folder, nodes, outputs)
    finals = {}
    for node_rank, ranks in ((0, (0, 1)), (1, (2, 3))):
        for rank in ranks:
            log = (folder / f"node{node_rank}" / "1" / f"rank.{rank}" / "stdout").read_text()
            assert "mode data_parallel, 4 rank(s)" in log and "loss is" in log, log[-2000:]
            finals[rank] = re.search(r"final loss [0-9.]+ test accuracy ([0-9.]+)", log).group(1)
    assert len(set(finals.values())) == 1, finals   # identical weights on all 4 ranks


def _stopped_nodes_report(tmp_path, nodes) -> str:
    """Kills every node still running; what each node and rank printed (:func:`_nodes_report`)."""
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, 9)
    return _nodes_report(tmp_path, nodes, [node.communicate(timeout=60)[0] for node in nodes])


def _nodes_running(tmp_path, nodes, what: str) -> bool:
    """True while every node runs; fails at once, with every node's and rank's output, when one ended before `what`."""
    if any(node.poll() is not None for node in nodes):
        raise AssertionError(f"a node ended before {what}\n{_stopped_nodes_report(tmp_path, nodes)}")
    return True


def test_run_sh_killed_node_fails_the_other_node(tmp_path):
    require_ranks(4)
    port, marker = free_port(), uuid.uuid4().hex
    # 30 s, not run.sh's 10 s: under CI's load a rank busy compiling can miss heartbeats for 10 s (see the test above);
    # a dead node is still noticed well within the 90 s asserted below.
    nodes = [_start_node(tmp_path, rank, port, marker, "--epochs", "500", "--loss-every", "1", MS_NODE_TIMEOUT="30")
             for rank in (0, 1)]
    try:
        # Four ranks compile on two cores beside the suite's other workers: in one CI run rank 3 had not trained after
        # 240 s. A node that ends before then fails the test at once, with every log's tail.
        worker_3 = tmp_path / "node1" / "1" / "rank.3" / "stdout"
        what = "node 1's rank 3 to train"
        _wait_for(lambda: _nodes_running(tmp_path, nodes, what) and "loss is" in _read(str(worker_3)), 480, what,
                  report=lambda: _stopped_nodes_report(tmp_path, nodes))
        os.killpg(nodes[1].pid, 9)
        for rank in (2, 3):
            for pid in _processes_with_env(marker, rank):
                os.kill(pid, 9)
        killed_at = time.monotonic()
        output, _ = nodes[0].communicate(timeout=120)
        elapsed = time.monotonic() - killed_at
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
    assert nodes[0].returncode != 0, output[-3000:]
    assert elapsed < 90, f"node 0 took {elapsed:.0f}s to notice the dead node"
    assert "run.sh: FAILED" in output and "did not finish; last lines of" in output, output[-3000:]
    assert not _processes_with_env(marker, 0) and not _processes_with_env(marker, 1), "node 0's ranks were left running"


def _freeze(python):
    return subprocess.run([python, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, timeout=120,
                          check=True).stdout


def test_run_sh_uses_the_active_python_without_changing_it(tmp_path):
    before = _freeze(sys.executable)
    done = subprocess.run(["bash", os.path.join(REPO, "run.sh"), "1", "--epochs", "1", "--max-steps", "2"],
                          env=_run_sh_env(tmp_path, "logs", PYTHON=sys.executable), cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "installing" not in done.stdout and not (tmp_path / "venv").exists()
    assert _freeze(sys.executable) == before, "run.sh changed the active environment"
    assert f"run.sh: done. Per-rank logs: {tmp_path / 'logs'}/1/rank.0/stdout" in done.stdout, done.stdout


def test_run_sh_without_mindspore_installs_into_its_own_venv_only(tmp_path):
    # A Python without MindSpore: run.sh makes its private venv and installs there, never into that Python. Here the
    # package index is switched off, so the install fails at once, with a message naming the venv.
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    venv = tmp_path / "venv"
    done = subprocess.run(["bash", os.path.join(REPO, "run.sh"), "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False,
                          env=_run_sh_env(tmp_path, "logs", PYTHON=str(bare / "bin" / "python"), RUN_SH_VENV=str(venv),
                                          PIP_NO_INDEX="1", PIP_FIND_LINKS=""))
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"installing them into {venv} (once)" in done.stdout
    assert f"run.sh: could not install MindSpore and scikit-learn into {venv}" in done.stderr
    assert (venv / "bin" / "python").exists() and not list(bare.glob("lib/python*/site-packages/mindspore"))
    assert not (tmp_path / "logs").exists(), "nothing may be launched"


def _run(tmp_path, folder: str, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.path.join(REPO, "run.sh"), *args], env=_run_sh_env(tmp_path, folder, **env),
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def _checkpoints(folder) -> dict:
    """``{path: (size, mtime)}`` of every file under a checkpoint folder."""
    return {str(path): (path.stat().st_size, path.stat().st_mtime_ns) for path in sorted(folder.rglob("*"))
            if path.is_file()}


def _weights(folder, name: str) -> dict:
    import mindspore as ms   # pylint: disable=import-outside-toplevel
    return {key: value.asnumpy() for key, value in ms.load_checkpoint(str(folder / name)).items()}


def test_run_sh_resume_is_exact_or_refused(tmp_path):
    # A finished 2-worker run of 1 epoch (3 steps). Resumed with a setting that changes where the data stands or what
    # the state means: refused before anything starts, each change named, nothing deleted. Resumed with what does not
    # (more --epochs, another --micro-size): it goes on and ends as the uninterrupted 2-epoch run.
    require_ranks(2)
    import numpy as np   # pylint: disable=import-outside-toplevel
    base = ["--max-steps", "3", "--loss-every", "1"]
    first = _run(tmp_path, "job", "2", "--epochs", "1", *base)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saved = tmp_path / "job" / "checkpoints"
    kept = _checkpoints(saved)
    assert any(path.endswith("train-1_3.ckpt") for path in kept) and any(p.endswith("job.json") for p in kept)
    for args, changes in [
        (["4", "--epochs", "2", "--batch-size", "64", *base],
         ["workers (world size): checkpoint 2, now 4", "--batch-size: checkpoint 32, now 64"]),
        (["2", "--epochs", "2", "--accumulate-steps", "2", "--lr", "0.1", "--max-steps", "4", "--loss-every", "1"],
         ["--accumulate-steps: checkpoint 1, now 2", "--lr: checkpoint 0.01, now 0.1",
          "--max-steps: checkpoint 3, now 4"]),
    ]:
        started = time.monotonic()
        refused = _run(tmp_path, "job", *args, "--resume")
        assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert f"train.py: error: --resume: the checkpoints in {saved} were trained with other settings. Resuming " \
               "would not continue their run exactly: nothing was started or deleted." in refused.stderr
        for change in changes:
            assert f"\n  {change}\n" in refused.stderr + "\n", refused.stderr
        assert "Either resume with the checkpoint's values, or start a new run in another folder" in refused.stderr
        assert "worker(s) on" not in refused.stdout and time.monotonic() - started < 60, "refused only after a launch"
        assert _checkpoints(saved) == kept, "a refused resume changed the checkpoints"
    # Checkpoints without a record of their settings (an older sample's) are refused too.
    (tmp_path / "old").mkdir()
    for path in saved.rglob("*.ckpt"):
        target = tmp_path / "old" / "checkpoints" / path.parent.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    refused = _run(tmp_path, "old", "2", "--epochs", "2", *base, "--resume")
    assert refused.returncode == 2 and "hold no record of the settings they were trained with" in refused.stderr
    # A resume that finds nothing to resume says so on the terminal and starts from the beginning: the reference run.
    whole = _run(tmp_path, "whole", "2", "--epochs", "2", *base, "--resume")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert "[rank 0] --resume: no checkpoint that every rank completed in" in whole.stdout, whole.stdout
    # What does not change the arithmetic resumes: a second epoch, with two micro-batches a step instead of one, ends as
    # the uninterrupted 2-epoch run (control: the refused runs above; and the 1-epoch weights differ from the 2-epoch
    # ones). A resume with the same settings is bit for bit run alone: the killed-job test resumes mid-epoch (to
    # float32's last bits).
    resumed = _run(tmp_path, "job", "2", "--epochs", "2", *base, "--micro-size", "2", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "[rank 0] resumed from " in resumed.stdout and "global step 3 (epoch 1, step 3 of 3)" in resumed.stdout
    for rank in (0, 1):
        name = f"rank_{rank}/train-2_3.ckpt"
        final, reference = _weights(saved, name), _weights(tmp_path / "whole" / "checkpoints", name)
        assert sorted(final) == sorted(reference)
        worst = max(float(np.abs(final[key] - reference[key]).max()) for key in reference)
        assert worst <= 1e-6, f"rank {rank}: {worst:g} from the whole run"
        start = _weights(tmp_path / "whole" / "checkpoints", f"rank_{rank}/train-1_3.ckpt")
        assert max(float(np.abs(start[key] - reference[key]).max()) for key in reference
                   if key.startswith("layers.")) > 1e-4


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the job's processes through /proc")
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_run_sh_refuses_a_folder_a_running_job_uses_and_not_one_a_dead_job_left(tmp_path, launcher):
    # A second run.sh on the LOG_DIR of a running job refuses before touching it, naming the job and the way to run
    # both; the first trains on, its logs in place. Once that job is dead (run.sh killed with SIGKILL: its guard stops
    # the ranks), its folder blocks nothing (the control: the same command then runs).
    require_ranks(2)
    if launcher == "mpirun" and not _mpirun_works():
        pytest.skip("mpirun is not installed or does not start processes here (run.sh then uses msrun)")
    marker = uuid.uuid4().hex
    env = _run_sh_env(tmp_path, "logs", LAUNCHER=launcher, MS_GRADACCUM_TEST_RUN=marker)
    first = subprocess.Popen(["bash", os.path.join(REPO, "run.sh"), "2", "--epochs", "500", "--loss-every", "1"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rank_0 = tmp_path / "logs" / "1" / "rank.0" / "stdout"
    second_command = ["bash", os.path.join(REPO, "run.sh"), "2", "--epochs", "1", "--max-steps", "2"]
    try:
        _wait_for(lambda: _still_running(first, "rank 0 to train") and "loss is" in _read(str(rank_0)), 240,
                  "rank 0 to train", report=lambda: _log_tail(rank_0))
        second = subprocess.run(second_command, cwd=REPO, env=_run_sh_env(tmp_path, "logs", LAUNCHER=launcher),
                                capture_output=True, text=True, timeout=120, check=False)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"run.sh: LOG_DIR {tmp_path / 'logs'} is in use by a job that is running: PID {first.pid} on " \
            in second.stderr, second.stderr
        assert "bash " + os.path.join(REPO, "run.sh") + " 2 --epochs 500 --loss-every 1" in second.stderr
        assert "LOG_DIR=<another folder> bash " in second.stderr and "nothing was touched" in second.stderr
        assert "worker(s) on" not in second.stdout                                  # nothing launched
        before = _read(str(rank_0))
        _wait_for(lambda: _still_running(first, "more steps") and len(_read(str(rank_0))) > len(before), 120,
                  "the first job to train on", report=lambda: _log_tail(rank_0))
        os.kill(first.pid, signal.SIGKILL)
        first.communicate(timeout=60)
        _wait_for(lambda: not _job_processes(marker), 60, "the guard to stop the dead job's ranks")
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    again = subprocess.run(second_command, cwd=REPO, env=_run_sh_env(tmp_path, "logs", LAUNCHER=launcher),
                           capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0 and "run.sh: done." in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]


def test_run_sh_started_elsewhere_prints_paths_and_commands_that_work_there(tmp_path):
    # From another folder (bash <checkout>/run.sh, a relative LOG_DIR): the folder is where the user stands, and every
    # path and the command to go on are as typed from there; that command runs. Control: the checkout's own name for
    # it (bash run.sh) does not exist there.
    require_ranks(2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _run_sh_env(tmp_path, "unused")
    env["LOG_DIR"] = "mylogs"
    run_sh = os.path.join(REPO, "run.sh")
    done = subprocess.run(["bash", run_sh, "2", "--epochs", "1", "--max-steps", "2"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "logs in mylogs/," in done.stdout and (elsewhere / "mylogs" / "1" / "rank.0" / "stdout").is_file()
    assert "Per-rank logs: mylogs/1/rank.0/stdout ... mylogs/1/rank.1/stdout" in done.stdout, done.stdout
    found = re.search(r"go on with more epochs: (.*) --epochs N;", done.stdout)
    assert found and found.group(1) == f"LOG_DIR=mylogs bash {run_sh} 2 --max-steps 2 --resume", done.stdout
    assert not (elsewhere / "run.sh").exists() and not (tmp_path / "unused").exists()
    again = subprocess.run(["bash", "-c", found.group(1) + " --epochs 2"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0 and "[rank 0] resumed from" in again.stdout, again.stdout[-3000:] + again.stderr
