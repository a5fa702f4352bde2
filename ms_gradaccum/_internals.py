"""Every MindSpore internal this package relies on, in one module.

Each entry says why the package needs it and against which MindSpore versions it was checked
(:data:`CHECKED_VERSIONS`). No other module imports a private MindSpore name or depends on undocumented
behaviour; when MindSpore changes one of these, this is the file to adapt.
"""
import contextlib
import re
import sys
import weakref
from typing import Callable, Optional, Tuple

import mindspore as ms
from mindspore import nn

# --- 0. Versions ----------------------------------------------------------------------------------------------------
# Every entry below was read in the installed source of, and tested against, the lowest and the highest of these
# (the CI runs the whole suite on the highest and the core of it on the lowest).
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


check_mindspore_version()

# --- 1. Model's routing by class name -------------------------------------------------------------------------
# mindspore/train/amp.py::_is_grad_accumulation walks the cell tree and checks `cell.cls_name` against these names;
# a match makes Model / build_train_network wrap the network in _TrainGradAccuStepCell, whose optimizer reads
# buffers that only the semi-auto/auto-parallel compiler pass writes (elsewhere it silently trains nothing).
# `Cell.cls_name` is a property, so a subclass can present another name.
ROUTED_NAMES = frozenset({"GradAccumulationCell", "GradAccumulation"})

# --- 2. MindSpore's own accumulating train cell -----------------------------------------------------------------
# What Model builds for a routed cell in semi-auto/auto parallel; it applies no loss scale of its own while the
# optimizer divides by its loss_scale (mindspore/train/amp.py::build_train_network).
from mindspore.nn.wrap.cell_wrapper import _TrainGradAccuStepCell as TrainGradAccuStepCell  # noqa: E402

# --- 3. Compile-time Python in a graph --------------------------------------------------------------------------
# `_primexpr` runs a Python function on constants while the graph compiles (static shapes, constant checks); the
# public `constexpr` is deprecated in its favour.
from mindspore.ops.primitive import _primexpr as primexpr  # noqa: E402

# --- 4. The semi-auto/auto-parallel accumulation markers --------------------------------------------------------
# mindspore.parallel.nn.GradAccumulation marks micro-batch slices (`grad_accu_num`) and forward ends (`forward_end`)
# for the parallel pass; only the pass reads those attributes. Its class name is one Model routes (see 1.), so inside
# GradAccumulationCell, which presents the routed name itself in the modes where routing is wanted, it must not.
from mindspore.parallel.nn import GradAccumulation  # noqa: E402


class ParallelPassMarkers(GradAccumulation):
    """MindSpore's GradAccumulation under a name that Model does not route."""

    @property
    def cls_name(self) -> str:
        return "ParallelPassMarkers"

PARALLEL_PASS_MODES = frozenset({ms.ParallelMode.SEMI_AUTO_PARALLEL, ms.ParallelMode.AUTO_PARALLEL})


class CompileChecks:
    """Passed to :func:`run_compile_checks` at the top of a cell's ``construct``: calls ``owner.check_at_compile()``.

    Exceptions raised inside a :class:`compile_time` attribute are swallowed by the graph parser, which reports the
    attribute as missing ("object has no attribute"); a ``_primexpr`` receives this plain Python object and its
    exceptions reach the user unchanged. Called first in ``construct``, it runs before the attributes are read.
    """

    def __init__(self, owner: nn.Cell):
        self._owner = weakref.ref(owner)

    def run(self) -> None:
        owner = self._owner()
        if owner is None:
            return
        try:
            owner.check_at_compile()
        except Exception:
            # In PyNative mode the check runs inside the forward pass a train cell is recording for its gradient; an
            # error left that recording open, and the next training in the process failed with unrelated shape errors
            # (measured 2.10.0). MindSpore clears it the same way when a jit compile fails (mindspore/graph/api.py).
            if ms.get_context("mode") == ms.PYNATIVE_MODE:
                _pynative_executor().clear_res()
            raise


