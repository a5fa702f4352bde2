"""Package metadata for ms_gradaccum; declarative, no side effects."""
import pathlib
import re

from setuptools import find_packages, setup

_INIT = pathlib.Path(__file__).parent / "ms_gradaccum" / "__init__.py"
_VERSION = re.search(r'^__version__ = "([^"]+)"', _INIT.read_text(), re.M).group(1)

setup(
    name="ms_gradaccum",
    version=_VERSION,
    description="Gradient accumulation for MindSpore: the full-batch update on micro-batch memory.",
    long_description=(pathlib.Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ms_gradaccum", "ms_gradaccum.*"]),
    python_requires=">=3.9",
    install_requires=[
        # The range tested in CI: the whole suite on 2.10.0, its core on 2.7.0 (ms_gradaccum/_internals.py).
        "mindspore>=2.7.0,<2.11",
        # MindSpore's extension is built against NumPy 1.x: with NumPy 2 the first PyNative
        # Tensor.reshape raises "numpy.core.multiarray failed to import" (measured on 2.10.0).
        "numpy>=1.25,<2",
    ],
    extras_require={
        "test": ["pytest>=7"],
        "sample": ["scikit-learn"],
        "bench": ["matplotlib"],
        # Optional: the benchmark's cross-framework rows (skipped, saying so, without it).
        "torch": ["torch==2.13.0"],
    },
)
