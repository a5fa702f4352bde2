"""The MindSpore internals the package relies on (ms_gradaccum/_mindspore/), checked on the installed version.

CI runs this module on the lowest and the highest supported MindSpore, so each version difference handled in the
adapters has a test that fails if the handling is wrong for the version at hand. Also: each patch's undo, and the
fence (only the adapters import private MindSpore names, read private attributes of other libraries or introspect
code, closures and frames; no import cycle in the package).
"""
import os
import subprocess
import sys

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, Parameter, Tensor

from ms_gradaccum._mindspore import graph, surroundings, version
from ms_gradaccum.core import buffers as _buffers
from ms_gradaccum.parallel import parallel_pass as _parallel_pass
from launch import repo_env

pytestmark = pytest.mark.lowest


@pytest.mark.parametrize("text, parsed", [("2.10.0", (2, 10, 0)), ("2.7.0", (2, 7, 0)), ("2.9.0rc1", (2, 9, 0)),
                                          ("2.11", (2, 11, 0))])
def test_mindspore_version_parsed(text, parsed):
    assert version.mindspore_version(text) == parsed


@pytest.mark.parametrize("text, supported", [("2.6.0", False), ("2.7.0", True), ("2.7.2", True), ("2.10.0", True),
                                             ("2.11.0", False), ("3.0.0", False)])
def test_mindspore_supported_range(text, supported):
    if supported:
        version.check_mindspore_version(text)
    else:
        with pytest.raises(ImportError, match=f"ms_gradaccum supports mindspore>=2.7.0,<2.11, but MindSpore {text} is "
                                              f"installed"):
            version.check_mindspore_version(text)


def test_mindspore_import_refuses_an_unsupported_mindspore():
    code = "import mindspore; mindspore.__version__ = '2.6.0'; import ms_gradaccum"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          env=repo_env())
    assert done.returncode == 1
    assert ("ImportError: ms_gradaccum supports mindspore>=2.7.0,<2.11, but MindSpore 2.6.0 is installed" in
            done.stderr), done.stderr[-2000:]


class _Divide(nn.Cell):
    """Divides a Parameter the way the package divides its buffers, in a graph."""

    def __init__(self, how):
        super().__init__()
        self.p = Parameter(Tensor(np.full(3, 6.0, np.float32)), name="p")
        self.how = how

    def construct(self, divisor):
        if self.how == "augmented":
            buffer = self.p
            buffer /= divisor
            return buffer
        return _buffers.divide_in_place((self.p,), divisor)[0]


def test_mindspore_in_place_division_flag_matches_this_mindspore():
    # `p /= d` writes the Parameter from 2.8 on and not in 2.7: the flag must say which, or the optimizer that reads
    # the buffers after the in-place all-reduce and division would see undivided sums (seen on 2.7.0).
    cell = _Divide("augmented")
    assert float(cell(Tensor(2.0, ms.float32)).asnumpy()[0]) == 3.0
    assert (float(cell.p.asnumpy()[0]) == 3.0) == version.AUGMENTED_ASSIGNMENT_IN_PLACE, ms.__version__


@pytest.mark.parametrize("in_place", [True, False])
def test_mindspore_divide_in_place_writes_the_buffer_either_way(monkeypatch, in_place):
    if in_place and not version.AUGMENTED_ASSIGNMENT_IN_PLACE:
        pytest.skip(f"MindSpore {ms.__version__} does not divide Parameters in place")
    monkeypatch.setattr(_buffers, "AUGMENTED_ASSIGNMENT_IN_PLACE", in_place)
    cell = _Divide("package")
    assert float(cell(Tensor(2.0, ms.float32)).asnumpy()[0]) == 3.0
    assert float(cell.p.asnumpy()[0]) == 3.0


class _ReadsAtCompile(nn.Cell):
    calls = 0

    @graph.compile_time
    def value(self):
        type(self).calls += 1
        return float(len(self.trainable_params()) + 1)   # a call the graph parser could not compile

    def construct(self, x):
        return x * self.value