def _pynative_executor():
    """MindSpore's PyNative executor (``mindspore.graph.api`` from 2.9, ``mindspore.common.api`` before)."""
    try:
        from mindspore.graph.api import _pynative_executor as executor  # pylint: disable=import-outside-toplevel
    except ImportError:
        from mindspore.common.api import _pynative_executor as executor  # pylint: disable=import-outside-toplevel
    return executor


@primexpr
def run_compile_checks(checks: CompileChecks) -> None:
    """Raises the owner's configuration errors (and warns) when its graph compiles; every call in PyNative mode."""
    checks.run()


class compile_time:  # pylint: disable=invalid-name
    """A read-only attribute computed by a Python method each time it is read, also while a graph compiles.

    MindSpore's graph parser compiles the body of a ``property`` as graph code (so it cannot call
    ``trainable_params()`` or walk the call stack), but reads any other descriptor through Python's ``getattr``
    (checked in 2.10.0). So ``self.x`` in ``construct`` is evaluated in Python when the graph is compiled, and the
    value (a constant, a Parameter, a ParameterTuple) is what the graph uses: settings made after the cell was
    built but before training (freezing, a wrapping train cell, the parallel mode) are seen. The method must not
    raise (the parser would report a missing attribute): errors go through :class:`CompileChecks`.
    """

    def __init__(self, method):
        self.method = method
        self.__doc__ = method.__doc__

    def __get__(self, obj, owner=None):
        return self if obj is None else self.method(obj)


# --- 5. The train cell that wraps a cell --------------------------------------------------------------------------
# MindSpore keeps no parent pointer, and GraphExecutor does not expose the cell being compiled. The top cell is
# the `self` of Cell.compile's frame (graph mode) or of the constructs being called (PyNative), so the cells around
# a cell are found among the cells of the frames on the stack. A nested ms.jit graph compiles apart, without them:
# callers resolve in their own construct and remember the result.
_ENCLOSING_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _distinct(items) -> list:
    """`items` in order, each object once (by identity: Cells and Parameters may define ``==`` otherwise)."""
    kept = []
    for item in items:
        if all(item is not seen for seen in kept):
            kept.append(item)
    return kept


def _cells_on_stack() -> list:
    owners, frame = [], sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Cell):
            owners.append(owner)
        frame = frame.f_back
    return _distinct(owners)


def _enclosing_cells(cell: nn.Cell) -> list:
    """The cells among those being compiled or called whose tree holds `cell` (not `cell` itself), innermost first."""
    roots = _cells_on_stack()
    cached = _ENCLOSING_CACHE.get(cell)
    # The same cells on the stack (by identity, not by a reusable id) give the same answer: reuse it.
    if cached is not None and len(cached[0]) == len(roots) and all(r() is root for r, root in zip(cached[0], roots)):
        found = [ref() for ref in cached[1]]
        if all(c is not None for c in found):
            return found
    candidates = _distinct(candidate for root in roots for _, candidate in root.cells_and_names())
    found = [candidate for candidate in candidates
             if candidate is not cell and any(sub is cell for _, sub in candidate.cells_and_names())]
    found.sort(key=lambda c: len(list(c.cells_and_names())))
    _ENCLOSING_CACHE[cell] = (tuple(weakref.ref(root) for root in roots), tuple(weakref.ref(c) for c in found))
    return found


def enclosing_train_cell(cell: nn.Cell) -> Optional[nn.TrainOneStepCell]:
    """The innermost ``nn.TrainOneStepCell`` (or subclass: ``Model``'s, the loss-scale cells, this package's)
    whose tree holds `cell`, among the cells being compiled or called; ``None`` outside any (functional style)."""
    return next((c for c in _enclosing_cells(cell) if isinstance(c, nn.TrainOneStepCell)), None)


