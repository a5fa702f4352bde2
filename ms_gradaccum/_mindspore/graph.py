"""Python that runs while a graph compiles, and switching to eager execution.

``_primexpr`` runs a Python function on constants while the graph compiles (static shapes, constant checks); the
public ``constexpr`` is deprecated in its favour. The PyNative executor lives in ``mindspore.graph.api`` from 2.9
(``mindspore.common.api`` before). Checked 2.7.0-2.10.0.
"""
import contextlib
import weakref

import mindspore as ms
from mindspore import context as _context_module
from mindspore import nn
from mindspore._c_expression import ms_ctx_param as _CONTEXT_PARAM
from mindspore.ops.primitive import _primexpr as primexpr

try:
    from mindspore.graph.api import _pynative_executor as PYNATIVE_EXECUTOR
except ImportError:   # before 2.9
    from mindspore.common.api import _pynative_executor as PYNATIVE_EXECUTOR


class CompileChecks:
    """Passed to :func:`run_compile_checks` at the top of a cell's ``construct``: calls ``owner.check_at_compile()``.

    Exceptions raised inside a :class:`compile_time` attribute are swallowed by the graph parser, which reports the
    attribute as missing ("object has no attribute"); a ``_primexpr`` receives this plain Python object and its
    exceptions reach the user unchanged. The parser may read attributes of the cell before it evaluates this call
    (it resolves them as it meets them), so no attribute the graph reads raises or changes anything: the values are
    bound before the compile (``cells.binding``), and these checks only compare and raise.
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
            # error left that recording open, and the next training in the process failed with unrelated shape errors.
            # MindSpore clears it the same way when a jit compile fails (mindspore/graph/api.py).
            if ms.get_context("mode") == ms.PYNATIVE_MODE:
                PYNATIVE_EXECUTOR.clear_res()
            raise


@primexpr
def run_compile_checks(checks: CompileChecks) -> None:
    """Raises the owner's configuration errors (and warns) when its graph compiles; every call in PyNative mode."""
    checks.run()


class compile_time:  # pylint: disable=invalid-name
    """A read-only attribute computed by a Python method each time it is read, also while a graph compiles.

    MindSpore's graph parser compiles a ``property``'s body as graph code, but reads any other descriptor through
    Python's ``getattr`` (checked in 2.10.0): ``self.x`` in ``construct`` is evaluated in Python when the graph
    compiles. For what is only known then (the communication set up, the parallel context's batch axis, whether the
    loss contract was read); a value known when the cell is built or bound is a plain attribute instead. The method
    reads, never creates or changes anything, and must not raise (the parser would report a missing attribute):
    errors go through :class:`CompileChecks`.
    """

    def __init__(self, method):
        self.method = method
        self.__doc__ = method.__doc__

    def __get__(self, obj, owner=None):
        return self if obj is None else self.method(obj)


def traceback_runs_through(message: str, function) -> bool:
    """Whether MindSpore's "Traceback of Net Construct Code" in an error `message` runs through the first line of the
    body of `function` (``In file <file>:<line>,``; checked 2.7.0-2.10.0)."""
    code = function.__code__
    return f"{code.co_filename}:{code.co_firstlineno + 1}," in message


# Running a network eagerly from anywhere (the loss contract's pass, before a graph compiles, in GRAPH_MODE too):
# set_context(mode=...) switches at any time (a compiled graph is kept; checked 2.7.0 and 2.10.0); gradient recording
# is off (the executor's set_enable_grad, as _no_grad does), so a call inside a PyNative train step records nothing.
# On CPU the pass runs synchronously: the asynchronous pipeline costs more than the operators there
# (docs/measurements.md); the flag is set_context(pynative_synchronize=...)'s, read and restored through the context
# object (set_context warns that the key is deprecated). On GPU/Ascend the pipeline overlaps host and device: left.
@contextlib.contextmanager
def eager_mode():
    """PyNative mode without gradient recording (and, on CPU, with synchronous execution), for the duration; the mode,
    recording and execution are restored after. On an error, what PyNative recorded is cleared (as MindSpore does when
    a jit compile fails)."""
    executor = PYNATIVE_EXECUTOR
    mode = ms.get_context("mode")
    recording = executor.enable_grad()
    context = _context_module._context()   # pylint: disable=protected-access
    synchronous = context.get_param(_CONTEXT_PARAM.pynative_synchronize)
    if mode != ms.PYNATIVE_MODE:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    executor.set_enable_grad(False)
    if ms.get_context("device_target") == "CPU":
        context.set_param(_CONTEXT_PARAM.pynative_synchronize, True)
    try:
        yield
    except Exception:
        executor.clear_res()
        raise
    finally:
        context.set_param(_CONTEXT_PARAM.pynative_synchronize, synchronous)
        executor.set_enable_grad(recording)
        if mode != ms.PYNATIVE_MODE:
            ms.set_context(mode=mode)


def in_function_gradient(cell: nn.Cell) -> bool:
    """Whether, in PyNative mode, `cell` runs inside a gradient that the caller takes of a Python function
    (``ms.value_and_grad(forward_fn)``): PyNative builds a gradient graph and `cell` was not made a gradient's cell (a
    train cell's network, or the function of ``ms.value_and_grad`` itself). An error raised by an eager pass there loses
    that gradient's record (MindSpore clears its top cell: "Can not find top cell for backward")."""
    return ms.get_context("mode") == ms.PYNATIVE_MODE and PYNATIVE_EXECUTOR.grad_flag() and not cell.requires_grad


@contextlib.contextmanager
def gradients_recorded():
    """Gradient recording on inside :func:`eager_mode` (which turns it off), for the duration; restored after."""
    executor = PYNATIVE_EXECUTOR
    recording = executor.enable_grad()
    executor.set_enable_grad(True)
    try:
        yield
    finally:
        executor.set_enable_grad(recording)
