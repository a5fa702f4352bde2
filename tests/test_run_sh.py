"""run.sh, the main job's launcher: a rank that dies makes it fail fast, loudly, never hang."""
import os
import re
import subprocess
import time
import uuid

import pytest

from probe import REPO


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


LAUNCHERS = {
    # launcher: (rank 1's log, what the launcher says about a rank killed with signal 9)
    "msrun": ("worker_1.log", r"Worker process \d+ exit with exception\. Error code: -9"),
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
    if launcher == "mpirun" and not _mpirun_works():
        pytest.skip("mpirun is not installed or does not start processes here (run.sh then uses msrun)")
    rank_1_log, launcher_says = LAUNCHERS[launcher]
    marker = uuid.uuid4().hex
    log_dir = tmp_path / "logs"
    env = dict(os.environ, MS_GRADACCUM_TEST_RUN=marker, LOG_DIR=str(log_dir), LAUNCHER=launcher, RUN_TIMEOUT="300",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    job = subprocess.Popen(["bash", os.path.join(REPO, "run.sh"), "2", "--epochs", "500", "--loss-every", "1"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        worker_1 = log_dir / rank_1_log
        _wait_for(lambda: worker_1.exists() and "loss is" in worker_1.read_text(errors="replace"), 240,
                  "rank 1 to start training")
        pids = _processes_with_env(marker, 1)
        assert len(pids) == 1, f"expected one rank-1 process, found {pids}"
        os.kill(pids[0], 9)
        killed_at = time.monotonic()
        output, _ = job.communicate(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode != 0, output
    assert elapsed < 60, f"run.sh took {elapsed:.0f}s to notice the dead rank"
    assert "run.sh: FAILED" in output
    assert re.search(launcher_says, output), output
    assert "rank 1 did not finish; last lines of" in output and "loss is" in output
    assert not _processes_with_env(marker, 0), "rank 0 was left running"


def test_run_sh_rejects_bad_worker_count():
    done = subprocess.run(["bash", os.path.join(REPO, "run.sh"), "two"], capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 2
    assert "the number of workers must be a positive integer, but got 'two'" in done.stderr
