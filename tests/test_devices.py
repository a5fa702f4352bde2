"""The suite's device switch: ``pytest --device {CPU,GPU,Ascend}`` (default CPU) selects the device for this process and
every process the tests start; tests that need several ranks skip where the device cannot hold them."""
import os
import re
import subprocess
import sys
import time

import mindspore as ms
import pytest

from launch import DEVICE_COUNT_ENV, DEVICE_ENV, REPO, repo_env, require_ranks, suite_device


def test_devices_the_selected_device_is_in_force_here_and_for_child_processes():
    assert ms.get_context("device_target") == suite_device()
    assert os.environ[DEVICE_ENV] == suite_device()
    done = subprocess.run([sys.executable, "-c", "import os; print(os.environ['MS_GRADACCUM_DEVICE'])"],
                          env=repo_env(), capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == suite_device()


@pytest.mark.slow
@pytest.mark.parametrize("option, message", [
    (["--device", "Ascend" if suite_device() == "GPU" else "GPU"], r"--device (GPU|Ascend) cannot be used here: "
                                                                 r"Unsupported device target"),
    (["--device-count", "0"], r"--device-count must be a positive integer, but got 0"),
    (["--device", "TPU"], r"argument --device: invalid choice: 'TPU'"),
])
def test_devices_a_device_the_machine_lacks_fails_at_once_with_the_reason(option, message):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *option,
                           os.path.join(REPO, "tests", "test_microbatch.py")], cwd=REPO, env=repo_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]   # pytest's usage error: no test ran
    assert re.search(message, done.stderr), done.stderr[-2000:]
    assert "passed" not in done.stdout
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("device, count, ranks, skipped", [
    ("CPU", "1", 8, False),    # ranks are processes
    ("GPU", "1", 2, True),     # NCCL refuses two ranks on one GPU
    ("GPU", "8", 8, False),
    ("Ascend", "4", 8, True),
    ("GPU", "1", 1, False),
])
def test_devices_several_ranks_skip_where_the_device_cannot_hold_them(monkeypatch, device, count, ranks, skipped):
    monkeypatch.setenv(DEVICE_ENV, device)
    monkeypatch.setenv(DEVICE_COUNT_ENV, count)
    if skipped:
        with pytest.raises(pytest.skip.Exception, match=rf"needs {ranks} ranks, one per {device}, but this run has "
                                                        rf"{count} \(--device-count\)"):
            require_ranks(ranks)
    else:
        require_ranks(ranks)
