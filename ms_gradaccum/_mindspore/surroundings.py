"""The cells around a cell, found by walking down the cell tree from the root MindSpore compiles; how ``Model`` routes a
cell by name; the parallel mode; the internals of a Cell the package reads or writes (its own Parameter dict, the
precision flags, a copy of its own). Checked 2.7.0-2.10.0.

MindSpore keeps no parent pointer; the graph executor's ``compile`` is handed the root of what it compiles (the train
cell ``Model`` builds, the user's ``nn.TrainOneStepCell``, or the package cell itself). :func:`around` walks down from
that root to the cell, once per binding (``cells.binding``), and describes what it passes in one frozen
:class:`Surroundings`. Nothing here reads the stack.
"""
import collections
import contextlib
import copy
import dataclasses
import operator
from typing import Optional

import mindspore as ms
from mindspore import nn
# What Model builds for a routed cell in semi-auto/auto parallel; it applies no loss scale of its own while the
# optimizer divides by its loss_scale (mindspore/train/amp.py::build_train_network). Named here for
# cells.grad_accumulation and .parallel.
from mindspore.nn.wrap.cell_wrapper import _TrainGradAccuStepCell as TrainGradAccuStepCell  # noqa: F401
from mindspore.nn.wrap.loss_scale import _TrainGradAccuWithLossScaleCell
from mindspore.parallel.auto_parallel import AutoParallel

# The cells whose construct hands its inputs, unchanged, to `self.network` (mindspore/nn/wrap/cell_wrapper.py,
# loss_scale.py, parallel/auto_parallel.py; checked 2.7.0-2.10.0): what Model builds around a package cell (for
# semi-auto/auto parallel too), and what hand-written loops use. Exact types: a subclass may change the inputs.
PASS_THROUGH = (nn.TrainOneStepCell, nn.TrainOneStepWithLossScaleCell, TrainGradAccuStepCell,
                _TrainGradAccuWithLossScaleCell, AutoParallel)


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


@dataclasses.dataclass(frozen=True)
class Surroundings:
    """What is around a cell in the tree of the root being compiled (:func:`around`); all None where nothing is (the
    cell is the root, or the root is not known: a jit function's compile, PyNative mode)."""

    train_cell: Optional[nn.TrainOneStepCell] = None   # the innermost nn.TrainOneStepCell (or subclass) around it
    optimizer: Optional[nn.Optimizer] = None           # the optimizer of the innermost cell around it holding one
    loss_wrapper: Optional[nn.Cell] = None             # a cell computing a loss of its output (its _backbone)


def enclosing_cells(cell: nn.Cell, root: nn.Cell) -> Optional[list]:
    """The cells of `root`'s tree on the way down to `cell` (`root` first, `cell` left out); None where the tree does
    not hold `cell`. One walk of ``root.cells_and_names()``, whose names are the paths."""
    path = next((name for name, candidate in root.cells_and_names() if candidate is cell), None)
    if path is None:
        return None
    cells, current = [], root
    for part in path.split(".") if path else ():
        cells.append(current)
        current = current._cells[part]  # pylint: disable=protected-access
    return cells


def around(cell: nn.Cell, root: nn.Cell) -> Optional[Surroundings]:
    """The surroundings of `cell` in `root`'s tree (None where the tree does not hold it)."""
    enclosing = enclosing_cells(cell, root)
    if enclosing is None:
        return None
    inner_first = enclosing[::-1]
    return Surroundings(
        train_cell=next((c for c in inner_first if isinstance(c, nn.TrainOneStepCell)), None),
        optimizer=_optimizer_of(inner_first),
        loss_wrapper=next((c for c in inner_first if child(c, "_backbone") is cell), None))


def _optimizer_of(enclosing: list) -> Optional[nn.Optimizer]:
    for candidate in enclosing:
        optimizer = candidate.__dict__.get("optimizer") or candidate._cells.get("optimizer")  # pylint: disable=protected-access
        if isinstance(optimizer, nn.Optimizer):
            return optimizer
    return None


# --- Routing ----------------------------------------------------------------------------------------------------------
# ``mindspore/train/amp.py::_is_grad_accumulation`` checks each cell's ``cls_name`` (a property) against ROUTED_NAMES; a
# match makes ``Model`` wrap the network in ``_TrainGradAccuStepCell``, whose optimizer reads buffers only the
# semi-auto/auto-parallel pass writes (elsewhere it trains nothing). Checked 2.7.0-2.10.0.

ROUTED_NAMES = frozenset({"GradAccumulationCell", "GradAccumulation"})
PARALLEL_PASS_MODES = frozenset({ms.ParallelMode.SEMI_AUTO_PARALLEL, ms.ParallelMode.AUTO_PARALLEL})


def parallel_mode() -> str:
    """The parallel mode in force (public API)."""
    return ms.get_auto_parallel_context("parallel_mode")


def parallel_pass_in_force() -> bool:
    """Whether MindSpore's semi-auto/auto-parallel pass accumulates (the mode in force now: ``AutoParallel`` sets it
    only while Model builds its train cell and while the graph compiles): the one definition the package reads."""
    return parallel_mode() in PARALLEL_PASS_MODES


@contextlib.contextmanager
def stand_alone():
    """The parallel mode set to stand-alone while the block runs, then put back (the rest of the auto-parallel context
    is untouched: public API): the loss contract reads and runs the loss network alone, on this process, where the
    semi-auto/auto-parallel pass would otherwise plan a distributed graph for it."""
    mode = parallel_mode()
    if mode == ms.ParallelMode.STAND_ALONE:
        yield
        return
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.STAND_ALONE)
    _PUT_ASIDE.append(mode)
    try:
        yield
    finally:
        _PUT_ASIDE.pop()
        ms.set_auto_parallel_context(parallel_mode=mode)


