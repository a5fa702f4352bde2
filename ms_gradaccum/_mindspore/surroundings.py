"""The cells and the gradient call around a cell: what the package finds when nobody hands it over.

MindSpore keeps no parent pointer, and GraphExecutor does not expose the cell being compiled: the cells around a cell
are found among the ``self`` of the frames on the stack (Cell.compile's in graph mode, the constructs' in PyNative).
The stack is walked once per cell and compile (or PyNative call) into one frozen :class:`Surroundings`
(:func:`discover`). Checked 2.7.0-2.10.0. Also here: how ``Model`` routes a cell by name, the parallel mode, and the
internals of a Cell the package reads or writes (its own Parameter dict, the precision flags, a copy of its own).
"""
import collections
import copy
import dataclasses
import sys
import weakref
from typing import Optional

import mindspore as ms
from mindspore import nn
# What Model builds for a routed cell in semi-auto/auto parallel; it applies no loss scale of its own while the
# optimizer divides by its loss_scale (mindspore/train/amp.py::build_train_network). Named here for _cell and .parallel.
from mindspore.nn.wrap.cell_wrapper import _TrainGradAccuStepCell as TrainGradAccuStepCell  # noqa: F401

_ENCLOSING_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def distinct(items) -> list:
    """`items` in order, each object once (by identity: Cells and Parameters may define ``==`` otherwise)."""
    kept = []
    for item in items:
        if all(item is not seen for seen in kept):
            kept.append(item)
    return kept


def _enclosing_cells(cell: nn.Cell, roots: tuple) -> list:
    """The cells among those being compiled or called (`roots`: the stack's) whose tree holds `cell` (not `cell`
    itself), innermost first."""
    cached = _ENCLOSING_CACHE.get(cell)
    # The same cells on the stack (by identity, not by a reusable id) give the same answer: reuse it.
    if cached is not None and len(cached[0]) == len(roots) and all(r() is root for r, root in zip(cached[0], roots)):
        found = [ref() for ref in cached[1]]
        if all(c is not None for c in found):
            return found
    candidates = distinct(candidate for root in roots for _, candidate in root.cells_and_names())
    found = [candidate for candidate in candidates
             if candidate is not cell and any(sub is cell for _, sub in candidate.cells_and_names())]
    found.sort(key=lambda c: len(list(c.cells_and_names())))
    _ENCLOSING_CACHE[cell] = (tuple(weakref.ref(root) for root in roots), tuple(weakref.ref(c) for c in found))
    return found


@dataclasses.dataclass(frozen=True)
class Stack:
    """What the frames on the stack show, read in one walk by :func:`read_stack`, the only function of the package that
    reads frames: the cells being compiled or called (innermost first), whether a jit function is being compiled, and
    whether ``Model.train`` runs.
    """
    cells: tuple
    compiling_jit: bool
    under_model: bool


def _is_model_train(code) -> bool:
    # mindspore/train/model.py's Model._train, checked 2.7.0-2.10.0.
    return code.co_name == "_train" and code.co_filename.replace("\\", "/").endswith("mindspore/train/model.py")


def read_stack() -> Stack:
    """The stack of the caller, read once (see :class:`Stack`)."""
    cells, compiling_jit, under_model = [], False, False
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        code = frame.f_code
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Cell):
            cells.append(owner)
        compiling_jit = compiling_jit or code.co_name == "staging_specialize"   # the jit wrapper compiling its function
        under_model = under_model or _is_model_train(code)
        frame = frame.f_back
    return Stack(tuple(distinct(cells)), compiling_jit, under_model)


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
    """What is around a cell when its graph compiles (every call in PyNative), found by :func:`discover` in one walk."""

    train_cell: Optional[nn.TrainOneStepCell]   # the innermost nn.TrainOneStepCell (or subclass) around it
    optimizer: Optional[nn.Optimizer]           # the optimizer of the innermost cell around it holding one
    loss_wrapper: Optional[nn.Cell]             # a cell computing a loss of its output (it is that cell's _backbone)
    under_model: bool                           # whether Model.train is running it


def discover(cell: nn.Cell) -> Surroundings:
    """The surroundings of `cell`, from one walk of the stack (the package cells walk once per compile:
    :class:`FoundOnce`)."""
    stack = read_stack()
    enclosing = _enclosing_cells(cell, stack.cells)
    optimizer = _optimizer_of(enclosing)
    return Surroundings(
        train_cell=next((c for c in enclosing if isinstance(c, nn.TrainOneStepCell)), None),
        optimizer=optimizer,
        loss_wrapper=next((c for c in enclosing if child(c, "_backbone") is cell), None),
        under_model=stack.under_model)


def _optimizer_of(enclosing: list) -> Optional[nn.Optimizer]:
    for candidate in enclosing:
        optimizer = candidate.__dict__.get("optimizer") or candidate._cells.get("optimizer")  # pylint: disable=protected-access
        if isinstance(optimizer, nn.Optimizer):
            return optimizer
    return None


class FoundOnce:
    """Mixed into the package cells: their surroundings found once per compile, at its start (``check_at_compile``),
    and in PyNative mode on the first call only (the stack is not read on every call); whoever needs them reads
    :func:`surroundings_of` the cell."""

    def find_surroundings(self) -> Surroundings:
        found = self.__dict__.get("surroundings")
        if found is None or ms.get_context("mode") != ms.PYNATIVE_MODE:
            found = discover(self)
            self.__dict__["surroundings"] = found
        return found


def surroundings_of(owner: nn.Cell) -> Surroundings:
    """`owner`'s surroundings as its compile found them (:class:`FoundOnce`); found now where it has not compiled."""
    found = owner.__dict__.get("surroundings")
    return discover(owner) if found is None else found


# --- Routing ----------------------------------------------------------------------------------------------------------
# ``mindspore/train/amp.py::_is_grad_accumulation`` checks each cell's ``cls_name`` (a property) against ROUTED_NAMES; a
# match makes ``Model`` wrap the network in ``_TrainGradAccuStepCell``, whose optimizer reads buffers only the
# semi-auto/auto-parallel pass writes (elsewhere it trains nothing). Checked 2.7.0-2.10.0.

ROUTED_NAMES = frozenset({"GradAccumulationCell", "GradAccumulation"})
PARALLEL_PASS_MODES = frozenset({ms.ParallelMode.SEMI_AUTO_PARALLEL, ms.ParallelMode.AUTO_PARALLEL})


def parallel_mode() -> str:
    """The parallel mode in force (public API)."""
    return ms.get_auto_parallel_context("parallel_mode")


def data_parallel_in_force() -> bool:
    """Whether data parallel is in force: the one definition the cells and their cross-rank parts read (when a graph
    compiles: the context may be set after a cell is built). Communication must be initialised too, which the cells
    check first (``_parallel.check_data_parallel_ready``), with a clear error."""
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