def test_mindspore_compile_time_attribute_is_read_in_python_when_the_graph_compiles():
    cell = _ReadsAtCompile()
    out = cell(Tensor(np.ones(2, np.float32)))
    assert out.asnumpy().tolist() == [1.0, 1.0] and _ReadsAtCompile.calls >= 1


class _Checked(nn.Cell):
    def __init__(self):
        super().__init__()
        self.compile_checks = graph.CompileChecks(self)

    def check_at_compile(self):
        raise ValueError("the owner's own message")

    def construct(self, x):
        graph.run_compile_checks(self.compile_checks)
        return x * 2


def test_mindspore_compile_checks_reach_the_user_unchanged():
    with pytest.raises(ValueError, match="the owner's own message"):
        _Checked()(Tensor(np.ones(2, np.float32)))


def _eager_state():
    from mindspore import context
    from mindspore._c_expression import ms_ctx_param
    return (ms.get_context("mode"), graph.PYNATIVE_EXECUTOR.enable_grad(),
            bool(context._context().get_param(ms_ctx_param.pynative_synchronize)))


@pytest.mark.parametrize("user_synchronous", [False, True])
def test_mindspore_eager_mode_runs_synchronously_on_cpu_and_restores_everything(user_synchronous):
    # The loss contract's pass runs in eager_mode: PyNative, no gradient recording, and on CPU synchronous execution
    # (PyNative's asynchronous pipeline costs more than the operators there). All three come back as they were, also
    # after an error and when the user had asked for synchronous execution themselves.
    from mindspore import context
    from mindspore._c_expression import ms_ctx_param
    ms.set_context(mode=ms.GRAPH_MODE)
    context._context().set_param(ms_ctx_param.pynative_synchronize, user_synchronous)
    try:
        before = _eager_state()
        assert before == (ms.GRAPH_MODE, graph.PYNATIVE_EXECUTOR.enable_grad(), user_synchronous)
        net = nn.Dense(3, 2)
        x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
        with graph.eager_mode():
            assert _eager_state() == (ms.PYNATIVE_MODE, False, True)
            eager = net(x).asnumpy()
        assert _eager_state() == before
        with pytest.raises(ValueError, match="inside"):
            with graph.eager_mode():
                raise ValueError("inside")
        assert _eager_state() == before
        # The same numbers as the compiled network's (the mode only changes how the operators are run).
        np.testing.assert_allclose(eager, net(x).asnumpy(), rtol=1e-6)
    finally:
        context._context().set_param(ms_ctx_param.pynative_synchronize, False)


def test_mindspore_model_routes_by_class_name():
    # What ROUTED_NAMES stands for: Model picks MindSpore's accumulating train cell by cls_name.
    from mindspore.train.amp import _is_grad_accumulation  # pylint: disable=import-outside-toplevel

    class GradAccumulation(nn.Cell):
        def construct(self, x):
            return x
    assert _is_grad_accumulation(GradAccumulation()) and GradAccumulation().cls_name in surroundings.ROUTED_NAMES
    assert not _is_grad_accumulation(_parallel_pass.ParallelPassMarkers(nn.Dense(2, 2), 2))


def test_mindspore_enclosing_cells_found_walking_down_from_the_root():
    inner = nn.Dense(2, 2)
    optimizer = nn.SGD(inner.trainable_params(), 0.1)
    loss_net = nn.WithLossCell(inner, nn.MSELoss())
    wrapper = nn.TrainOneStepCell(loss_net, optimizer)
    assert surroundings.enclosing_cells(inner, wrapper) == [wrapper, loss_net]
    assert surroundings.around(inner, wrapper) == surroundings.Surroundings(wrapper, optimizer, loss_net)
    assert surroundings.around(loss_net, wrapper) == surroundings.Surroundings(wrapper, optimizer, None)
    assert surroundings.around(wrapper, wrapper) == surroundings.Surroundings()   # the root itself: nothing around
    assert surroundings.around(inner, nn.Dense(2, 2)) is None                    # a tree without it


# --- the patches: each undone by its uninstall() ------------------------------------------------------------------

