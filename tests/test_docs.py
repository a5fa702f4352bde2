"""The examples users copy are executed: the docstrings (doctest) and every README example, by name."""
import doctest
import glob
import os
import re
import subprocess
import sys

import pytest

import ms_gradaccum.cells.grad_accumulation
import ms_gradaccum.cells.scheduler
import ms_gradaccum.cells.accumulating
from launch import REPO, msrun, repo_env, suite_device

EXAMPLES = ("one_device", "across_steps", "mixed_precision", "token_loss", "data_parallel", "semi_auto", "check")


@pytest.mark.parametrize("module", [ms_gradaccum.cells.grad_accumulation, ms_gradaccum.cells.accumulating,
                                    ms_gradaccum.cells.scheduler])
def test_docs_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 2 and result.failed == 0, result


def _readme_examples() -> dict:
    """``{name: source}`` of every ```python block of the README; each must start with ``# example: <name>``."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), re.S)
    examples = {}
    for block in blocks:
        named = re.match(r"# example: (\w+)\n", block)
        assert named, f"a README python block without '# example: <name>':\n{block[:200]}"
        examples[named.group(1)] = block
    return examples


def _as_script(name: str) -> str:
    """The example as written, on the device of this test run (the examples name none: MindSpore's default)."""
    device = suite_device()
    preamble = "" if device == "CPU" else f"import mindspore\nmindspore.set_context(device_target={device!r})\n"
    return preamble + _readme_examples()[name]


def test_docs_readme_examples_are_all_named_and_tested():
    assert sorted(_readme_examples()) == sorted(EXAMPLES)


def _run(tmp_path, name):
    script = tmp_path / f"{name}.py"   # a real file: MindSpore's graph parser reads the source
    script.write_text(_as_script(name), encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], env=repo_env(GLOG_v="3"), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_docs_design_adapter_example_runs(tmp_path):
    """docs/design.md, "Writing an adapter": the example subclass uses only the hooks, trains the full batch's update,
    keeps its state under the optimizer, and skips a window when its transform says so (the example asserts it)."""
    with open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8") as handle:
        blocks = re.findall(r"```python\n(# example: adapter\n.*?)```", handle.read(), re.S)
    assert len(blocks) == 1
    assert not re.search(r"(\bself|super\(\))\._(?!_)", blocks[0]), "the adapter example uses an underscore member"
    script = tmp_path / "adapter.py"
    script.write_text(blocks[0], encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], env=repo_env(GLOG_v="3"), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0 and "adapter example ok" in done.stdout, done.stdout + done.stderr


def test_docs_readme_one_device_example_runs(tmp_path):
    losses = [float(v) for v in re.findall(r"^\d+ ([0-9.]+)$", _run(tmp_path, "one_device"), re.M)]
    assert len(losses) == 3 and losses[2] < losses[0], losses


@pytest.mark.slow
def test_docs_readme_across_steps_example_runs(tmp_path):
    output = _run(tmp_path, "across_steps")
    assert "optimizer steps: 11" in output, output
    assert len(re.findall(r"loss is ", output)) == 6, output   # LossMonitor(5) over 3 epochs of 10 batches


@pytest.mark.slow
def test_docs_readme_mixed_precision_example_runs(tmp_path):
    output = _run(tmp_path, "mixed_precision")
    assert len(re.findall(r"loss is ", output)) == 4, output   # LossMonitor(2) over 2 epochs of 4 batches
    assert "loss scale: 4096.0" in output, output


@pytest.mark.slow
def test_docs_readme_token_loss_example_runs(tmp_path):
    assert re.search(r"^token mean loss: [0-9.]+$", _run(tmp_path, "token_loss"), re.M)


@pytest.mark.slow
def test_docs_readme_semi_auto_example_runs_stand_alone_on_one_process(tmp_path):
    assert len(re.findall(r"loss is ", _run(tmp_path, "semi_auto"))) == 2


def test_docs_readme_check_example_runs(tmp_path):
    assert "equivalence check: PASS" in _run(tmp_path, "check")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_docs_readme_data_parallel_example_runs_on_two_ranks(tmp_path):
    script = tmp_path / "data_parallel.py"
    script.write_text(_as_script("data_parallel"), encoding="utf-8")
    msrun(str(script), [], 2, str(tmp_path / "logs"))
    for rank in range(2):
        log = (tmp_path / "logs" / f"worker_{rank}.log").read_text(encoding="utf-8", errors="replace")
        assert len(re.findall(r"loss is ", log)) == 2, log[-2000:]   # LossMonitor(4): 4 steps of 2 epochs per rank


def _audit_test_names():
    """``(module, function)`` for every test docs/audit.md names: ``test_file::test_name[params]``, ``test_file::*``
    (the whole module: function ``*``) or a bare ``test_name`` (module ``""``: the one its name starts with, as every
    test here is named)."""
    text = open(os.path.join(REPO, "docs", "audit.md"), encoding="utf-8").read()
    names = []
    for token in re.findall(r"`((?:tests/)?test_[^`]*)`", text):
        module, _, function = token.rpartition("::")
        if not module and token.endswith(".py"):   # a whole file (tests/test_<concern>.py)
            module, function = token, "*"
        module = module.replace("tests/", "").replace(".py", "")
        function = re.split(r"[\[\s(]", function)[0]
        names.append((module, function))
    return names


def test_docs_audit_names_only_tests_that_exist():
    names = _audit_test_names()
    assert len(names) > 100, len(names)   # the audit names its tests; a parse that finds none would pass vacuously
    modules = {os.path.basename(path)[:-3] for path in glob.glob(os.path.join(REPO, "tests", "test_*.py"))}
    defined = {}
    missing = []
    for module, function in names:
        if not module:
            candidates = [m for m in modules if function.startswith(m + "_") or function == m]
            module = max(candidates, key=len) if candidates else "?"
        if function == "*":
            assert module in modules, f"docs/audit.md names a test module that does not exist: {module}"
            continue
        if module not in defined:
            path = os.path.join(REPO, "tests", f"{module}.py")
            source = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
            defined[module] = set(re.findall(r"^def (test_\w+)\(", source, re.M))
        if function not in defined[module]:
            missing.append(f"{module}::{function}")
    assert not missing, f"docs/audit.md names tests that do not exist: {missing}"


def _listed_primitives(text: str) -> dict:
    """The primitives docs/primitives.md lists, by section (its backticked names after each ``## `` heading, with the
    count the heading gives)."""
    sections = {}
    for block in text.split("\n## ")[1:]:
        heading, _, body = block.partition("\n")
        count = int(re.search(r"\((\d+)\)$", heading).group(1))
        listed = re.findall(r"`(\w+)`", body.split("\n\n", 2)[-1])
        sections[heading] = (count, [name for name in listed if name not in ("MakeTuple", "TupleGetItem")])
    return sections


def _primitives_differ(sections: dict, table) -> list:
    """What differs between the listed sections and the table's primitives (empty: none)."""
    problems = [f"'{heading}' says {count} but lists {len(names)}" for heading, (count, names) in sections.items()
                if count != len(names)]
    listed = [name for _, names in sections.values() for name in names]
    problems += [f"listed twice: {name}" for name in sorted({n for n in listed if listed.count(n) > 1})]
    problems += [f"in the table, not listed: {name}" for name in sorted(set(table) - set(listed))]
    problems += [f"listed, not in the table: {name}" for name in sorted(set(listed) - set(table))]
    return problems


def test_docs_primitives_list_is_the_table():
    from ms_gradaccum.diagnostics.batch_table import RULES   # pylint: disable=import-outside-toplevel
    text = open(os.path.join(REPO, "docs", "primitives.md"), encoding="utf-8").read()
    sections = _listed_primitives(text)
    assert _primitives_differ(sections, RULES) == []
    assert f"{len(RULES)} primitives" in text
    # Negative controls: a primitive dropped from the list, and one the table lacks, are both found.
    first = next(iter(sections))
    count, names = sections[first]
    assert _primitives_differ(dict(sections, **{first: (count - 1, names[1:])}), RULES) == \
        [f"in the table, not listed: {names[0]}"]
    assert _primitives_differ(sections, {**RULES, "Planted": None}) == ["in the table, not listed: Planted"]


@pytest.mark.slow
def test_docs_names_in_prose_exist():
    """Every repository path and every package name the prose cites (README, docs/, CONTRIBUTING, sample_code's
    READMEs, the package's and the tests' docstrings and comments) exists: read from the source, importing no zoo."""
    import prose_names   # pylint: disable=import-outside-toplevel
    assert prose_names.every_stale_name() == {}
    # Negative controls: planted stale names of each kind are found, in prose and in a module's docstring and comment;
    # the real names beside them are not.
    index = prose_names.Index()
    private = "_NO_SUCH" + "_PRIVATE"   # built, not written: a string constant of an identifier counts as defined
    planted = ("`core.kinds.NoSuchKind`, `_engine.CompileRecord` (moved), ms_gradaccum/_zoo_step.py, "
               "`tests/tools/launch.py::no_such_function`, ``" + private + "``, `core/no_such.py`, `gone.md`; "
               "fine: `core.kinds.LossKind`, ms_gradaccum/adapters/zoo_step.py, `mindone.diffusers`, "
               "`kinds.RowSum`, tests/test_<concern>.py, `tests/tools/launch.py::msrun`, _mindspore/frontend.py")
    assert sorted(prose_names.stale_names(planted, index)) == sorted([
        ("name", "core.kinds.NoSuchKind"), ("name", "_engine.CompileRecord"), ("path", "ms_gradaccum/_zoo_step.py"),
        ("path", "tests/tools/launch.py::no_such_function"), ("name", private),
        ("path", "core/no_such.py"), ("file", "gone.md")])
    code = '"""See ``diagnostics.contract.NoSuchCheck``."""\nx = 1   # and _buffers.gone\n'
    assert sorted(prose_names.stale_names(prose_names.prose_of_code(code), index)) == [
        ("name", "_buffers.gone"), ("name", "diagnostics.contract.NoSuchCheck")]
