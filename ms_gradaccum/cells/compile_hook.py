"""Python the package runs around a compile, and none on a steady call: the package cells' binding and first-call work
(``before_compile``), before the compile that builds their graph.

GRAPH_MODE: a package cell's graph compiles inside the compile of the cell the user calls (``nn.TrainOneStepCell``,
the one ``Model`` builds, or the package cell itself), and MindSpore calls nothing of the package on a call. So:

- install: a package cell waits for its next compile (:func:`expect_compile`) when it is built, when a train cell is
  built around it (its ``set_grad``) and on its ``rebind()``; while any cell waits, the graph executor's ``compile``
  runs :func:`around_compile` (``_mindspore.patches.GRAPH_COMPILE``), and the ``jit`` executor's
  :func:`around_jit_compile` (``JIT_COMPILE``: a functional loop);
- use: before a compile whose root holds a waiting cell in its tree, ``cell.before_compile(root, args)`` (it binds from
  that root, and prepares the loss contract's reading); after it, before the graph runs, ``cell.compiled(root, args)``
  reads the contract from the compiled step's graph, and where the cell must train with another kind the root compiles
  once more; an error of that compile gets the context of the cell whose engine it laid out
  (``cell.compile_error_context``); a ``jit`` function's compile is read the same way, for the cells whose compile
  checks ran in it (``compiled_elsewhere``);
- undo: after the compile, the cells it held stop waiting (a stop leaves them waiting, so every call stops); once none
  waits (or each was dropped before a compile), both executors' ``compile`` is MindSpore's again.

PyNative mode compiles nothing: the cells' own ``__call__`` does that work and stops them waiting.
"""
import contextlib
import weakref

import mindspore as ms
from mindspore import nn

from ms_gradaccum._mindspore.patches import GRAPH_COMPILE, JIT_COMPILE
from ms_gradaccum._mindspore.surroundings import child

# The package cells waiting for their next compile.
_WAITING: "weakref.WeakSet" = weakref.WeakSet()


def waiting() -> list:
    return list(_WAITING)


def _release_if_none_waits() -> None:
    """Undo: the executors' compile is MindSpore's again once no package cell waits."""
    if not waiting():
        GRAPH_COMPILE.uninstall()
        JIT_COMPILE.uninstall()


def expect_compile(owner: nn.Cell) -> None:
    """`owner` (a package cell) waits for its next compile: the executor's compile is wrapped until then (install), and
    unwrapped when it compiled or was dropped before (undo)."""
    if owner in _WAITING:
        return
    _WAITING.add(owner)
    weakref.finalize(owner, _release_if_none_waits)
    GRAPH_COMPILE.around(around_compile)
    GRAPH_COMPILE.decorate_errors(_error_context)
    GRAPH_COMPILE.install()
    JIT_COMPILE.around(around_jit_compile)
    JIT_COMPILE.install()


def done_waiting(owner: nn.Cell) -> None:
    """`owner` needs no hook any more (compiled, or called in PyNative mode, where its own call does the work)."""
    _WAITING.discard(owner)
    _release_if_none_waits()


def laid_out(owner: nn.Cell) -> bool:
    """Whether `owner`'s engine was laid out by the compile under way (its record is cleared before it)."""
    engine = child(owner, "engine")
    return engine is not None and engine.scaled_loss.record.layout is not None


@contextlib.contextmanager
def around_compile(root: nn.Cell, args: tuple):
    """Around a compile of `root` on `args` while package cells wait (a GRAPH_COMPILE hook): each waiting cell that
    `root`'s tree holds is prepared first, and read after (its ``compiled``); where one must compile again, the answer
    yielded says so (``again``) and the cells keep waiting for that compile; once none waits, the hook is removed."""
    answer = Answer()
    cells = waiting()
    if not cells or ms.get_context("mode") != ms.GRAPH_MODE:
        _release_if_none_waits()
        yield answer
        return
    in_tree = {id(cell) for _, cell in root.cells_and_names()}   # one walk of the tree, whatever number of cells wait
    held = [owner for owner in cells if id(owner) in in_tree]
    for owner in cells:
        engine = child(owner, "engine")
        if engine is not None:
            engine.scaled_loss.record.layout = None
    failed = True
    try:
        for owner in held:
            owner.before_compile(root, args)
        yield answer
        failed = False
    finally:
        for owner in held:
            owner.after_compile(failed)
    for owner in held:   # compiled, before its graph runs: the loss contract read from the step's graph
        answer.again = owner.compiled(root, args) or answer.again
    if answer.again:
        return
    for owner in held:   # compiled: no longer waiting (a failed compile, or a stop, leaves them waiting for the next)
        _WAITING.discard(owner)
    _release_if_none_waits()


# The package cells each `jit` compile under way has compiled (their compile checks ran in it), innermost last.
_JIT_COMPILES: list = []


def compiled_in_jit(owner: nn.Cell) -> None:
    """`owner`'s graph is being compiled inside a ``jit`` function (its compile checks say so): read after it."""
    if _JIT_COMPILES:
        _JIT_COMPILES[-1].append(owner)


@contextlib.contextmanager
def around_jit_compile(executor):
    """Around a compile of a ``jit`` function while package cells wait (a JIT_COMPILE hook): each waiting cell prepares
    the loss contract's reading (which cells the function holds is known only as it compiles: ``compiled_in_jit``);
    after it, the cells it compiled read the contract from its graph (the answer's ``phase``), the others undo."""
    answer = Answer()
    cells = waiting()
    if not cells or ms.get_context("mode") != ms.GRAPH_MODE:
        yield answer
        return
    prepared = [owner for owner in cells if owner.expect_jit_compile()]
    compiled = []
    _JIT_COMPILES.append(compiled)
    failed = True
    try:
        yield answer
        failed = False
    finally:
        _JIT_COMPILES.pop()
        for owner in prepared:
            if failed or owner not in compiled:
                owner.after_compile(failed=True)
    if not failed:
        for owner in compiled:
            try:
                answer.again = owner.compiled_in(executor, answer.phase) or answer.again
            except Exception:
                expect_compile(owner)   # stopped: the function compiles, and stops, again at its next call
                raise


class Answer:
    """What a compile hook says after the compile: whether it must compile again (the patch does), and the phase it
    compiled (a ``jit`` function's, given to its hooks)."""

    def __init__(self):
        self.again = False
        self.phase = None


def _error_context(error: Exception, args: tuple):
    """What to add to an `error` of a compile of ``args[0]`` on ``args[1:]`` that laid out a waiting package cell's
    engine (a GRAPH_COMPILE decorator)."""
    built = [owner for owner in waiting() if laid_out(owner)]
    if not built or not args:
        return None
    return built[0].compile_error_context(error, args[0], args[1:])
