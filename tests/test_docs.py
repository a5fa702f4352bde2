"""The examples users copy are executed: the class docstring (doctest) and the README's API example."""
import doctest
import os
import re
import subprocess
import sys

import ms_gradaccum._cell
from probe import REPO


def test_docs_docstring_examples_run():
    result = doctest.testmod(ms_gradaccum._cell, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0, result


def test_docs_readme_api_example_runs(tmp_path):
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), re.S)
    examples = [block for block in blocks if "import mindspore as ms" in block]
    assert len(examples) == 1, "expected one self-contained python example in the README"
    script = tmp_path / "readme_example.py"  # a real file: MindSpore's graph parser reads the source
    script.write_text(examples[0], encoding="utf-8")
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(v) for v in re.findall(r"^\d+ ([0-9.]+)$", done.stdout, re.M)]
    assert len(losses) == 3 and losses[2] < losses[0], done.stdout
