import os
import sys

import mindspore as ms
import pytest

# Tests import helpers (tests/) and tools (tests/tools: launchers, workers) by module name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))

# MindSpore's cluster (msrun, and run.sh's ranks) retries messages and sends heartbeats every 3-5 s by default
# (MS_RETRY_INTERVAL_LOWER/UPPER, documented, in whole seconds), so every local multi-process test waited
# seconds to start and to shut down. Its local clusters need no such spacing; a setting from outside wins.
os.environ.setdefault("MS_RETRY_INTERVAL_LOWER", "1")
os.environ.setdefault("MS_RETRY_INTERVAL_UPPER", "1")
# Its CPU collectives give up on a peer after 30 s (MS_CPU_COMM_OP_TIMEOUT): ranks compiling side by side beside the
# suite's other workers can lag by more. run.sh sets 300 s for the same reason (test_run_sh.py tests its own setting).
os.environ.setdefault("MS_CPU_COMM_OP_TIMEOUT", "300")

from launch import DEVICE_COUNT_ENV, DEVICE_ENV, INSTALLED_ENV, REPO  # noqa: E402  (tests/tools is on sys.path)


def pytest_addoption(parser):
    parser.addoption("--device", default="CPU", choices=("CPU", "GPU", "Ascend"),
                     help="the device the whole suite runs on, this process and every process it starts (default CPU)")
    parser.addoption("--device-count", type=int, default=None,
                     help="how many devices of --device this machine has, for the tests that start several ranks "
                          "(one rank per device: NCCL/HCCL refuse two on one). Default: 1 on GPU/Ascend; on CPU "
                          "ranks are processes and are not limited")


def pytest_configure(config):
    device, count = config.getoption("--device"), config.getoption("--device-count")
    if count is not None and count < 1:
        raise pytest.UsageError(f"--device-count must be a positive integer, but got {count}")
    try:   # before any test module is imported: module-level skips read the device
        ms.set_context(device_target=device)
    except (RuntimeError, ValueError) as error:
        raise pytest.UsageError(f"--device {device} cannot be used here: {str(error).splitlines()[0]}") from None
    if os.environ.get(INSTALLED_ENV):
        # The installed package is under test (CI's wheel run): a checkout importable from here would hide a module
        # the wheel lacks.
        import ms_gradaccum  # pylint: disable=import-outside-toplevel
        if os.path.dirname(os.path.abspath(ms_gradaccum.__file__)) == os.path.join(REPO, "ms_gradaccum"):
            raise pytest.UsageError(f"{INSTALLED_ENV} is set, but ms_gradaccum is imported from the checkout "
                                    f"({ms_gradaccum.__file__}), not the installed package: run pytest from another "
                                    f"folder, without the checkout on PYTHONPATH")
    # Inherited by every process the tests start (tests/tools, benchmarks/worker.py, the sample, run.sh's ranks).
    os.environ[DEVICE_ENV] = device
    os.environ[DEVICE_COUNT_ENV] = str(count or 1)


# The files that take longest, longest first (seconds of test time here, measured with --durations=0 on 2 cores).
# pytest-xdist's loadfile hands files to the workers in this order only with --no-loadscope-reorder (pyproject.toml):
# by default it sorts them by their number of tests, which put test_bench.py (185 s, 3 tests) last, on one worker
# while the other had finished and waited (3 min of 25). Longest first, the short files fill in at the end.
COSTLIEST_FIRST = ("test_run_sh.py", "test_bench.py", "test_contract.py", "test_mindcv.py", "test_mindformers.py",
                   "test_data_parallel.py", "test_tokens.py", "test_real_models.py", "test_bprop.py", "test_sample.py",
                   "test_mindone.py", "test_trainable.py", "test_graph.py", "test_memory.py", "test_steps.py",
                   "test_cell.py", "test_docs.py", "test_loss_scale.py", "test_scheduler.py", "test_batches.py",
                   "test_overflow.py", "test_inputs.py", "test_kinds.py", "test_validation.py", "test_clipping.py")


# pytest-xdist's hook, optional: without pytest-xdist the suite collects (-p no:xdist -o addopts="").
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """How many workers ``-n auto`` (pyproject.toml) starts: pytest-xdist's own count (one per core) and one more, up
    to ``--maxprocesses``. The worker that runs ``test_run_sh.py`` spends 12 min mostly waiting on its jobs (a 2-rank
    ``run.sh`` job used 19.5 s of CPU in 33.5 s), so on 2 cores a third worker fills that time (CONTRIBUTING.md has
    the times). Where ``PYTEST_XDIST_AUTO_NUM_WORKERS`` is set, pytest-xdist reads it as it always does."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None   # the next implementation of this hook, pytest-xdist's, answers
    from xdist.plugin import pytest_xdist_auto_num_workers as xdist_count  # pylint: disable=import-outside-toplevel
    return xdist_count(config) + 1


def pytest_collection_modifyitems(session, config, items):   # pylint: disable=unused-argument
    """Runs the costliest files first (:data:`COSTLIEST_FIRST`), the others after them in their usual order."""
    rank = {name: index for index, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))


@pytest.fixture(autouse=True)
def graph_mode():
    """Every test starts in GRAPH_MODE, stand-alone; tests that change the mode restore it here."""
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=ms.GRAPH_MODE)


def pytest_unconfigure(config):   # pylint: disable=unused-argument
    """Cells still alive at interpreter exit (MindSpore's graph executor keeps compiled cells referenced) are deleted
    during teardown, after their module's globals were cleared, and MindSpore's ``Cell.__del__`` reads those globals:
    each printed "Exception ignored in: <function Cell.__del__> ... 'NoneType' object has no attribute
    'total_instance_count'" after the suite's summary (95 of them). At the end of the session ``Cell.__del__`` gets its
    own copy of its module's globals, so it releases what it holds as it does during the run, and prints nothing."""
    import types   # pylint: disable=import-outside-toplevel
    from mindspore.nn import cell as cell_module   # pylint: disable=import-outside-toplevel
    delete = cell_module.Cell.__del__
    cell_module.Cell.__del__ = types.FunctionType(delete.__code__, dict(cell_module.__dict__), delete.__name__,
                                                  delete.__defaults__, delete.__closure__)
