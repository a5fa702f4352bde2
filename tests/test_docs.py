"""The examples users copy are executed: the class docstring (doctest) and the README's API example."""
import doctest
import os
import re
import subprocess
import sys

import pytest

import ms_gradaccum._cell
import ms_gradaccum._scheduler
import ms_gradaccum._steps
from probe import REPO


@pytest.mark.parametrize("module", [ms_gradaccum._cell, ms_gradaccum._steps, ms_gradaccum._scheduler])
def test_docs_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 2 and result.failed == 0, result


def _readme_examples():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), re.S)
    return [block for block in blocks if "import mindspore as ms" in block]


def _run_example(tmp_path, source):
    script = tmp_path / "readme_example.py"  # a real file: MindSpore's graph parser reads the source
    script.write_text(source, encoding="utf-8")
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_docs_readme_has_four_self_contained_examples():
    assert len(_readme_examples()) == 4


def test_docs_readme_micro_batch_example_runs(tmp_path):
    output = _run_example(tmp_path, _readme_examples()[0])
    losses = [float(v) for v in re.findall(r"^\d+ ([0-9.]+)$", output, re.M)]
    assert len(losses) == 3 and losses[2] < losses[0], output


def test_docs_readme_accumulating_steps_example_runs(tmp_path):
    output = _run_example(tmp_path, _readme_examples()[3])
    assert "optimizer steps: 11" in output, output
    assert len(re.findall(r"loss is ", output)) == 6, output  # LossMonitor(5) over 3 epochs of 10 batches


def test_docs_readme_token_loss_example_runs(tmp_path):
    output = _run_example(tmp_path, _readme_examples()[2])
    assert re.search(r"^token mean loss: [0-9.]+$", output, re.M), output


def test_docs_readme_mixed_precision_example_runs(tmp_path):
    output = _run_example(tmp_path, _readme_examples()[1])
    assert len(re.findall(r"loss is ", output)) == 4, output   # LossMonitor(2) over 2 epochs of 4 batches
    assert "loss scale: 4096.0" in output, output