def enclosing_loss_wrapper(cell: nn.Cell) -> Optional[nn.Cell]:
    """The cell around `cell` that computes a loss of its output, holding it as ``_backbone`` (``nn.WithLossCell``, and
    the one ``Model(network, loss_fn=...)`` builds in mindspore/train/amp.py::_add_loss_network); ``None`` if none."""
    return next((c for c in _enclosing_cells(cell) if c.__dict__.get("_cells", {}).get("_backbone") is cell), None)


def enclosing_optimizer(cell: nn.Cell) -> Optional[nn.Optimizer]:
    """The optimizer of the innermost cell around `cell` that holds one as ``.optimizer`` (every
    ``nn.TrainOneStepCell``, and hand-written train cells written as MindSpore's tutorials write them);
    ``None`` outside any."""
    for candidate in _enclosing_cells(cell):
        optimizer = candidate.__dict__.get("optimizer") or candidate._cells.get("optimizer")  # pylint: disable=protected-access
        if isinstance(optimizer, nn.Optimizer):
            return optimizer
    return None


# The weights of a mindspore.grad / value_and_grad call (functional style, no train cell). MindSpore's
# _Grad.__call__ and GradOperation.__call__ (mindspore/ops/composite/base.py) return a closure `after_grad` over `fn`
# and `weights`. In PyNative mode its frame is on the stack while `fn` runs (`weights` among its locals). In graph mode
# it is a jit function being compiled: the `func` of the jit wrapper's `staging_specialize` frame, `weights` in its
# closure. Called inside the user's own jit function (MindSpore's functional recipe, `@ms.jit def train_step`), the
# grad function is inlined by the parser and leaves no frame: the grad functions are then looked up among the names
# that jit function uses (its globals and closure) and those of the functions it calls, two levels down, and the
# union of their weights is taken. A grad function reached otherwise (an object's attribute) is not found; then the
# requires_grad=True weights are accumulated. Checked 2.7.0 to 2.10.0.
_GRAD_SOURCE = "ops/composite/base.py"


def _is_after_grad_code(code) -> bool:
    return code.co_name == "after_grad" and code.co_filename.replace("\\", "/").endswith(_GRAD_SOURCE)


def _is_after_grad(function) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and _is_after_grad_code(code) and bool(function.__closure__)


def _closure(function) -> dict:
    return {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ())
            if name != "__class__"}


def _unwrap_jit(function):
    """The function a ``mindspore.jit`` wrapper compiles (the `func` in its closure), or `function` itself."""
    if getattr(function, "__wrapped_by_jit__", False) and getattr(function, "__closure__", None):
        return _closure(function).get("func", function)
    return function


def _weights_of(variables: dict) -> Optional[list]:
    weights = variables.get("weights")
    if weights is None:
        return None
    weights = [weights] if isinstance(weights, ms.Parameter) else list(weights)
    return weights if all(isinstance(weight, ms.Parameter) for weight in weights) else None


def _grad_functions_used_by(function, depth: int = 2) -> list:
    """The grad functions (after_grad closures) a user's jit function refers to by name (its globals and closure),
    and those of the plain functions it refers to, `depth` levels down."""
    code = getattr(function, "__code__", None)
    if code is None:
        return []
    used = [getattr(function, "__globals__", {}).get(name) for name in code.co_names]
    used += list(_closure(function).values())
    found = []
    for candidate in map(_unwrap_jit, used):
        if _is_after_grad(candidate):
            found.append(candidate)
        elif depth > 0 and callable(candidate) and not isinstance(candidate, (type, nn.Cell)):
            found += _grad_functions_used_by(candidate, depth - 1)
    return _distinct(found)


