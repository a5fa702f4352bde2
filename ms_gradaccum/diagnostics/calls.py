"""When the diagnostics run: the loss contract's probe on the first call (diagnostics.contract), and the context added
to an error the network raises on a micro-batch while the first graph compiles. A steady call runs no package Python.

GRAPH_MODE. A package cell's graph compiles inside the compile of the cell the user calls (``nn.TrainOneStepCell``,
the one ``Model`` builds, or the package cell itself), and MindSpore calls nothing of the package on a call. So:

- install: a package cell, when built, waits for its first compile (:func:`expect_first_compile`), and while any cell
  waits the graph executor's ``compile`` runs :func:`around_first_compile` (``_mindspore.patches.GRAPH_COMPILE``);
- use: that compile runs the probe where the batch reaches the cell being compiled unchanged (the package cell, or
  ``nn.TrainOneStepCell``/``nn.TrainOneStepWithLossScaleCell`` around it), and adds context to its errors;
- undo: once no package cell waits (each compiled, or dropped before its compile), the executor's ``compile`` is
  MindSpore's again; nothing of the package stays on the user's cells.

Where the batch cannot be reached (a train cell of one's own, a ``jit`` function, sink mode) the graph compares values
itself on its first run (``contract.ContractCheck.construct``). PyNative mode: the package cells' own ``__call__``
(:class:`ProbedOnFirstCall`) runs the probe on the first call, and again when the inputs' layout changes.
"""
import contextlib
import weakref

import mindspore as ms
from mindspore import nn

from ms_gradaccum._microbatch import check_tensor_inputs
from ms_gradaccum._mindspore.graph import in_function_gradient
from ms_gradaccum._mindspore.patches import GRAPH_COMPILE
from ms_gradaccum._mindspore.surroundings import child

# The package cells built and not compiled yet (their first compile is under way or to come).
_WAITING: "weakref.WeakSet" = weakref.WeakSet()

# The train cells whose construct hands its inputs, unchanged, to `self.network` (mindspore/nn/wrap/cell_wrapper.py,
# loss_scale.py; checked 2.7.0-2.10.0): what Model builds around GradAccumulationCell, and hand-written loops use.
# Exact types: a subclass may change the inputs.
_PASS_THROUGH = (nn.TrainOneStepCell, nn.TrainOneStepWithLossScaleCell)


def inner_cell(cell: nn.Cell) -> nn.Cell:
    """The cell whose inputs are `cell`'s own: the network of a pass-through train cell, else `cell` itself."""
    if type(cell) in _PASS_THROUGH:   # pylint: disable=unidiomatic-typecheck
        return getattr(cell, "network", None)
    return cell


def _waiting() -> list:
    return list(_WAITING)


def _release_if_none_waits() -> None:
    """Undo: the executor's compile is MindSpore's again once no package cell waits."""
    if not _waiting():
        GRAPH_COMPILE.uninstall()


def expect_first_compile(owner: nn.Cell) -> None:
    """`owner` (a package cell, with an ``engine``) waits for its first compile: the executor's compile is wrapped
    until then (install), and unwrapped when it compiled or was dropped before (undo)."""
    _WAITING.add(owner)
    weakref.finalize(owner, _release_if_none_waits)
    GRAPH_COMPILE.around(around_first_compile)
    GRAPH_COMPILE.decorate_errors(first_compile_context)
    GRAPH_COMPILE.install()


def done_waiting(owner: nn.Cell) -> None:
    """`owner` needs no hook any more (compiled, or called in PyNative mode, where its own call runs the probe)."""
    _WAITING.discard(owner)
    _release_if_none_waits()


def _engine(owner) -> nn.Cell:
    return child(owner, "engine")


def _built(owner) -> bool:
    """Whether `owner`'s engine was laid out by the compile under way (its record was cleared before it)."""
    return _engine(owner).scaled_loss.record.layout is not None


def probe_first_call(owner: nn.Cell, inputs: tuple) -> None:
    """The loss contract's probe on `owner`'s `inputs` (diagnostics.contract), where it has not run on inputs of that
    layout; a kind it finds is the one `owner` trains with."""
    engine = _engine(owner)
    check_tensor_inputs(engine.owner_name, inputs)
    kind = child(owner, "contract").first_call(engine, inputs, refusable=not in_function_gradient(owner))
    if kind is not None:
        owner.use_kind(kind)


@contextlib.contextmanager
def around_first_compile(cell: nn.Cell, args: tuple):
    """Around a compile of `cell` on `args` while package cells wait for their first (a GRAPH_COMPILE hook): where
    `cell` hands its inputs to a waiting package cell, the probe first; then, once no package cell waits, the hook is
    removed."""
    waiting = _waiting()
    if not waiting or ms.get_context("mode") != ms.GRAPH_MODE:
        _release_if_none_waits()
        yield
        return
    owner = inner_cell(cell)
    reached = any(owner is other for other in waiting)
    for other in waiting:
        _engine(other).scaled_loss.record.layout = None
    if reached:
        probe_first_call(owner, args)
    yield
    for other in waiting:   # compiled: its engine is laid out (the record says so)
        if _built(other):
            _WAITING.discard(other)
    _release_if_none_waits()


def first_compile_context(error: Exception, args: tuple):
    """What to add to an `error` of a compile of ``args[0]`` on ``args[1:]`` that built a waiting package cell's graph
    (a GRAPH_COMPILE decorator): diagnostics.failures."""
    built = [owner for owner in _waiting() if _built(owner)]
    if not built or not args:
        return None
    from ms_gradaccum.diagnostics import failures   # pylint: disable=import-outside-toplevel
    return failures.micro_batch_context(error, inner_cell(args[0]), args[1:], built[0])


class ProbedOnFirstCall:
    """Mixed into the package cells (before ``nn.Cell``): in PyNative mode a call runs the loss contract's probe where
    it has not run on inputs of that layout (its first call, mostly), and the compile hook is not needed."""

    def __call__(self, *args, **kwargs):
        if ms.get_context("mode") == ms.PYNATIVE_MODE:
            probe_first_call(self, args)
            done_waiting(self)
        return super().__call__(*args, **kwargs)
