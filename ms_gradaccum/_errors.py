"""Errors the network raises on a micro-batch say so.

A network built for a fixed batch size (a CTC loss configured with the batch's rows, a ``reshape(16, 3)``) fails inside
the micro-batch graph with MindSpore's own message, on shapes nothing explains. When a graph fails to compile, the
package adds the micro-batches' rows, ``micro_size`` and the fix, where two things say the error is the network's on a
micro-batch:

1. the failed compile split a batch into micro-batches: the engine notes itself when its graph is built (a mark the
   package owns, cleared at the start of every compile), and
2. the network, run eagerly (no gradient) on the first micro-batch of the same inputs, fails too; where it runs there
   but fails on the first two micro-batches together, the error came from the loss contract's check instead. Where
   the inputs cannot be reached (a train cell of one's own, a ``jit`` function) the engine's call of the network must
   appear in MindSpore's traceback of the error instead.

Anything else (a graph-only syntax error such as ``Unsupported statement 'Try'``, an error outside the network) passes
through unchanged. Errors at run time (kernels) and in PyNative mode are left as MindSpore raises them.
"""
import contextlib
import weakref
from typing import Optional

from mindspore import nn

from ms_gradaccum import _microbatch
from ms_gradaccum._contract import inner_cell, runs_on
from ms_gradaccum._microbatch import assemble, input_kinds, partition, plan, plan_inputs

# The engine whose graph the compile under way built, if any (see 1. above).
_NOTED = {"engine": None}


def note_engine(engine: nn.Cell) -> None:
    """Marks the compile under way as one that builds `engine`'s micro-batch graph."""
    _NOTED["engine"] = weakref.ref(engine)


@contextlib.contextmanager
def around_compile(cell: nn.Cell, args: tuple):   # pylint: disable=unused-argument
    """Clears the mark at the start of each compile (a graph found cached builds nothing and notes nothing)."""
    _NOTED["engine"] = None
    _microbatch.forget_layout()
    yield


def _owner_inputs(cell: nn.Cell, args: tuple, engine: nn.Cell) -> Optional[tuple]:
    """The package cell's inputs, where the compiled cell is that cell or a pass-through train cell around it."""
    return args if getattr(inner_cell(cell), "engine", None) is engine else None


def _fails_on(engine: nn.Cell, inputs: tuple, micro_batches: int) -> Optional[bool]:
    """Whether the network fails eagerly on the first `micro_batches` micro-batches of `inputs`; None where that
    cannot be tried."""
    try:
        layout = plan_inputs(engine.owner_name, input_kinds(inputs), engine.shared_inputs, engine.input_names,
                             engine.micro_size)
        split, shared, constants = partition(inputs, layout)
        sizes = [rows for count, rows in plan(split[0].shape[0], engine.micro_size) for _ in range(count)]
    except Exception:  # pylint: disable=broad-except
        return None
    if len(sizes) < micro_batches:
        return None
    rows = sum(sizes[:micro_batches])
    network = engine.scaled_loss.loss_of_inputs.network
    return not runs_on(network, assemble(tuple(x[:rows] for x in split), shared, constants, layout))


def _network_call_in(message: str, engine: nn.Cell) -> bool:
    """Whether MindSpore's traceback of the error runs through the engine's call of the network: the file and line of
    that call's own code object (``In file <file>:<line>,``)."""
    code = type(engine.scaled_loss.loss_of_inputs).construct.__code__
    return f"{code.co_filename}:{code.co_firstlineno + 1}," in message


def micro_batch_context(error: Exception, args: tuple) -> Optional[str]:
    """What to add to `error`, raised by the graph executor's compile of ``args[0]`` on ``args[1:]``; None when it is
    not the network's on a micro-batch."""
    noted = _NOTED["engine"]
    engine = noted() if noted is not None else None
    if engine is None or not args:
        return None
    inputs = _owner_inputs(args[0], args[1:], engine)
    if inputs is not None:
        one = _fails_on(engine, inputs, 1)
        if one is None:
            return None
        if not one:
            if engine.contract.in_graph and _fails_on(engine, inputs, 2):
                return _contract_context(engine, inputs)
            return None
    elif not _network_call_in(str(error), engine):
        return None
    return _loop_context(engine, inputs)


def _loop_context(engine: nn.Cell, inputs: Optional[tuple]) -> Optional[str]:   # pylint: disable=unused-argument
    if _microbatch.last_layout() is None:
        return None
    return _microbatch.failure_context(engine.owner_name, engine.micro_size)


def _contract_context(engine: nn.Cell, inputs: tuple) -> Optional[str]:
    if _microbatch.last_layout() is None:
        return None
    _, _, batch, rows = _microbatch.last_split(engine.micro_size)
    sizes = sorted((r for count, r in plan(batch, engine.micro_size) for _ in range(count)), reverse=True)
    return (f"For '{engine.owner_name}', the error above was raised by the network running on the loss contract's "
            f"check: the first two micro-batches together ({sum(sizes[:2])} rows; micro_size={engine.micro_size} "
            f"splits the batch of {batch} rows into micro-batches of {' and '.join(str(r) for r in rows)}). A network "
            f"built for a fixed number of rows cannot be checked that way: pass check_loss=False (and make sure its "
            f"loss is what the cell is told).")