def differentiated_weights() -> Optional[list]:
    """The ``weights`` of the innermost ``mindspore.grad``/``value_and_grad`` call running or being compiled, as
    the user passed them (parameters with ``requires_grad=False`` included); ``None`` when there is none, when it
    has no weights, or when it cannot be found (see above)."""
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        code = frame.f_code
        if _is_after_grad_code(code):
            return _weights_of(frame.f_locals)
        if code.co_name == "staging_specialize":
            func = frame.f_locals.get("func")
            if _is_after_grad(func):
                return _weights_of(_closure(func))
            # All the weights of every grad function it uses: accumulating more weights than one of them
            # differentiates costs buffers, never exactness.
            found = [_weights_of(_closure(grad)) for grad in _grad_functions_used_by(func)]
            return _distinct(weight for weights in found if weights for weight in weights) or None
        frame = frame.f_back
    return None


def applied_sens(train_cell: nn.TrainOneStepCell) -> Optional[float]:
    """The loss scale `train_cell` applies as the ``sens`` of its backward when it is fixed; ``None`` when it changes
    while training (a DynamicLossScaleUpdateCell). Reads ``sense_flag``/``sens`` of nn.TrainOneStepCell and
    ``scale_sense``/``loss_scaling_manager`` of nn.TrainOneStepWithLossScaleCell (attributes, not API)."""
    manager = getattr(train_cell, "loss_scaling_manager", None)
    if isinstance(manager, nn.DynamicLossScaleUpdateCell):
        return None
    if isinstance(train_cell, nn.TrainOneStepWithLossScaleCell):
        return float(train_cell.scale_sense.asnumpy().reshape(()))
    sens = getattr(train_cell, "sens", None)
    if getattr(train_cell, "sense_flag", False) and isinstance(sens, (int, float)) and not isinstance(sens, bool):
        return float(sens)
    return 1.0


def scale_left_out(train_cell: Optional[nn.Cell]) -> float:
    """The loss scale the optimizer divides out but `train_cell` never applies: only _TrainGradAccuStepCell, built by
    Model in semi-auto/auto parallel for FixedLossScaleManager(S, drop_overflow_update=False), leaves one (S)."""
    if isinstance(train_cell, TrainGradAccuStepCell) and not train_cell.sense_flag:
        return float(getattr(train_cell.optimizer, "loss_scale", 1.0))
    return 1.0


# --- 6. The all-reduce of nn.DistributedGradReducer -------------------------------------------------------------
# Its primitives and filter are attributes (allreduce_filter, split_fusion, op_list, allreduce, mean, degree):
# AccumulatingTrainOneStepCell reuses them to all-reduce its buffers in place with exactly the same collectives.
def reducer_all_reduces(reducer: nn.DistributedGradReducer) -> tuple:
    """``(per-weight all-reduce flag, per-weight AllReduce primitive, whether the reducer averages, device count)``."""
    flags = tuple(reducer.allreduce_filter)
    if reducer.split_fusion:
        primitives = tuple(reducer.op_list)
    else:
        primitives = (reducer.allreduce,) * len(flags)
    devices = float(round(1.0 / float(reducer.degree.asnumpy())))
    return flags, primitives, bool(reducer.mean), devices


# --- 7. In-place arithmetic on Parameters ---------------------------------------------------------------------------
# In graph mode, `p /= d` on a Parameter writes p in place (InplaceDiv) from MindSpore 2.8 on (checked 2.8.0, 2.9.0,
# 2.10.0). In 2.7.0 it makes a new tensor and leaves p unchanged, and Tensor.div_ silently does nothing; there the
# buffers are written with ops.assign instead (the same values; a temporary per buffer, one at a time). In PyNative
# mode it is an ordinary product or quotient (there is no eager CPU kernel for InplaceMul/InplaceDiv in 2.10.0).
# MindSpore drops such an in-place kernel when nothing reads its output (measured 2.10.0: under data parallel the
# optimizer, which reads the buffers themselves, then got undivided buffers): callers make what follows depend on it.
AUGMENTED_ASSIGNMENT_IN_PLACE = mindspore_version() >= (2, 8, 0)


