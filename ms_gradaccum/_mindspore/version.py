"""The MindSpore versions the package supports, and what differs between them.

Every adapter in this package was read in the installed source of, and tested against, the lowest and the highest of
:data:`CHECKED_VERSIONS` (CI runs the whole suite on the highest and the core of it on the lowest).
"""
import re
from typing import Tuple

import mindspore as ms

CHECKED_VERSIONS = ("2.7.0", "2.8.0", "2.9.0", "2.10.0")
SUPPORTED = ((2, 7, 0), (2, 11, 0))   # lowest supported, first unsupported
SUPPORTED_TEXT = "mindspore>=2.7.0,<2.11"


def mindspore_version(text: str = ms.__version__) -> Tuple[int, int, int]:
    """``(major, minor, patch)`` of a MindSpore version string such as ``2.10.0`` or ``2.9.0rc1``."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if found is None:
        raise ImportError(f"ms_gradaccum cannot read the installed MindSpore's version {text!r}; it supports "
                          f"{SUPPORTED_TEXT}.")
    return int(found.group(1)), int(found.group(2)), int(found.group(3) or 0)


def check_mindspore_version(text: str = ms.__version__) -> None:
    """An ImportError naming the installed and the supported versions, before anything compiles."""
    if not SUPPORTED[0] <= mindspore_version(text) < SUPPORTED[1]:
        raise ImportError(
            f"ms_gradaccum supports {SUPPORTED_TEXT}, but MindSpore {text} is installed; the cells rely on MindSpore "
            f"internals checked against {', '.join(CHECKED_VERSIONS)}. Install a supported version, e.g. "
            f"pip install '{SUPPORTED_TEXT}'.")



# In graph mode, `p /= d` on a Parameter writes p in place (InplaceDiv) from MindSpore 2.8 on (checked 2.8.0, 2.9.0,
# 2.10.0); in 2.7.0 it makes a new tensor and leaves p unchanged, so the buffers are written with ops.assign there.
# MindSpore drops such an in-place kernel when nothing reads its output: callers make what follows depend on it.
AUGMENTED_ASSIGNMENT_IN_PLACE = mindspore_version() >= (2, 8, 0)
