"""The diagnostics a package cell runs before its first step: the loss contract's probe on its first call
(diagnostics.contract), and the context added to an error the network raises on a micro-batch while a graph compiles.
The cells call them (``cells.binding``); a steady call runs no package Python.

GRAPH_MODE: the compile hook (``cells.compile_hook``) calls the cell's ``before_compile``, which runs
:func:`probe_first_call` where the batch reaches the cell being compiled unchanged (the package cell, or
``nn.TrainOneStepCell``/``nn.TrainOneStepWithLossScaleCell`` around it); where it cannot be reached (a train cell of
one's own, a ``jit`` function, sink mode) the graph compares values itself on its first run
(``contract.ContractCheck.construct``). PyNative mode: the cells' own ``__call__`` runs the probe on the first call,
and again when the inputs' layout changes.
"""
from mindspore import nn

from ms_gradaccum._mindspore.graph import in_function_gradient
from ms_gradaccum._mindspore.surroundings import PASS_THROUGH, child
from ms_gradaccum.core.microbatch import check_tensor_inputs

def inner_cell(cell: nn.Cell) -> nn.Cell:
    """The cell whose inputs are `cell`'s own: followed down through the cells that hand their inputs on unchanged
    (``_mindspore.surroundings.PASS_THROUGH``: the train cells ``Model`` builds, ``AutoParallel``), else `cell`."""
    while type(cell) in PASS_THROUGH:   # pylint: disable=unidiomatic-typecheck
        cell = getattr(cell, "network", None)
    return cell


def probe_first_call(owner: nn.Cell, inputs: tuple) -> None:
    """The loss contract's probe on `owner`'s `inputs` (diagnostics.contract), where it has not run on inputs of that
    layout; a kind it finds is the one `owner` trains with."""
    engine = child(owner, "engine")
    check_tensor_inputs(engine.owner_name, inputs)
    kind = child(owner, "contract").first_call(engine, inputs, refusable=not in_function_gradient(owner))
    if kind is not None:
        owner.use_kind(kind)


def compile_error_context(owner: nn.Cell, error: Exception, root: nn.Cell, args: tuple):
    """What to add to `error`, raised by a compile of `root` on `args` that laid out `owner`'s engine:
    diagnostics.failures."""
    from ms_gradaccum.diagnostics import failures   # pylint: disable=import-outside-toplevel
    return failures.micro_batch_context(error, inner_cell(root), args, owner)
