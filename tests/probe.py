"""Runs tests/train_probe.py in a fresh process with a chosen environment; shared by the subprocess tests."""
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def run_train_probe(kind: str, micro_size: int, batch: int, model: str = "mlp", **env: str) -> str:
    """Return the probe's combined output; fail with its tail if it exits non-zero."""
    full_env = dict(os.environ, GLOG_v="2", **env,
                    PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, os.path.join(TESTS, "train_probe.py"), kind, str(micro_size), str(batch),
                           model],
                          env=full_env, capture_output=True, text=True, timeout=300, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"train_probe {kind} {micro_size} {batch} failed:\n{output[-3000:]}"
    return output