@pytest.mark.slow
def test_mindspore_patches_uninstall_restores_mindspore_and_plain_training_is_unchanged():
    # In a fresh process: train through GradAccumulationCell (the compile hook installed from its construction to its
    # first compile, and removed by itself after it; autodiff's zeros_like only for a network whose bprop needs it, and
    # kept), remove the patches (ms_gradaccum.remove_patches), and find MindSpore's own objects back; a plain train
    # cell trains bit-identically before the patches and after their undo.
    code = """
import numpy as np, mindspore as ms
from mindspore import nn
from mindspore.ops.composite.multitype_ops import zeros_like_impl
from ms_gradaccum._mindspore.patches import CELL_GRAPH_EXECUTOR, PATCHES, AUTODIFF_ZEROS_LIKE, GRAPH_COMPILE
from ms_gradaccum._mindspore.patches import JIT_COMPILE, _api
import sys
sys.path.insert(0, TESTS)
from helpers import ce, classification_batches, make_mlp, make_optimizer, params_of, train_steps, ZerosLikeLoss
ms.set_context(mode=ms.GRAPH_MODE)
def plain():
    net = make_mlp()
    train_steps(nn.TrainOneStepCell(nn.WithLossCell(net, ce()), make_optimizer("adam", net.trainable_params())),
                classification_batches(2, 32))
    return params_of(net)
functional, compile_graph, compile_jit = zeros_like_impl.F, CELL_GRAPH_EXECUTOR.compile, _api._JitExecutor.compile
own = dict(vars(CELL_GRAPH_EXECUTOR))   # the executor's own attributes before any patch
before = plain()
import ms_gradaccum
from ms_gradaccum import GradAccumulationCell
def accumulated(loss_net):
    return nn.TrainOneStepCell(GradAccumulationCell(loss_net(net), 4), make_optimizer("sgd", net.trainable_params()))
net = make_mlp()
train_steps(accumulated(lambda net: nn.WithLossCell(net, ce())), classification_batches(1, 32))
print("plain network:", AUTODIFF_ZEROS_LIKE.installed, GRAPH_COMPILE.installed)
step = accumulated(ZerosLikeLoss)
print("built:", GRAPH_COMPILE.installed, CELL_GRAPH_EXECUTOR.compile == compile_graph,
      "compile" in vars(CELL_GRAPH_EXECUTOR) and "compile" not in own, JIT_COMPILE.installed,
      _api._JitExecutor.compile is compile_jit)
train_steps(step, classification_batches(1, 32))
print("installed:", AUTODIFF_ZEROS_LIKE.installed, GRAPH_COMPILE.installed, zeros_like_impl.F is functional,
      CELL_GRAPH_EXECUTOR.compile == compile_graph, vars(CELL_GRAPH_EXECUTOR).keys() == own.keys())
print("removed:", ms_gradaccum.remove_patches(), ms_gradaccum.remove_patches())   # twice: nothing more
for patch in PATCHES.values():
    patch.uninstall()   # each alone: nothing more either
print("uninstalled:", AUTODIFF_ZEROS_LIKE.installed, GRAPH_COMPILE.installed, zeros_like_impl.F is functional,
      CELL_GRAPH_EXECUTOR.compile == compile_graph, "ms_gradaccum._autodiff_functional" in sys.modules,
      vars(CELL_GRAPH_EXECUTOR).keys() == own.keys(), JIT_COMPILE.installed, _api._JitExecutor.compile is compile_jit)
after = plain()
train_steps(accumulated(ZerosLikeLoss), classification_batches(1, 32))
print("again:", AUTODIFF_ZEROS_LIKE.installed, GRAPH_COMPILE.installed)
ms_gradaccum.remove_patches()
print("plain:", "bit-identical" if all(np.array_equal(before[k], after[k]) for k in before) else "DIFFERENT")
"""
    code = code.replace("TESTS", repr(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          env=repo_env(GLOG_v="3"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # A network without a bprop calling ops.zeros_like gets no patch (and the compile hook is gone after its compile).
    assert "plain network: False False" in done.stdout, done.stdout
    # Control: the compile hook was in place until the compile, an attribute of the executor's own.
    assert "built: True False True True False" in done.stdout, done.stdout   # the jit executor's compile too
    # The executor's undo deleted the attribute its install added: vars() as before, not only an equal compile.
    assert "installed: True False False True True" in done.stdout, done.stdout   # ... and removed by itself after it
    assert "removed: ['autodiff zeros_like'] []" in done.stdout, done.stdout
    assert "uninstalled: False False True True False True False True" in done.stdout, done.stdout
    assert "again: True False" in done.stdout, done.stdout   # a cell that needs it installs it again at its compile
    assert "plain: bit-identical" in done.stdout, done.stdout


# --- the fence: private MindSpore names only in the adapters; no import cycle -----------------------------------------

def _package_imports() -> dict:
    """``{module: [(imported module, names), ...]}`` of every module of the package, read from its source."""
    import ast            # pylint: disable=import-outside-toplevel
    import pathlib        # pylint: disable=import-outside-toplevel
    root = pathlib.Path(_buffers.__file__).parent.parent   # ms_gradaccum/ (buffers is in core/)
    found = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("ms_gradaccum",) + path.relative_to(root).with_suffix("").parts).replace(".__init__", "")
        imports = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imports.append((node.module, [alias.name for alias in node.names]))
            elif isinstance(node, ast.Import):
                imports += [(alias.name, []) for alias in node.names]
        found[module] = imports
    return found


def _private(module: str, names: list) -> list:
    parts = module.split(".")
    return [module] if any(part.startswith("_") for part in parts[1:]) else \
        [f"{module}.{name}" for name in names if name.startswith("_")]


def test_mindspore_private_names_are_imported_by_the_adapters_only():
    imports = _package_imports()
    adapters = {name: found for name, found in imports.items() if name.startswith("ms_gradaccum._mindspore")}
    outside = {name: [p for module, names in found if module.split(".")[0] == "mindspore"
                      for p in _private(module, names)]
               for name, found in imports.items() if name not in adapters}
    assert not any(outside.values()), {name: private for name, private in outside.items() if private}
    # Control: the check sees private imports where they are.
    assert any(_private(module, names) for found in adapters.values() for module, names in found
               if module.split(".")[0] == "mindspore")


# Introspection of code, closures and frames: an adapter's business (what a function's code or a frame holds).
_INTROSPECTION = {"__closure__", "__code__", "__globals__", "co_filename", "co_firstlineno", "co_varnames", "f_back",
                  "f_locals", "f_globals", "_getframe", "getsource", "getsourcelines", "getclosurevars"}


def _foreign_private_uses() -> dict:
    """``{module: [name, ...]}``: the private attributes a module of the package reads that the package does not
    define itself (MindSpore's ``Cell._cells``, ``context._context``, ...), and its reads of code, closures, frames
    and source (:data:`_INTROSPECTION`), from its source."""
    import ast            # pylint: disable=import-outside-toplevel
    import pathlib        # pylint: disable=import-outside-toplevel
    root = pathlib.Path(_buffers.__file__).parent.parent   # ms_gradaccum/ (buffers is in core/)
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(root.rglob("*.py"))}
    defined = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "__setattr__" and \
                    len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                defined.add(node.args[1].value)
    return {".".join(("ms_gradaccum",) + path.relative_to(root).with_suffix("").parts).replace(".__init__", ""):
            _private_reads(tree, defined) for path, tree in trees.items()}


_BY_NAME = {"getattr", "hasattr", "setattr", "delattr", "attrgetter"}


def _private_reads(tree, defined: set) -> list:
    """The private attributes `tree` reads that the package does not define (``x._y``, and by name:
    ``getattr(x, "_y")``, ``operator.attrgetter("_y")``), every private attribute read through a name imported from
    another library (``BaseTrainer._check``, even where the package defines a name alike), and introspection."""
    import ast            # pylint: disable=import-outside-toplevel
    imported = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not (
                    isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ms_gradaccum")))
                for alias in node.names if not alias.name.startswith("ms_gradaccum")}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            through_import = isinstance(node.value, ast.Name) and node.value.id in imported
            if (private and (node.attr not in defined or through_import)) or node.attr in _INTROSPECTION:
                names.add(node.attr)
        elif isinstance(node, ast.Call):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if function in _BY_NAME:
                for arg in node.args[:2]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and \
                            arg.value.startswith("_") and not arg.value.startswith("__") and arg.value not in defined:
                        names.add(arg.value)
        elif isinstance(node, ast.Constant) and node.value in ("_cells", "_params"):   # __dict__["_cells"]
            names.add(node.value)
    return sorted(names)


def test_mindspore_private_attributes_and_introspection_are_the_adapters_only():
    # The fence covers more than imports: reading another library's private attributes (Cell._cells, _params,
    # context._context), code objects, closures, frames and source happens in ms_gradaccum._mindspore alone.
    found = _foreign_private_uses()
    outside = {module: names for module, names in found.items()
               if names and not module.startswith("ms_gradaccum._mindspore")}
    assert not outside, outside
    # Control: the scan sees them where they are.
    adapters = {module: names for module, names in found.items() if module.startswith("ms_gradaccum._mindspore")}
    assert "_cells" in adapters["ms_gradaccum._mindspore.surroundings"], adapters
    assert "_phase" in adapters["ms_gradaccum._mindspore.surroundings"], adapters   # attrgetter("_phase")
    assert "__closure__" in adapters["ms_gradaccum._mindspore.patches"], adapters
    # ... and the forms it once missed: a read by name, and one through a name imported from another library, where
    # the package defines a name alike (MindFormers' trainer check, read in its adapter).
    import ast   # pylint: disable=import-outside-toplevel
    planted = ("import operator\nfrom mindformers import BaseTrainer\nfrom ms_gradaccum.core import buffers\n"
               "a = operator.attrgetter('_phase')\nb = getattr(c, '_cells_list', None)\n"
               "d = BaseTrainer._check_steps\ne = buffers._own\n")
    assert _private_reads(ast.parse(planted), {"_check_steps", "_own"}) == ["_cells_list", "_check_steps", "_phase"]


def test_mindspore_package_has_no_import_cycle():
    imports = _package_imports()
    graph = {}
    for name, found in imports.items():
        targets = set()
        for module, names in found:
            if module.startswith("ms_gradaccum"):
                targets.add(module)
                targets.update(f"{module}.{n}" for n in names if f"{module}.{n}" in imports)
        graph[name] = {t for t in targets if t in imports and t != name}
    # A package imports its own __init__ first: edges to a parent package are not cycles of the modules' own.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for target in graph[node]:
                if target == start:
                    return path + [start]
                if target not in seen:
                    seen.add(target)
                    stack.append((target, path + [target]))
        return None

    cycles = [cycle for cycle in map(cycle_from, sorted(graph)) if cycle]
    assert not cycles, cycles
    assert len(graph) > 10 and any(graph.values())   # control: the graph was read


def test_mindspore_surroundings_are_kept_on_the_cell_only():
    # The surroundings a binding found are kept on the package cell and nowhere else: a module-level table of them
    # (even keyed weakly by the cell) kept every compiled cell alive through the train cell it holds.
    import gc   # pylint: disable=import-outside-toplevel
    from ms_gradaccum import GradAccumulationCell   # pylint: disable=import-outside-toplevel
    from ms_gradaccum.cells import binding as _binding   # pylint: disable=import-outside-toplevel
    from helpers import ce, classification_batches, make_mlp, make_optimizer   # pylint: disable=import-outside-toplevel
    net = make_mlp()
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), 4)
    assert cell.surroundings is _binding.NOTHING_AROUND   # built: bound from its arguments
    step = nn.TrainOneStepCell(cell, make_optimizer("sgd", net.trainable_params()))
    x, y = classification_batches(1, 32)[0]
    step(Tensor(x), Tensor(y))
    gc.collect()
    kept = cell.__dict__["surroundings"]
    assert kept.train_cell is step and kept.optimizer is step.optimizer   # control: what the compile's root held
    held = [obj for obj in gc.get_objects()
            if type(obj) is surroundings.Surroundings and obj is not _binding.NOTHING_AROUND]  # no isinstance: proxies
    for found in held:
        holders = [ref for ref in gc.get_referrers(found) if isinstance(ref, dict)]
        assert holders and all(holder.get("surroundings") is found and holder.get("_cells") is not None
                               for holder in holders), holders


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_mindspore_binding_runs_once_per_compile_and_never_on_a_steady_call(monkeypatch, mode):
    # Bound at construction, then once from the root of the first compile (graph mode); PyNative mode hands over no
    # root and keeps what construction bound while the trained weights stay. A steady call binds nothing (0.3.0 read
    # the stack once per compile or first PyNative call, and 17 times per compile before that).
    from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell  # pylint: disable=import-outside-toplevel
    from ms_gradaccum.cells import binding as _binding   # pylint: disable=import-outside-toplevel
    from helpers import ce, classification_batches, make_mlp, make_optimizer   # pylint: disable=import-outside-toplevel
    binds = []
    bind = _binding.BoundCell.bind
    monkeypatch.setattr(_binding.BoundCell, "bind", lambda self, root=None: binds.append(
        (type(self).__name__, type(root).__name__ if root is not None else None)) or bind(self, root))
    x, y = (Tensor(a) for a in classification_batches(1, 32)[0])
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        first_net = net = make_mlp()
        cell = GradAccumulationCell(nn.WithLossCell(net, ce()), 4)
        step = nn.TrainOneStepCell(cell, make_optimizer("sgd", net.trainable_params()))
        step(x, y)
        first = [("GradAccumulationCell", None)] + ([("GradAccumulationCell", "TrainOneStepCell")]
                                                   if mode == "graph" else [])
        assert binds == first
        step(x, y)
        assert binds == first
        binds.clear()
        net = make_mlp()
        AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()), 2)(x, y)
        assert binds == [("AccumulatingTrainOneStepCell", None)] + (
            [("AccumulatingTrainOneStepCell", "AccumulatingTrainOneStepCell")] if mode == "graph" else [])
        # Control: a change of the trained weights binds again in PyNative mode (graph mode: on rebind()).
        binds.clear()
        list(first_net.trainable_params())[0].requires_grad = False
        if mode == "graph":
            cell.rebind()
        step(x, y)
        assert binds and binds[0][0] == "GradAccumulationCell", binds
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


