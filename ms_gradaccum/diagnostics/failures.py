"""Errors the network raises on a micro-batch say so.

A network built for a fixed batch size fails inside the micro-batch graph with MindSpore's own message. When a compile
fails, the micro-batches' rows, micro_size and the fix are added where (1) the failed compile laid out an engine
(diagnostics.calls: its ``CompileRecord.layout``, cleared before every compile it watches) and (2) the network, run
eagerly on the first micro-batch (eager.run_eagerly), fails too (on the first two only: the contract check's pass
failed), while (3) it runs on the whole batch (an error the plain step raises as well keeps MindSpore's message alone);
where the inputs cannot be reached, the engine's call of the network must appear in MindSpore's traceback (the layout is
then the one the engine's compile recorded, ``core.engine.CompileRecord``). Anything else, and errors at run time, pass
through unchanged. Imported only when a compile fails, or the eager pass fails on micro-batch rows.
"""
from typing import Optional, Tuple

from mindspore import nn

from ms_gradaccum._mindspore.graph import traceback_runs_through
from ms_gradaccum.core.microbatch import (SPLIT, input_shapes, micro_batch_rows, plan,
                                          split_as_compiled)
from ms_gradaccum.diagnostics.eager import BatchRows, runs_on


def _split(micro_size: int, engine: nn.Cell, inputs: Optional[tuple]) -> Tuple[list, tuple, int, list]:
    """``(split inputs as [(index, shape)], names, batch rows, micro-batch rows largest first)`` of `inputs` as
    `engine` lays them out, or of the layout its last compile planned where they are not given."""
    if inputs is not None:
        layout = split_as_compiled(engine, inputs)[3]
        shapes, names = input_shapes(inputs), engine.input_names
    else:
        shapes, names, layout = engine.scaled_loss.record.layout
    split = [(index, shape) for index, (shape, (role, _)) in enumerate(zip(shapes, layout)) if role == SPLIT]
    batch = split[0][1][0]
    return split, names, batch, sorted({rows for _, rows in plan(batch, micro_size)}, reverse=True)


def failure_context(cls_name: str, micro_size: int, engine: nn.Cell, inputs: Optional[tuple] = None,
                    check_rows: int = 0, contract: Optional[nn.Cell] = None) -> str:
    """What an error the network raised on a micro-batch (or on the loss contract's check of `check_rows` rows, the
    first two micro-batches together) is about: the micro-batches' rows, and the fixes. Where `engine` and the owner's
    `inputs` are given, an input that makes the loss combine when given whole is named by `contract`'s value
    comparison (the shared-input advice is tried, not guessed)."""
    split, names, batch, rows = _split(micro_size, engine, inputs)
    row_text = " and ".join(str(r) for r in rows)
    shown = ", ".join(f"input {i}{f' ({names[i]!r})' if i < len(names) else ''} {tuple(shape)} -> "
                      f"{tuple((row_text,) + tuple(shape[1:]))}".replace("'", "") for i, shape in split)
    part = (f"the first two micro-batches together ({check_rows} rows, the loss contract's check)" if check_rows
            else "a micro-batch")
    hint = ""
    if inputs is not None and contract is not None:
        hint = contract.shared_input_hint(engine, inputs)
    return (f"For '{cls_name}', the error above was raised by the network running on {part}, not on the whole "
            f"batch: micro_size={micro_size} splits the batch of {batch} rows into micro-batches of "
            f"{row_text} rows ({shown}). A cell built for a fixed batch size (e.g. a CTC loss or a reshape configured "
            f"with the batch size) must be built for the micro-batch's rows ({row_text}), not the batch's ({batch}); "
            f"then pass check_loss=False, since the loss contract's check runs two micro-batches together. An input "
            f"whose batch axis is not axis 0 (a time-major sequence (T, B, ...)) must be given batch-major."
            f"{hint}")


def _fails_on(engine: nn.Cell, inputs: tuple, micro_batches: Optional[int]) -> Optional[bool]:
    """Whether the network fails eagerly on the first `micro_batches` micro-batches of `inputs` (None: on the whole
    batch); None where that cannot be tried."""
    try:
        batch = BatchRows(engine, inputs)
    except Exception:  # pylint: disable=broad-except
        return None
    if micro_batches is not None and len(batch.micro_rows) < micro_batches:
        return None
    rows = sum(batch.micro_rows[:micro_batches]) if micro_batches is not None else batch.batch
    return not runs_on(engine.scaled_loss.loss_of_inputs.network, batch.rows(0, rows))


def _network_call_in(message: str, engine: nn.Cell) -> bool:
    """Whether MindSpore's traceback of the error runs through the engine's call of the network: the file and line of
    that call's own code object (``In file <file>:<line>,``)."""
    return traceback_runs_through(message, type(engine.scaled_loss.loss_of_inputs).construct)


def micro_batch_context(error: Exception, owner: Optional[nn.Cell], inputs: tuple, built: nn.Cell) -> Optional[str]:
    """What to add to `error`, raised by a compile that built the package cell `built`'s engine; None when it is not
    the network's on a micro-batch (it fails on the whole batch too, as the plain step would). `owner` is the cell whose
    inputs are the compiled cell's `inputs` (diagnostics.calls.inner_cell)."""
    engine = built.engine
    if owner is built:   # the package cell, or a pass-through train cell around it
        one = _fails_on(engine, inputs, 1)
        if one is None:
            return None
        if not one:
            if built.contract.in_graph and _fails_on(engine, inputs, 2):
                return _contract_context(engine, inputs)
            return None
        if _fails_on(engine, inputs, None) is not False:
            return None   # the whole batch fails too (or cannot be tried): MindSpore's message says it all
        return failure_context(engine.owner_name, engine.micro_size, engine, inputs, contract=built.contract)
    if not _network_call_in(str(error), engine):
        return None
    if engine.scaled_loss.record.layout is None:
        return None
    return failure_context(engine.owner_name, engine.micro_size, engine)


def _contract_context(engine: nn.Cell, inputs: tuple) -> Optional[str]:
    _, _, batch, rows = _split(engine.micro_size, engine, inputs)
    sizes = micro_batch_rows(batch, engine.micro_size)
    return (f"For '{engine.owner_name}', the error above was raised by the network running on the loss contract's "
            f"check: the first two micro-batches together ({sum(sizes[:2])} rows; micro_size={engine.micro_size} "
            f"splits the batch of {batch} rows into micro-batches of {' and '.join(str(r) for r in rows)}). A network "
            f"built for a fixed number of rows cannot be checked that way: pass check_loss=False (and make sure its "
            f"loss is what the cell is told).")
