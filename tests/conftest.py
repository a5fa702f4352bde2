import os
import sys

import mindspore as ms
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def graph_mode():
    """Every test starts in GRAPH_MODE, stand-alone; tests that change the mode restore it here."""
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=ms.GRAPH_MODE)
