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


@pytest.fixture(autouse=True)
def graph_mode():
    """Every test starts in GRAPH_MODE, stand-alone; tests that change the mode restore it here."""
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=ms.GRAPH_MODE)
