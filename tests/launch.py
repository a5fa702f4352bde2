"""Starts a script on several local ranks with MindSpore's real launcher (msrun), on a free port, with a
bounded wait; a failure raises with every rank's log tail."""
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Tuple

from probe import REPO


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: str, lines: int = 30) -> str:
    if not os.path.exists(path):
        return f"---- {path}: no log\n"
    with open(path, encoding="utf-8", errors="replace") as handle:
        return f"---- {path}:\n" + "".join(handle.readlines()[-lines:])


def msrun(script: str, args: List[str], workers: int, log_dir: str, timeout: float = 240, **env: str) -> None:
    """Run ``script args`` on ``workers`` ranks, with `env` added to the environment; raise AssertionError with
    the logs if any rank fails."""
    msrun_bin = os.path.join(os.path.dirname(sys.executable), "msrun")
    command = [msrun_bin if os.path.exists(msrun_bin) else "msrun", f"--worker_num={workers}",
               f"--local_worker_num={workers}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               f"--log_dir={log_dir}", "--join=True", "--cluster_time_out=60", script, *args]
    env = dict(os.environ, GLOG_v="3", MS_NODE_TIMEOUT="10", **env,
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
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
