"""When the diagnostics run: the loss contract's eager passes before the steps ``contract.check_due`` names, and the
context added to a compile error the network raises on a micro-batch. A steady call runs no package Python but a step
counter.

GRAPH_MODE. A package cell's graph compiles inside the compile of the cell the user calls (``nn.TrainOneStepCell``,
the one ``Model`` builds, or the package cell itself), and MindSpore calls nothing of the package on a call. So:

- install: a package cell, when built, waits for its first compile (:func:`expect_first_compile`), and while any cell
  waits the graph executor's ``compile`` runs :func:`around_first_compile` (``_mindspore.patches.GRAPH_COMPILE``);
- use: that compile runs the first step's check where the batch reaches the cell being compiled unchanged (the package
  cell, or ``nn.TrainOneStepCell``/``nn.TrainOneStepWithLossScaleCell`` around it), adds context to its errors, and
  gives that cell a ``compile`` of its own, :func:`count_steps`' counter: on each later call, the step is counted and,
  on the steps due, the check runs before the graph (its recompiles' errors get the context too);
- undo: once no package cell waits, the executor's ``compile`` is MindSpore's again (a plain cell compiled later runs
  no package code).

Where the batch cannot be reached (a train cell of one's own, a ``jit`` function, sink mode) the graph runs the check
itself (``contract.ContractCheck.construct``). PyNative mode: the package cells' own ``__call__``
(:class:`CountedCalls`) counts, each call, where ``construct`` runs in Python anyway.
"""
import contextlib
import weakref

import mindspore as ms
from mindspore import nn

from ms_gradaccum._microbatch import check_tensor_inputs
from ms_gradaccum._mindspore.patches import GRAPH_COMPILE, with_context
from ms_gradaccum._mindspore.surroundings import child
from ms_gradaccum.diagnostics.contract import RECHECK_EVERY

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


def expect_first_compile(owner: nn.Cell) -> None:
    """`owner` (a package cell, with an ``engine``) waits for its first compile: the executor's compile is wrapped
    until then (install)."""
    _WAITING.add(owner)
    GRAPH_COMPILE.around(around_first_compile)
    GRAPH_COMPILE.decorate_errors(first_compile_context)
    GRAPH_COMPILE.install()


def _engine(owner) -> nn.Cell:
    return child(owner, "engine")


@contextlib.contextmanager
def around_first_compile(cell: nn.Cell, args: tuple):
    """Around a compile of `cell` on `args` while package cells wait for their first (a GRAPH_COMPILE hook): where
    `cell` hands its inputs to a waiting package cell, its step counted (the first step's check) and, after the
    compile, the step counter given to `cell`; then, once no package cell waits, the hook is removed."""
    waiting = list(_WAITING)
    if not waiting or ms.get_context("mode") != ms.GRAPH_MODE:
        yield
        return
    owner = inner_cell(cell)
    reached = any(owner is other for other in waiting)
    for other in waiting:
        object.__setattr__(_engine(other), "graph_built", False)
    if reached:
        check_tensor_inputs(_engine(owner).owner_name, args)
        _engine(owner).contract.count_step(_engine(owner), args)
    yield
    for other in waiting:   # compiled: its graph is built (engine.buffers, read while it compiles, says so)
        if _engine(other).graph_built:
            _WAITING.discard(other)
    if reached and not any(owner is other for other in _WAITING):
        count_steps(cell, owner)
    if not _WAITING:
        GRAPH_COMPILE.uninstall()


def first_compile_context(error: Exception, args: tuple):
    """What to add to an `error` of a compile of ``args[0]`` on ``args[1:]`` that built a waiting package cell's graph
    (a GRAPH_COMPILE decorator): diagnostics.failures."""
    built = [_engine(owner) for owner in list(_WAITING) if _engine(owner).graph_built]
    if not built or not args:
        return None
    from ms_gradaccum.diagnostics import failures   # pylint: disable=import-outside-toplevel
    return failures.micro_batch_context(error, inner_cell(args[0]), args[1:], built[0])


def count_steps(cell: nn.Cell, owner: nn.Cell) -> None:
    """Gives `cell` (the package cell `owner`, or a pass-through train cell around it) a ``compile`` of its own, which
    ``Cell.__call__`` runs on each GRAPH_MODE call before the compiled graph: the step counter (use)."""
    if "compile" in cell.__dict__:
        return
    engine = _engine(owner)
    contract, name, compile_cell = engine.contract, engine.owner_name, cell.compile

    def counted_compile(*args, **kwargs):
        # One function per call: inputs checked, the step counted, the check run on the steps due, then MindSpore's
        # compile (the cached graph, or a recompile whose errors get the context).
        for x in args:
            if type(x).__module__ == "numpy":
                check_tensor_inputs(name, args)
        contract.steps += 1
        step = contract.steps
        if (step & (step - 1) == 0) if step <= RECHECK_EVERY else step % RECHECK_EVERY == 0:
            contract.check_step(engine, args)
        try:
            return compile_cell(*args, **kwargs)
        except Exception as error:
            _add_context(error, owner, engine, args)
            raise

    cell.__dict__["compile"] = counted_compile


def _add_context(error: Exception, owner: nn.Cell, engine: nn.Cell, args: tuple) -> None:
    if getattr(error, "ms_gradaccum_context", False):
        return   # GRAPH_COMPILE's decorator added it
    from ms_gradaccum.diagnostics import failures   # pylint: disable=import-outside-toplevel
    context = failures.micro_batch_context(error, owner, args, engine)
    if context is not None:
        with_context(error, context)


class CountedCalls:
    """Mixed into the package cells (before ``nn.Cell``): in PyNative mode each call counts its step (the loss
    contract's check first, on the steps due)."""

    def __call__(self, *args, **kwargs):
        if ms.get_context("mode") == ms.PYNATIVE_MODE:
            engine = _engine(self)
            check_tensor_inputs(engine.owner_name, args)
            engine.contract.count_step(engine, args)
        return super().__call__(*args, **kwargs)
