"""Starting processes for the tests: scripts on several local ranks with MindSpore's real launcher (msrun, on a free
port, bounded wait, every rank's log tail on failure), and one configuration of benchmarks/worker.py in a fresh
process (the tests' probe: memory, compiled graphs)."""
import json
import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Tuple

# The device the suite runs on (pytest --device, set by tests/conftest.py) and how many of it there are; read by the
# processes the tests start. benchmarks/worker.py reads the same variable.
DEVICE_ENV = "MS_GRADACCUM_DEVICE"
DEVICE_COUNT_ENV = "MS_GRADACCUM_DEVICE_COUNT"
# Set (to 1) where the suite tests the installed package (CI's wheel run): the processes it starts import that one too.
INSTALLED_ENV = "MS_GRADACCUM_TEST_INSTALLED"

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(TOOLS))
WORKER = os.path.join(REPO, "benchmarks", "worker.py")


def repo_env(**extra: str) -> Dict[str, str]:
    """The environment of a child process: this one's, `extra`, and the checkout first on PYTHONPATH (unless the
    suite tests the installed package)."""
    if os.environ.get(INSTALLED_ENV):
        return dict(os.environ, **extra)
    return dict(os.environ, **extra, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))


def suite_device() -> str:
    """The device of this test run: ``pytest --device`` (default CPU)."""
    return os.environ.get(DEVICE_ENV, "CPU")


def require_ranks(ranks: int) -> None:
    """Skip the calling test when it needs more ranks than this machine has devices: on GPU/Ascend one rank per device
    (NCCL and HCCL refuse two ranks on one device); on CPU ranks are processes."""
    device = suite_device()
    available = int(os.environ.get(DEVICE_COUNT_ENV, "1"))
    if device != "CPU" and ranks > available:
        import pytest  # pylint: disable=import-outside-toplevel
        pytest.skip(f"needs {ranks} ranks, one per {device}, but this run has {available} (--device-count): NCCL "
                    f"and HCCL refuse two ranks on one device")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: str, lines: int = 30) -> str:
    if not os.path.exists(path):
        return f"---- {path}: no log\n"
    with open(path, encoding="utf-8", errors="replace") as handle:
        return f"---- {path}:\n" + "".join(handle.readlines()[-lines:])


def msrun(script: str, args: List[str], workers: int, log_dir: str, timeout: float = 600, **env: str) -> None:
    """Run ``script args`` on ``workers`` ranks, with `env` added to the environment; raise AssertionError with
    the logs if any rank fails (or after `timeout` seconds: 600, because three 2-rank jobs side by side on 2 cores
    took 176 s here on the lowest MindSpore and went past an earlier 240 s bound in CI). Skips the test where the
    device cannot hold that many ranks (:func:`require_ranks`)."""
    require_ranks(workers)
    msrun_bin = os.path.join(os.path.dirname(sys.executable), "msrun")
    command = [msrun_bin if os.path.exists(msrun_bin) else "msrun", f"--worker_num={workers}",
               f"--local_worker_num={workers}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               f"--log_dir={log_dir}", "--join=True", "--cluster_time_out=60", script, *args]
    try:
        done = subprocess.run(command, env=repo_env(GLOG_v="3", MS_NODE_TIMEOUT="10", **env), capture_output=True,
                              text=True, timeout=timeout, check=False)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        status, output = f"timeout after {timeout}s", f"{expired.stdout or ''}{expired.stderr or ''}"
        subprocess.run(["pkill", "-f", script], check=False)
    if status != 0:
        logs = "".join(_tail(os.path.join(log_dir, f"worker_{rank}.log")) for rank in range(workers))
        raise AssertionError(f"msrun {os.path.basename(script)} {' '.join(args)} failed ({status}):\n"
                             f"{output[-2000:]}\n{logs}{_tail(os.path.join(log_dir, 'scheduler.log'))}")


def side_by_side(calls: Dict[str, Tuple[Callable, tuple]]) -> Dict[str, Any]:
    """``{name: function(*args)}`` for ``calls = {name: (function, args)}``, all started at once; the first
    failure is re-raised. For independent msrun jobs (their own processes, free ports and log folders): most of a
    2-rank job is start-up and cluster set-up, not computing, so side by side they take much less time."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(function, *args) for name, (function, args) in calls.items()}
        return {name: future.result() for name, future in futures.items()}


def _bench_result(output: str) -> Tuple[Dict[str, Any], str]:
    found = re.search(r"^BENCH (\{.*\})$", output, re.M)
    assert found, f"benchmarks/worker.py printed no result:\n{output[-3000:]}"
    return json.loads(found.group(1)), output


def run_worker(model: str, kind: str, micro_size: int, batch: int, steps: int = 2,
               **env: str) -> Tuple[Dict[str, Any], str]:
    """One configuration of benchmarks/worker.py in a fresh process: ``(its BENCH result, its whole output)``;
    fails with the output's tail if it exits non-zero."""
    done = subprocess.run([sys.executable, WORKER, "mindspore", model, kind, str(micro_size), str(batch), str(steps)],
                          env=repo_env(GLOG_v="2", **env), capture_output=True, text=True, timeout=300, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"worker {model} {kind} {micro_size} {batch} failed:\n{output[-3000:]}"
    return _bench_result(output)


def run_worker_ranks(model: str, kind: str, micro_size: int, batch: int, log_dir: str, steps: int = 2,
                     **env: str) -> Tuple[Dict[str, Any], str]:
    """The same on 2 data-parallel ranks started by msrun: rank 0's result and output."""
    msrun(WORKER, ["mindspore", model, kind, str(micro_size), str(batch), str(steps)], 2, log_dir,
          DATA_PARALLEL="1", **env)
    with open(os.path.join(log_dir, "worker_0.log"), encoding="utf-8", errors="replace") as handle:
        return _bench_result(handle.read())


def import_without(module: str, hidden: str) -> str:
    """In a fresh process: ``import ms_gradaccum`` must leave the third-party package `hidden` unimported; then, with
    `hidden` made unimportable, ``import module``. Returns the ImportError's message (fails if the import worked)."""
    code = (f"import sys, ms_gradaccum; assert {hidden!r} not in sys.modules, 'ms_gradaccum imported {hidden}'\n"
            f"sys.modules[{hidden!r}] = None   # as if not installed\n"
            f"try:\n    import {module}\nexcept ImportError as error:\n    print('IMPORT ERROR:', error)\n")
    done = subprocess.run([sys.executable, "-c", code], env=repo_env(GLOG_v="3"), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "IMPORT ERROR:" in done.stdout, f"import {module} worked without {hidden}: {done.stdout[-2000:]}"
    return done.stdout