# --- 8. Communication and parallel context ------------------------------------------------------------------------
def communication_initialized() -> bool:
    """Whether ``mindspore.communication.init()`` has run (GlobalComm.INITED, set by init())."""
    from mindspore.communication._comm_helper import GlobalComm  # pylint: disable=import-outside-toplevel
    return bool(GlobalComm.INITED)


def parallel_mode() -> str:
    """The parallel mode in force (public API)."""
    return ms.get_auto_parallel_context("parallel_mode")


# --- 9. zeros_like in the package's graphs ---------------------------------------------------------------------------
# GradAccumulationCell differentiates the network inside a graph that the wrapping train cell differentiates again.
# MindSpore parses the Python function mindspore.ops.zeros_like (== ops.functional.zeros_like) into one cached graph
# per function object. Autodiff makes its zero gradients through it: C.zeros_like's Tensor case
# (ops/composite/multitype_ops/zeros_like_impl.py::_zeros_like_tensor) returns `F.zeros_like(x)`, F being
# mindspore.ops.functional. When the same function object is also reached from a custom bprop inside the network
# (MindFormers' loss cells: `F.zeros_like(label)`), the graph parsed from it is used by the inner gradient and then
# found empty when the outer gradient evaluates it: "The func graph is empty, func graph: ...zeros_like" (measured
# 2.10.0; C++ stack_frame.cc). Every form of the nesting fails alike (the issue tracker of this package, #28).
#
# The way around (separate_autodiff_zeros_like): zeros_like_impl's `F` becomes a module of its own, registered in
# sys.modules under its own name (the parser resolves a function's globals through the module named by its
# namespace, graph/_parse/parser.py::get_module_namespace; _extends/parse/parser.py in 2.7), holding everything
# mindspore.ops.functional holds, except that its zeros_like is a copy of the same function (same code, globals and
# defaults). Autodiff then parses a graph of its own, the user's bprop keeps the original, and both compute exactly
# what they did. Applied once, the first time a GradAccumulationCell compiles a graph, and left in place: it changes no
# value any graph computes (tested: a plain train cell trained before and after it in one process is bit-identical);
# a process that never compiles a GradAccumulationCell is not touched. Checked 2.7.0 and 2.10.0 (same layout).
# Where MindSpore is laid out otherwise, it is not applied and the cells name the bprops that call the function.
# The package's own graphs never call that function (the primitive below instead).
import ast  # noqa: E402
import inspect  # noqa: E402
import textwrap  # noqa: E402
import types  # noqa: E402

from mindspore import ops as _ops  # noqa: E402

ZEROS_LIKE = _ops.ZerosLike()
_ZEROS_LIKE_FUNCTION = _ops.zeros_like
_AUTODIFF_FUNCTIONAL = "ms_gradaccum._autodiff_functional"


def _function_copy(function):
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__dict__.update(function.__dict__)
    copy.__qualname__, copy.__module__, copy.__doc__ = function.__qualname__, function.__module__, function.__doc__
    return copy


def separate_autodiff_zeros_like() -> bool:
    """Give autodiff's zero gradients a zeros_like of their own (see above); True once that is in place, False where
    MindSpore's layout is not the one checked."""
    from mindspore.ops.composite.multitype_ops import zeros_like_impl  # pylint: disable=import-outside-toplevel
    functional = getattr(zeros_like_impl, "F", None)
    if isinstance(functional, types.ModuleType) and functional.__name__ == _AUTODIFF_FUNCTIONAL:
        return True
    if not (isinstance(functional, types.ModuleType) and getattr(functional, "zeros_like", None) is
            _ZEROS_LIKE_FUNCTION and isinstance(_ZEROS_LIKE_FUNCTION, types.FunctionType)):
        return False
    module = types.ModuleType(_AUTODIFF_FUNCTIONAL, functional.__doc__)
    module.__dict__.update({key: value for key, value in functional.__dict__.items() if key not in ("__name__",
                                                                                                   "__spec__")})
    module.zeros_like = _function_copy(_ZEROS_LIKE_FUNCTION)
    sys.modules[_AUTODIFF_FUNCTIONAL] = module
    zeros_like_impl.F = module
    return True