_FRAME_READS = {"_getframe", "f_back", "f_locals", "currentframe", "getouterframes"}


def _frame_readers(source: str, name: str) -> list:
    """The functions of `source` that read frames (``sys._getframe``, ``inspect.currentframe``/``stack``, a frame's
    ``f_back``/``f_locals``)."""
    import ast   # pylint: disable=import-outside-toplevel
    readers = []
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = {node.attr for node in ast.walk(function) if isinstance(node, ast.Attribute)}
            inspect_stack = any(isinstance(node, ast.Attribute) and node.attr == "stack" and
                                isinstance(node.value, ast.Name) and node.value.id == "inspect"
                                for node in ast.walk(function))
            if names & _FRAME_READS or inspect_stack:
                readers.append(f"{name}::{function.name}")
    return readers


def test_mindspore_no_frame_is_read():
    """Nothing of the package reads the stack: what is around a cell comes from the root of the compile, walked down
    (_mindspore.surroundings.around), or from the cell's arguments."""
    package = os.path.dirname(os.path.dirname(surroundings.__file__))
    readers = []
    for folder, _, files in os.walk(package):
        for file in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            readers += _frame_readers(open(path, encoding="utf-8").read(), os.path.relpath(path, package))
    assert readers == [], readers
    # Control: the scan finds a frame read where there is one.
    assert _frame_readers("import sys\ndef look():\n    return sys._getframe(1).f_locals\n", "x") == ["x::look"]


