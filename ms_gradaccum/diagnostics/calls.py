"""The diagnostics a package cell runs before its first step: the loss contract read around its first compile or
call (diagnostics.contract), and the context added to an error the network raises on a micro-batch while a graph
compiles. The cells call them (``cells.binding``); a steady call runs no package Python.

GRAPH_MODE: the compile hook (``cells.compile_hook``) calls the cell's ``before_compile`` (:func:`before_step_compile`)
and, after the compile, before the graph runs, :func:`read_after_compile`: the contract read from the compiled step's
graph, under ``Model``, a train cell of one's own and sink mode alike; a ``jit`` function's graph the same way
(:func:`read_after_jit_compile`); under semi-auto/auto parallel, :func:`read_first_call` before the compile where the
batch reaches the cell. Where nothing decides before the graph runs, the graph compares values itself on its first
run (``contract.LossContract.construct``). PyNative mode: the cells' own ``__call__`` reads the contract on the first
call, and again when the inputs' layout changes.
"""
import numpy as np
from mindspore import nn, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.graph import in_function_gradient
from ms_gradaccum._mindspore.patches import jit_graph_proto
from ms_gradaccum._mindspore.step_graph import step_proto
from ms_gradaccum._mindspore.surroundings import PASS_THROUGH, child, parallel_pass_in_force
from ms_gradaccum.core.microbatch import check_tensor_inputs

def inner_cell(cell: nn.Cell) -> nn.Cell:
    """The cell whose inputs are `cell`'s own: followed down through the cells that hand their inputs on unchanged
    (``_mindspore.surroundings.PASS_THROUGH``: the train cells ``Model`` builds, ``AutoParallel``), else `cell`."""
    while type(cell) in PASS_THROUGH:   # pylint: disable=unidiomatic-typecheck
        cell = getattr(cell, "network", None)
    return cell


def read_first_call(owner: nn.Cell, inputs: tuple) -> None:
    """The loss contract's check on `owner`'s `inputs` before a compile or an eager call (diagnostics.contract), where
    it has not run on inputs of that layout; a kind it finds is the one `owner` trains with."""
    engine = child(owner, "engine")
    check_tensor_inputs(engine.owner_name, inputs)
    kind = child(owner, "contract").first_call(engine, inputs, refusable=not in_function_gradient(owner))
    if kind is not None:
        owner.use_kind(kind)


def before_step_compile(owner: nn.Cell, root: nn.Cell, args: tuple) -> None:
    """Before a GRAPH_MODE compile of `root` on `args` holding `owner`: the contract is read from the compiled step's
    graph after it (:func:`read_after_compile`); under semi-auto/auto parallel, whose pass rewrites the step's graph,
    from the network's own graph before it, where the batch reaches `owner` unchanged."""
    contract = child(owner, "contract")
    if inner_cell(root) is owner:
        check_tensor_inputs(child(owner, "engine").owner_name, args)
    if contract is None:
        return
    if not parallel_pass_in_force():
        contract.expect_step()
    elif inner_cell(root) is owner:
        read_first_call(owner, args)


def read_after_compile(owner: nn.Cell, root: nn.Cell, args: tuple) -> bool:
    """After a compile of `root` on `args` holding `owner`, before its graph runs: the loss contract read from the
    step's graph (``contract.LossContract.read_step``); a kind it shows is the one `owner` trains with. Under
    semi-auto/auto parallel, where the batch did not reach `owner` beforehand (a train cell of one's own, sink mode),
    the network's own graph for the shapes and dtypes the compile recorded (``core.engine.record_signature``; zeros
    stand for the values, which the reading never looks at): a stop, or a kind other than the compiled one, raises.
    Returns whether the step must compile again."""
    contract, engine = child(owner, "contract"), child(owner, "engine")
    if contract is None or engine is None:
        return False
    signature = engine.scaled_loss.record.signature
    reached = inner_cell(root) is owner
    inputs = args if reached else None if signature is None else _zeros_of(signature)
    if contract.reads_step:
        weights = frozenset(parameter.name for parameter in root.get_parameters())
        return _read_step(owner, lambda: step_proto(root, root.current_phase), weights, inputs, reached)
    if inputs is not None and not reached and contract.in_graph:
        contract.read_compiled(engine, inputs)
    return False


def read_after_jit_compile(owner: nn.Cell, executor, phase: str) -> bool:
    """After a ``jit`` function holding `owner` compiled (its `executor`, `phase`), before it runs: the loss contract
    read from that graph, the batch's values unknown (the function's arguments are not the cell's). Returns whether
    the function must compile again."""
    contract, engine = child(owner, "contract"), child(owner, "engine")
    if contract is None or engine is None or not contract.reads_step:
        return False
    signature = engine.scaled_loss.record.signature
    inputs = None if signature is None else _zeros_of(signature)
    weights = frozenset(parameter.name for parameter in owner.get_parameters())
    return _read_step(owner, lambda: jit_graph_proto(executor, phase), weights, inputs, False)


def _read_step(owner: nn.Cell, proto, weights: frozenset, inputs, reached: bool) -> bool:
    kind, again = child(owner, "contract").read_step(child(owner, "engine"), proto, weights, inputs, reached)
    if kind is not None:
        owner.use_kind(kind)
    return again


def _zeros_of(signature: tuple) -> tuple:
    """Inputs of the recorded shapes and dtypes (values the reading never looks at)."""
    return tuple(Tensor(np.zeros(x[0], mstype.dtype_to_nptype(x[1])), x[1]) if _is_tensor_signature(x) else x
                 for x in signature)


def _is_tensor_signature(item) -> bool:
    return (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple)
            and isinstance(item[1], mstype.Type))


def compile_error_context(owner: nn.Cell, error: Exception, root: nn.Cell, args: tuple):
    """What to add to `error`, raised by a compile of `root` on `args` that laid out `owner`'s engine:
    diagnostics.failures."""
    from ms_gradaccum.diagnostics import failures   # pylint: disable=import-outside-toplevel
    return failures.micro_batch_context(error, inner_cell(root), args, owner)