def _resolves_to_zeros_like(node, namespace: dict) -> bool:
    """Whether a call's function expression (`zeros_like`, `ops.zeros_like`, `F.zeros_like`) is that function."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id) is _ZEROS_LIKE_FUNCTION
    if isinstance(node, ast.Attribute) and node.attr == "zeros_like":
        base = node.value
        owner = namespace.get(base.id) if isinstance(base, ast.Name) else None
        return getattr(owner, "zeros_like", None) is _ZEROS_LIKE_FUNCTION
    return False


def _folded(test, cell) -> Optional[bool]:
    """The value of an `if` test MindSpore folds when it compiles (a constant, `self.<attribute>`, `not` of those);
    None when it depends on the inputs."""
    if isinstance(test, ast.Constant):
        return bool(test.value)
    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and test.value.id == "self" and \
            not isinstance(getattr(cell, test.attr, None), (ms.Tensor, nn.Cell)):
        return bool(getattr(cell, test.attr, None))
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _folded(test.operand, cell)
        return None if inner is None else not inner
    return None


def _calls_zeros_like(function, cell) -> bool:
    """Whether `function` (a bprop) calls mindspore.ops.zeros_like outside the branches MindSpore folds away."""
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    namespace = dict(getattr(function, "__globals__", {}))
    namespace.update(_closure(function) if getattr(function, "__closure__", None) else {})
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):   # no source: judge by the names the code uses
        return any(_resolves_to_zeros_like(ast.Name(id=name), namespace) or
                   getattr(namespace.get(name), "zeros_like", None) is _ZEROS_LIKE_FUNCTION for name in code.co_names)

    def visit(node) -> bool:
        if isinstance(node, ast.If):
            taken = _folded(node.test, cell)
            branches = [node.body, node.orelse] if taken is None else [node.body if taken else node.orelse]
            return visit(node.test) or any(visit(child) for branch in branches for child in branch)
        if isinstance(node, ast.Call) and _resolves_to_zeros_like(node.func, namespace):
            return True
        return any(visit(child) for child in ast.iter_child_nodes(node))
    return visit(tree)


def bprops_calling_zeros_like(network: nn.Cell) -> list:
    """``["name (Class)", ...]``: the cells of `network` whose own ``bprop`` calls ``mindspore.ops.zeros_like``."""
    return [f"{name or 'network'} ({type(cell).__name__})" for name, cell in network.cells_and_names()
            if _calls_zeros_like(getattr(type(cell), "bprop", None), cell)]


def training_under_model() -> bool:
    """Whether the caller runs inside ``mindspore.train.Model.train`` (a frame of ``Model._train`` on the stack, found
    the way the enclosing cells are, see 5.; mindspore/train/model.py, checked 2.7.0-2.10.0). Used for a warning only."""
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_train" and code.co_filename.replace("\\", "/").endswith("mindspore/train/model.py"):
            return True
        frame = frame.f_back
    return False


def compiling_graph() -> bool:
    """Whether the caller runs while a graph is being compiled: GRAPH_MODE, or an ``ms.jit`` function being compiled in
    PyNative mode (the jit wrapper's ``staging_specialize`` frame, see 5.)."""
    if ms.get_context("mode") == ms.GRAPH_MODE:
        return True
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        if frame.f_code.co_name == "staging_specialize":
            return True
        frame = frame.f_back
    return False


# --- 10. How semi-auto/auto parallel splits the batch axis of a graph's inputs -----------------------------------------
# In these modes a graph is compiled on global shapes: C++ parallel::ExtendInputArgsAbstractShape/ToFullShape multiply
# each input's axis 0 by the dataset strategy's split of that axis, or by device_num // pipeline_stages when there is
# no strategy and full_batch is off (mindspore/parallel/_utils.py::_need_to_full and _to_full_shapes do the same for
# the dataset's shapes). What a cell sees as axis 0 is therefore the rows of every rank together. Checked 2.7.0-2.10.0.
def batch_axis_splits() -> tuple:
    """How many ranks share axis 0 of each graph input: ``(n,)`` for every input alike, or one entry per input (a
    tuple dataset strategy); ``(1,)`` where inputs are not expanded (full_batch, stand-alone, data parallel) or where
    the strategy is given as Layouts, whose split this does not read."""
    from mindspore.parallel import _utils  # pylint: disable=import-outside-toplevel
    if not _utils._need_to_full():  # pylint: disable=protected-access
        return (1,)
    strategy = ms.get_auto_parallel_context("dataset_strategy")
    if strategy not in ("data_parallel", "full_batch") and strategy:
        return tuple(int(item[0]) if isinstance(item, (tuple, list)) and item and isinstance(item[0], int) else 1
                     for item in strategy)
    try:
        ranks = _utils._get_device_num() // _utils._get_pipeline_stages()  # pylint: disable=protected-access
    except RuntimeError:   # no communication initialised and no device_num set: nothing is expanded yet
        ranks = 1
    return (max(int(ranks), 1),)


# --- 11. Errors from the network inside the micro-batch graph --------------------------------------------------------
# A network built for a fixed batch size (a CTC loss configured with the batch's rows) fails inside the micro-batch
# graph with MindSpore's own message (shapes of the micro-batch, nothing saying so). Cell.compile compiles through
# mindspore.graph.api._cell_graph_executor.compile (common.api in 2.7), an attribute of one module-level object: the
# package wraps that method, the first time one of its cells is built, and adds to an error whose "Traceback of Net
# Construct Code" runs through the engine's call of the network (_engine.TupleInputs) the micro-batches' rows (recorded
# when the graph compiled, _microbatch.plan_inputs), micro_size, and the fix. Everything else passes through unchanged.
# Checked 2.7.0 and 2.10.0. Errors at run time (kernels) and in PyNative mode are left as MindSpore raises them.
# The same wrapper enters the hooks registered with around_compile (the loss contract's eager pass, _contract): Cell's
# compile_and_run calls this compile on every call, with the call's inputs, before it runs the graph it finds cached.
_NETWORK_CALL = "return self.network(*inputs)"
_ENGINE_FILE = "ms_gradaccum/_engine.py"
_CONTRACT_FILE = "ms_gradaccum/_contract.py"
_MICRO_BATCHES = {"last": None}
_WRAPPED = "_ms_gradaccum_context"


def note_micro_batches(cls_name: str, micro_size: int, kinds: tuple, names: tuple, layout: tuple) -> None:
    """Remembers the micro-batches the graph being compiled splits its inputs into (for :func:`micro_batch_context`)."""
    _MICRO_BATCHES["last"] = (cls_name, micro_size, kinds, names, layout)


def micro_batch_context(message: str) -> Optional[str]:
    """What to add to an error raised while compiling the network on a micro-batch; None for other errors."""
    noted = _MICRO_BATCHES["last"]
    if noted is None or _NETWORK_CALL not in message or _ENGINE_FILE not in message.replace("\\", "/"):
        return None
    cls_name, micro_size, kinds, names, layout = noted
    from ms_gradaccum._microbatch import plan  # pylint: disable=import-outside-toplevel
    split = [(index, shape) for index, (shape, (kind, _)) in enumerate(zip(kinds, layout)) if kind == 0]
    if not split:
        return None
    batch = split[0][1][0]
    rows = sorted({rows for _, rows in plan(batch, micro_size)}, reverse=True)
    row_text = " and ".join(str(r) for r in rows)
    inputs = ", ".join(f"input {i}{f' ({names[i]!r})' if i < len(names) else ''} {tuple(shape)} -> "
                       f"{tuple((row_text,) + tuple(shape[1:]))}".replace("'", "") for i, shape in split)
    if _CONTRACT_FILE in message.replace("\\", "/"):
        pair = sum(sorted((rows for count, rows in plan(batch, micro_size) for _ in range(count)), reverse=True)[:2])
        return (f"For '{cls_name}', the error above was raised by the network running on the loss contract's check: "
                f"the first two micro-batches together ({pair} rows; micro_size={micro_size} splits the batch of "
                f"{batch} rows into micro-batches of {row_text}). A network built for a fixed number of rows cannot "
                f"be checked that way: pass check_loss=False (and make sure its loss is what the cell is told).")
    return (f"For '{cls_name}', the error above was raised by the network running on a micro-batch, not on the whole "
            f"batch: micro_size={micro_size} splits the batch of {batch} rows into micro-batches of {row_text} rows "
            f"({inputs}). A cell built for a fixed batch size (e.g. a CTC loss or a reshape configured with the "
            f"batch size) must be built for the micro-batch's rows ({row_text}), not the batch's ({batch}); then pass "
            f"check_loss=False, since the loss contract's check runs two micro-batches together.")


_AROUND_COMPILE = []


def around_compile(hook: Callable) -> None:
    """Enters ``hook(cell, args)`` (a context manager) around each call of the graph executor's compile of a cell on
    `args`: every call of a cell in graph mode, with its inputs (Cell.compile_and_run compiles, finding its cache, before
    each run). The loss contract's eager pass (_contract.around_compile); registered once."""
    if hook not in _AROUND_COMPILE:
        _AROUND_COMPILE.append(hook)


def install_micro_batch_context() -> None:
    """Wraps the graph executor's compile once (see above)."""
    try:
        from mindspore.graph.api import _cell_graph_executor as executor  # pylint: disable=import-outside-toplevel
    except ImportError:
        from mindspore.common.api import _cell_graph_executor as executor  # pylint: disable=import-outside-toplevel
    compile_graph = executor.compile
    if getattr(compile_graph, _WRAPPED, False):
        return

    def compile_with_context(*args, **kwargs):
        try:
            with contextlib.ExitStack() as around:
                for hook in (_AROUND_COMPILE if args else ()):
                    around.enter_context(hook(args[0], args[1:]))
                return compile_graph(*args, **kwargs)
        except Exception as error:
            context = micro_batch_context(str(error))
            if context is not None and error.args and isinstance(error.args[0], str):
                error.args = (f"{error.args[0]}\n\n{context}",) + error.args[1:]
            raise

    setattr(compile_with_context, _WRAPPED, True)
    executor.compile = compile_with_context


# --- 12. Running a network eagerly from anywhere ---------------------------------------------------------------------
# The loss contract's check (_contract) runs the network forward outside any graph, before the first step: from Python
# in GRAPH_MODE too (before a graph compiles). MindSpore switches modes with set_context(mode=...) at any time (a graph
# already compiled is kept and runs as before; checked 2.7.0 and 2.10.0); gradient recording is off for the pass (the
# PyNative executor's set_enable_grad, as mindspore.graph.api._no_grad does; common.api before 2.9), so that a call
# inside a PyNative train step records nothing.
@contextlib.contextmanager
def eager_mode():
    """PyNative mode without gradient recording, for the duration; the mode and recording are restored after. On an
    error, what PyNative recorded is cleared (as MindSpore does when a jit compile fails)."""
    executor = _pynative_executor()
    mode = ms.get_context("mode")
    recording = executor.enable_grad()
    if mode != ms.PYNATIVE_MODE:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    executor.set_enable_grad(False)
    try:
        yield
    except Exception:
        executor.clear_res()
        raise
    finally:
        executor.set_enable_grad(recording)
        if mode != ms.PYNATIVE_MODE:
            ms.set_context(mode=mode)