def _foreign_dict_writes(source: str, name: str) -> list:
    """The places in `source` that write into another object's ``__dict__``: a store or delete through
    ``x.__dict__[...]`` or ``vars(x)[...]``, ``x.__dict__.update/pop/setdefault/clear(...)``, and
    ``object.__setattr__``/``setattr``/``object.__delattr__``/``delattr`` on anything but ``self``."""
    import ast   # pylint: disable=import-outside-toplevel
    found = []

    def through_dict(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "__dict__") or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars")

    def is_self(node) -> bool:
        return isinstance(node, ast.Name) and node.id == "self"

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) and through_dict(node.value):
            if not (isinstance(node.value, ast.Attribute) and is_self(node.value.value)):
                found.append(f"{name}:{node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr in ("update", "pop", "setdefault", "clear") and through_dict(func.value) and not (
                    isinstance(func.value, ast.Attribute) and is_self(func.value.value)):
                found.append(f"{name}:{node.lineno}")
            elif func.attr in ("__setattr__", "__delattr__") and isinstance(func.value, ast.Name) and \
                    func.value.id == "object" and node.args and not is_self(node.args[0]):
                found.append(f"{name}:{node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and not is_self(node.args[0]):
            found.append(f"{name}:{node.lineno}")
    return found


def test_mindspore_nothing_outside_the_adapters_writes_into_another_objects_dict():
    """A foreign object (a user's cell, a train cell, a MindSpore object) is written through its ``__dict__`` only by
    ms_gradaccum._mindspore, which puts back what it changes (a cell's plain state after an eager pass, the random
    primitives during the probe); elsewhere the package writes only its own objects, through their attributes."""
    package = os.path.dirname(os.path.dirname(surroundings.__file__))
    found = []
    for folder, _, files in os.walk(package):
        if os.path.basename(folder) == "_mindspore":
            continue
        for file in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            found += _foreign_dict_writes(open(path, encoding="utf-8").read(), os.path.relpath(path, package))
    assert found == [], found
    # Control: the scan finds such writes where they are.
    sample = ("def f(cell, self):\n    cell.__dict__['a'] = 1\n    del vars(cell)['b']\n    cell.__dict__.update({})\n"
              "    object.__setattr__(cell, 'c', 1)\n    setattr(cell, 'd', 1)\n    self.__dict__['e'] = 1\n"
              "    object.__setattr__(self, 'f', 1)\n")
    assert _foreign_dict_writes(sample, "x") == ["x:2", "x:3", "x:4", "x:5", "x:6"]
    adapters = os.path.join(package, "_mindspore")
    inside = [hit for file in sorted(os.listdir(adapters)) if file.endswith(".py")
              for hit in _foreign_dict_writes(open(os.path.join(adapters, file), encoding="utf-8").read(), file)]
    assert inside, "the scan sees the adapters' own writes (surroundings.copy_cell, randomness.HeldDraws)"


# What each part of the package may import of the others (docs/design.md, "Modules"): core knows nothing of the rest,
# the diagnostics and the parallel modes know the core (the engine knows nothing of the diagnostics), the cells wire
# them, the adapters build on the cells.
_MAY_IMPORT = {
    "core": {"core", "_mindspore"},
    "diagnostics": {"core", "_mindspore", "diagnostics"},
    "parallel": {"core", "_mindspore", "parallel"},
    "cells": {"core", "_mindspore", "diagnostics", "parallel", "cells"},
    "adapters": {"core", "_mindspore", "cells", "adapters"},
    "_mindspore": {"_mindspore"},
}


def _layer(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in _MAY_IMPORT) else None


def test_mindspore_each_part_imports_only_the_parts_below_it():
    imports = _package_imports()
    crossings = []
    for module, found in imports.items():
        layer = _layer(module)
        if layer not in _MAY_IMPORT:
            continue
        for target, names in found:
            if not target.startswith("ms_gradaccum"):
                continue
            targets = [f"{target}.{name}" for name in names if f"{target}.{name}" in imports] or [target]
            for full in targets:
                if _layer(full) is not None and _layer(full) not in _MAY_IMPORT[layer]:
                    crossings.append(f"{module} -> {full}")
    assert crossings == [], crossings
    # Control: the engine is where the rule is read (and the cells do import the diagnostics).
    assert any(target.startswith("ms_gradaccum.diagnostics") for target, _ in imports[
        "ms_gradaccum.cells.grad_accumulation"])
    assert "ms_gradaccum.core.engine" in imports