_PUT_ASIDE = []   # the modes stand_alone() has set aside, innermost last


def parallel_pass_outside() -> bool:
    """Whether MindSpore's semi-auto/auto-parallel pass is in force, or is where a :func:`stand_alone` block now
    running was entered: what the training will run under (advice given stand-alone must hold there)."""
    return parallel_pass_in_force() or any(mode in PARALLEL_PASS_MODES for mode in _PUT_ASIDE)


def data_parallel_in_force() -> bool:
    """Whether data parallel is in force: the one definition the cells and their cross-rank parts read (when a graph
    compiles: the context may be set after a cell is built). Communication must be initialised too, which the cells
    check first (``parallel.data_parallel.check_data_parallel_ready``), with a clear error."""
    return parallel_mode() == ms.ParallelMode.DATA_PARALLEL


# --- A Cell's internals (checked 2.7.0-2.10.0) ------------------------------------------------------------------------

# The flags Cell.to_float sets on every cell of a tree (``amp_level`` O2/O3 call it): a flagged cell casts every float
# tensor it handles. mindspore/nn/cell.py::to_float.
PRECISION_FLAGS = ("fp16", "fp32", "bf16")


def child(cell, name: str):
    """`cell`'s child cell `name` from its cell table (``Cell._cells``), or None; without ``Cell.__getattr__`` (nor a
    compile-time attribute of that name) being read. Anything not a Cell has no children."""
    return cell.__dict__.get("_cells", {}).get(name) if isinstance(cell, nn.Cell) else None


def set_child(cell: nn.Cell, name: str, part: nn.Cell) -> None:
    """Puts `part` into `cell`'s cell table as `name` (``insert_child_to_cell``'s ``hasattr`` would read a compile-time
    attribute of that name)."""
    cell._cells[name] = part  # pylint: disable=protected-access


def own_parameters(cell: nn.Cell) -> dict:
    """The dict of the Parameters `cell` holds itself (``Cell._params``), to add and drop buffers by name in place:
    ``insert_param_to_cell`` adds, and nothing public removes one."""
    return cell._params  # pylint: disable=protected-access


def copy_cell(cell: nn.Cell) -> nn.Cell:
    """A new cell of `cell`'s class holding the same children, Parameters and settings in a table and an attribute dict
    of its own: setting an attribute or replacing a child of the copy leaves `cell` as it is. (``copy.copy`` of a Cell
    shares its ``__dict__``: ``Cell.__setstate__`` assigns the very dict ``__getstate__`` returned.) The copy starts
    without compiled graphs, and counts as a Cell instance as ``Cell.__init__`` counts them (``Cell.__del__`` uncounts
    it)."""
    new = copy.copy(cell)
    object.__setattr__(new, "__dict__", dict(cell.__dict__))
    new.__dict__["_cells"] = collections.OrderedDict(cell._cells)  # pylint: disable=protected-access
    new.__dict__["_compile_cache"] = None
    nn.Cell.total_instance_count += 1
    if cell in nn.Cell.global_cells:
        nn.Cell.global_cells[new] = nn.Cell.global_cells[cell]
    return new


def with_child_replaced(root: nn.Cell, path: str, child: nn.Cell) -> nn.Cell:
    """A copy of `root` (:func:`copy_cell`) in which the cell at `path` (a name of ``root.cells_and_names()``) is
    `child`: the cells on the way to it are copied, every other cell is shared."""
    head, _, rest = path.partition(".")
    new = copy_cell(root)
    inner = root._cells[head]  # pylint: disable=protected-access
    new._cells[head] = with_child_replaced(inner, rest, child) if rest else child  # pylint: disable=protected-access
    return new


# What nn.Cell itself keeps in a cell's __dict__ (its bookkeeping, which an eager call updates as any call does).
_CELL_BOOKKEEPING = frozenset(vars(nn.Cell()))
_PLAIN = (bool, int, float, str, type(None))


def _plain_state(cell: nn.Cell) -> dict:
    """The plain attributes a cell keeps of its own (not nn.Cell's bookkeeping)."""
    return {key: value for key, value in vars(cell).items()
            if key not in _CELL_BOOKKEEPING and isinstance(value, _PLAIN)}


@contextlib.contextmanager
def call_state_kept(network: nn.Cell):
    """Puts back the plain attributes that cells with a ``__call__`` of their own set while the pass called them: the
    graph then compiles the network as it would have without the pass. ``nn.MultiheadAttention.__call__`` records
    whether its key is its value and its query its key (graph mode cannot test ``is``), and its ``construct`` then
    takes the branch for the last call: a module called for cross- and then self-attention would compile both calls
    as self-attention."""
    kept = [(cell, _plain_state(cell)) for _, cell in network.cells_and_names()
            if type(cell).__call__ is not nn.Cell.__call__]
    try:
        yield
    finally:
        for cell, attributes in kept:
            for key in _plain_state(cell).keys() - attributes.keys():
                del cell.__dict__[key]
            cell.__dict__.update(attributes)


def phase_noting(flag: str) -> property:
    """``Cell.phase`` for a Cell subclass, setting the cell's attribute `flag` True at each set (``Model`` sets it on
    the network it trains: mindspore/train/model.py, ``_exec_preprocess``; checked 2.7.0-2.10.0). MindSpore reads it on
    every call: the getter is ``operator.attrgetter`` of Cell's own attribute, which runs no Python."""
    def set_phase(cell: nn.Cell, value: str) -> None:
        nn.Cell.phase.fset(cell, value)
        object.__setattr__(cell, flag, True)
    return property(operator.attrgetter("_phase"), set_phase, doc=nn.Cell.phase.__doc__)
