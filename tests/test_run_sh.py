"""run.sh, the main job's launcher: a rank that dies makes it fail fast, loudly, never hang."""
import os
import re
import signal
import subprocess
import sys
import time
import uuid

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


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)


def _kill_rank_1_when(job, worker_1, text: str, marker: str, what: str) -> tuple:
    """Waits until rank 1's log holds `text`, kills rank 1 with SIGKILL and waits for run.sh: ``(its output, seconds
    from the kill to its end)``. run.sh is killed if it is still running when this ends."""
    try:
        _wait_for(lambda: worker_1.exists() and text in worker_1.read_text(errors="replace"), 240, what)
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
    assert f"continue from the newest with the same command and --resume (bash run.sh {' '.join(args)} --resume)" \
        in output, output[-3000:]
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
        assert abs(np.subtract(_final_line(log), _final_line(tmp_path / "whole" / "1" / f"rank.{rank}" / "stdout"))
                   ).max() <= 1e-6
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
    port, marker = free_port(), uuid.uuid4().hex
    # Five MindSpore processes on this machine's two cores: under load a rank busy compiling can miss heartbeats for
    # more than run.sh's 10 s (MS_NODE_TIMEOUT), and the scheduler would then declare a live node dead. This test is
    # about one job across nodes, not failure detection (the killed-node test below keeps 10 s).
    nodes = [_start_node(tmp_path, rank, port, marker, "--epochs", "1", "--max-steps", "6", MS_NODE_TIMEOUT="60")
             for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
    assert all(node.returncode == 0 for node in nodes), _nodes_report(tmp_path, nodes, outputs)
    finals = {}
    for node_rank, ranks in ((0, (0, 1)), (1, (2, 3))):
        for rank in ranks:
            log = (tmp_path / f"node{node_rank}" / "1" / f"rank.{rank}" / "stdout").read_text()
            assert "mode data_parallel, 4 rank(s)" in log and "loss is" in log, log[-2000:]
            finals[rank] = re.search(r"final loss [0-9.]+ test accuracy ([0-9.]+)", log).group(1)
    assert len(set(finals.values())) == 1, finals   # identical weights on all 4 ranks


def test_run_sh_killed_node_fails_the_other_node(tmp_path):
    require_ranks(4)
    port, marker = free_port(), uuid.uuid4().hex
    nodes = [_start_node(tmp_path, rank, port, marker, "--epochs", "500", "--loss-every", "1") for rank in (0, 1)]
    try:
        worker_3 = tmp_path / "node1" / "1" / "rank.3" / "stdout"
        _wait_for(lambda: worker_3.exists() and "loss is" in worker_3.read_text(errors="replace"), 240,
                  "node 1's rank 3 to start training")
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
