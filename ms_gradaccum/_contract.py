"""The loss contract, checked on the first step instead of assumed (docs/design.md, "What is decided when").

The cells are exact when the loss is what they are told (a row mean, a row sum, or ``(loss_sum, count)``); zoos break
that without a sign (a detector's ``B * sum / max(S, 1)`` trained 4 to 16 times too small). On the first step the
network's loss on the first two micro-batches together is compared with what the kind tallies from their own losses;
a mismatch stops before the first update, with the ratio and the route that fits. The passes run eagerly (PyNative, no
gradient, ``_eager.run_eagerly``) on the batch the step is first compiled or called with, before anything compiles.
Batch statistics and dropout are tolerated within [1/1.5, 1.5]. Where the batch cannot be reached from Python (a train
cell of one's own, a ``jit`` function, sink mode, dynamic shapes) or the network runs only in graph mode, the graph
runs the pair's pass itself.
"""
import contextlib
import numbers
import weakref
from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._buffers import Unsaved
from ms_gradaccum._mindspore.graph import compile_time, eager_mode, primexpr
from ms_gradaccum._mindspore.patches import with_context
from ms_gradaccum._mindspore.surroundings import one_walk, parallel_mode
from ms_gradaccum._eager import run_eagerly, runs_on
from ms_gradaccum._loss_scale import PrecisionNeutral
from ms_gradaccum._microbatch import (assemble, check_loss_dtype, check_loss_output, check_tensor_inputs,
                                      forget_layout, last_layout, micro_batch_rows, shared_input_hint,
                                      split_as_compiled)
from ms_gradaccum._tokens import LabelWatch
from ms_gradaccum._validation import batch_norm_cells, computes_in_float16, readable

# Relative tolerance of the comparison: float32 reductions in another order; float16 networks round far more.
RTOL, RTOL_FLOAT16, ATOL = 1e-3, 2e-2, 1e-6
# Where batch statistics or random cells make the two forward passes differ anyway: only a gross mismatch stops.
NOISY_BAND = 1.5


def random_cells(network: nn.Cell) -> list:
    """``["name (Class)", ...]``: cells of `network` whose output is random in training (dropout with a rate > 0)."""
    found = []
    for name, cell in network.cells_and_names():
        if "dropout" not in type(cell).__name__.lower():
            continue
        rate = getattr(cell, "p", None)
        if rate is None and getattr(cell, "keep_prob", None) is not None:
            rate = 1.0 - float(cell.keep_prob)
        if rate is None or (isinstance(rate, numbers.Real) and rate > 0):
            found.append(f"{name or 'network'} ({type(cell).__name__})")
    return found


@primexpr
def pair_rows(batch: int, micro_size: int) -> int:
    """The rows of the first two micro-batches (0 when a batch holds fewer than two)."""
    sizes = micro_batch_rows(batch, micro_size)[:2]
    return sizes[0] + sizes[1] if len(sizes) == 2 else 0


def routes(kind) -> str:
    """The exact routes, for the message (`kind`: the loss kind, _kinds)."""
    return (f"The cell was told the loss is {kind.description}. If the loss is a sum over the rows, or a mean "
            f"multiplied by the batch size, pass reduction='sum'. If it is normalised by a count taken over the batch "
            f"(valid tokens, targets, a score sum), return (loss_sum, count) and pass per_token_loss=True "
            f"(min_count=1.0 for a max(count, 1) floor, and reduction='sum' as well if it is also multiplied by the "
            f"batch size). If you know the loss is fine here, pass check_loss=False.")


class _Refused(Exception):
    """An error of the eager pass that is the package's own answer (not a reason to leave the check to the graph)."""


class _LeaveToGraph(Exception):
    """An output the graph refuses with its own message, on the micro-batch's shapes."""


def _value_and_count(out, cls_name: str, returns_count: bool) -> np.ndarray:
    """``[loss, count]`` of an eager forward pass as ScaledLoss tallies them in the graph (float32 sums)."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    try:
        check_loss_dtype(cls_name, (getattr(first, "dtype", None),))
    except TypeError as error:
        raise _Refused(error) from None
    try:
        if isinstance(out, (tuple, list)):
            check_loss_output(cls_name, returns_count, True, tuple(item.shape for item in out))
        else:
            check_loss_output(cls_name, returns_count, False, (out.shape,))
    except ValueError as error:
        raise _LeaveToGraph() from error
    if isinstance(out, (tuple, list)):
        count = out[1].asnumpy().astype(np.float32).sum() if len(out) > 1 else np.float32(1.0)
        return np.array([out[0].asnumpy().astype(np.float32).sum(), count], np.float32)
    return np.array([out.asnumpy().astype(np.float32).sum(), 1.0], np.float32)


class ContractCheck(PrecisionNeutral):
    """The check (see the module docstring). :meth:`prepared` runs it eagerly before a graph compiles or runs, on the
    first step the owner trains; where it cannot run so, ``construct`` runs the pass on the pair inside the graph and
    compares it with the loop's own losses of the two micro-batches."""

    def __init__(self, scaled_loss: nn.Cell, network: nn.Cell, micro_size: int, kind, enabled: bool, cls_name: str,
                 labels: Optional[LabelWatch] = None):
        super().__init__(auto_prefix=False)
        # The first step's look at the labels of token-mean losses (_tokens), taken during the same eager pass.
        self.labels = labels
        object.__setattr__(self, "_scaled_loss", scaled_loss)   # the engine's own cell: not a second child
        self.micro_size = micro_size
        self.kind = kind
        self.enabled = enabled
        self.owner_name = cls_name
        self.rtol = RTOL_FLOAT16 if computes_in_float16(network) else RTOL
        noise = batch_norm_cells(network) + random_cells(network)
        self.noisy = bool(noise)
        self.noise = f" The network has batch statistics or random cells ({', '.join(noise)}): their noise " \
                     f"is tolerated, so only a ratio outside [1/{NOISY_BAND}, {NOISY_BAND}] stops." if noise else ""
        self._checked = Unsaved(Parameter(Tensor(False), name="accu_state.loss_contract_checked",
                                           requires_grad=False))
        # Python state. `passed`: the check ran and held (graphs compiled later leave it out). `failed`: the eager pass
        # could not run (the graph runs the pass itself).
        self.passed = False
        self.failed = False
        # Where several inputs are split: the advice for one that the whole batch shares (set by the eager pass).
        self.split_hint = ""

    @compile_time
    def checked(self) -> Parameter:
        return self._checked.parameter

    @compile_time
    def scaled_loss(self) -> nn.Cell:
        return self._scaled_loss

    @compile_time
    def in_graph(self) -> bool:
        """Whether the graph being compiled holds the check: it is on and has not passed (where it could run eagerly, it
        has passed by the time a graph compiles, or stopped)."""
        return self.enabled and not self.passed

    @contextlib.contextmanager
    def prepared(self, engine: nn.Cell, inputs: tuple):
        """Before a call on `inputs` (the owner's; the batch) compiles or runs: the check, eagerly, where it is on and
        has not passed (it raises on a mismatch, before anything is compiled or updated). Where it cannot run eagerly (a
        semi-auto/auto-parallel graph's global shapes, inputs without data, a network that runs only in graph mode), the
        graph runs it. With the check off or passed, the label watch's look, where armed, on one micro-batch."""
        if self.enabled and not self._has_passed():
            self._check_eagerly(engine, inputs)
        if self.labels is not None and self.labels.armed:
            self._eager_losses(engine, inputs, pair=False)
        yield

    def _has_passed(self) -> bool:
        # Read from the flag the graph sets (a device read, only until it is set).
        if not self.passed and self.checked.asnumpy():
            self.passed = True
        return self.passed

    def _eager_losses(self, engine: nn.Cell, inputs: tuple, pair: bool):
        """The network's forward pass, eagerly, as ``[loss, count]``: on the rows of the first two micro-batches
        together, then on each of them (`pair`), with their rows and the batch's count unit; or on the first
        micro-batch only (the label watch's look, taken on the first pass either way). None where it cannot run."""
        if self.failed or parallel_mode() not in (ms.ParallelMode.STAND_ALONE, ms.ParallelMode.DATA_PARALLEL):
            return None
        if not inputs or any(isinstance(x, Tensor) and (x.has_init or any(d < 0 for d in x.shape)) for x in inputs):
            return None
        network = self._scaled_loss.loss_of_inputs.network
        split = None
        try:
            split, shared, constants, layout = split_as_compiled(engine, inputs)
            sizes = micro_batch_rows(split[0].shape[0], self.micro_size)[:2]
            if pair and len(sizes) < 2:
                return None
            spans = [(0, sizes[0] + sizes[1]), (0, sizes[0]), (sizes[0], sizes[0] + sizes[1])] if pair \
                else [(0, sizes[0])]
            watch = self.labels.watching(spans[0][1], split) if self.labels is not None else contextlib.nullcontext()
            self.split_hint = shared_input_hint(*last_layout())
            passes = [assemble(tuple(x[start:stop] for x in split), shared, constants, layout) for start, stop in spans]
            outputs = run_eagerly(network, passes, around_first=watch)   # labels: the first pass
            losses = [(_value_and_count(out, self.owner_name, self.kind.returns_count), inputs, stop - start)
                      for out, inputs, (start, stop) in zip(outputs, passes, spans)]
        except _Refused as refused:
            raise refused.args[0] from None
        except Exception as error:  # pylint: disable=broad-except
            split_only = not isinstance(error, _LeaveToGraph) and split is not None and \
                runs_on(network, assemble(split, shared, constants, layout))
            if split_only:
                # It fails on micro-batch rows only: the error is the split's, and says so (a graph built from it would
                # fail the same way, at compile or only at run time, without the context).
                # The pair's rows where its pass (the first) failed, else a micro-batch's.
                pair_rows_run = spans[0][1] if pair and getattr(error, "eager_call", None) == 0 else 0
                from ms_gradaccum._failures import failure_context   # pylint: disable=import-outside-toplevel
                with_context(error, failure_context(self.owner_name, self.micro_size, pair_rows_run))
                raise
            # Not the contract: a network that runs only in graph mode, or an error the graph's compile reports with
            # its own message. The graph runs the pass (and raises what it has to).
            self.failed = True
            return None
        return losses, sizes

    def _check_eagerly(self, engine: nn.Cell, inputs: tuple) -> None:
        """The check on the eager passes; marks it passed, raises, or leaves it to the graph (no eager pass)."""
        found = self._eager_losses(engine, inputs, pair=True)
        if found is None:
            return
        passes, sizes = found
        rows = sizes[0] + sizes[1]
        # The pair together, and the first two micro-batches' tallies summed as the loop sums them (_engine), counted
        # in rows (a unit of 1: the loop's unit cancels in every comparison).
        with eager_mode():
            unit = Tensor(np.float32(1.0))
            tallies = [self.kind.tally(Tensor(loss[0]), Tensor(loss[1]), part_rows, unit, inputs)[1:]
                       for loss, inputs, part_rows in passes]
            (value, count), first, second = tallies
            self._compare(value, count, first[0] + second[0], first[1] + second[1], unit, rows)
        self.passed = True
        self.checked.set_data(Tensor(True))

    def _mismatch(self, measured, predicted):
        if self.noisy:
            ratio = measured / ops.select(predicted == 0, ops.ones_like(predicted), predicted)
            return ops.logical_or(ratio > NOISY_BAND, ratio < 1 / NOISY_BAND)
        return ops.abs(measured - predicted) > self.rtol * ops.abs(predicted) + ATOL

    def _compare(self, value, count, pair_value, pair_count, unit, rows):
        """Raises where the network's `value` and `count` on the pair's `rows` together do not match its tallies of the
        two micro-batches, `pair_value` and `pair_count` (eagerly, and in the graph where it runs the pass)."""
        measured = self.kind.compared(value, count, rows, unit)
        predicted = self.kind.compared(pair_value, pair_count, rows, unit)
        bad = self._mismatch(measured[0], predicted[0])
        for one, other in zip(measured[1:], predicted[1:]):
            bad = ops.logical_or(bad, self._mismatch(one, other))
        measured, predicted = measured[0], predicted[0]
        if bad:
            ratio = readable(measured / predicted)
            measured, predicted = readable(measured), readable(predicted)
            raise ValueError(
                f"For '{self.owner_name}', the network's loss does not combine over micro-batches as the "
                f"cell computes it, so training would not give the full batch's update: on the first "
                f"step, its loss on the first two micro-batches together ({rows} rows) is {measured}, but "
                f"combined from their own losses it is {predicted} (ratio {ratio}; about 2 means the loss "
                f"scales with the rows, other values a normalisation over the batch).{self.noise} "
                f"{routes(self.kind)}{self.split_hint}")

    def construct(self, split, others, pair_value, pair_count, unit, after):
        """Where the check could not run eagerly: on the first call, the pass on the pair inside the graph, compared
        with the loop's tallies (`after` is returned, made to depend on it)."""
        if self.in_graph:
            rows = pair_rows(split[0].shape[0], self.micro_size)
            if rows > 0:
                checked = self.checked
                if not checked:
                    shared, constants, layout = others
                    pair = ()
                    for x in split:
                        pair += (x[:rows],)
                    out = self.scaled_loss(assemble(pair, shared, constants, layout), Tensor(1.0, mstype.float32), rows,
                                           unit)
                    self._compare(out[1], out[2], pair_value, pair_count, unit, rows)
                    after = ops.depend(after, ops.assign(checked, Tensor(True)))
        return after


# The train cells whose construct hands its inputs, unchanged, to `self.network` (mindspore/nn/wrap/cell_wrapper.py,
# loss_scale.py; checked 2.7.0-2.10.0): what Model builds around GradAccumulationCell, and hand-written loops use.
# Exact types: a subclass may change the inputs.
_PASS_THROUGH = (nn.TrainOneStepCell, nn.TrainOneStepWithLossScaleCell)


def prepared_for(owner: nn.Cell, inputs: tuple):
    """The eager pass of `owner` (a GradAccumulationCell or AccumulatingTrainOneStepCell) on its `inputs`, for the
    duration (:meth:`ContractCheck.prepared`); nothing for another cell."""
    engine = getattr(owner, "engine", None)
    if engine is not None:
        check_tensor_inputs(engine.owner_name, inputs)
    contract = getattr(engine, "contract", None)
    if isinstance(contract, ContractCheck):
        return contract.prepared(engine, inputs)
    return contextlib.nullcontext()


class PreparedCalls:
    """Mixed into the package cells (before ``nn.Cell``): in PyNative mode each call runs the loss contract's eager pass
    on its batch first and finds the cell's surroundings once (in graph mode both happen where the graph compiles,
    :func:`around_compile` and ``surroundings.around_compile``)."""

    def __call__(self, *args, **kwargs):
        if ms.get_context("mode") == ms.PYNATIVE_MODE:
            with prepared_for(self, args), one_walk():
                return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def inner_cell(cell: nn.Cell) -> nn.Cell:
    """The cell whose inputs are `cell`'s own: the network of a pass-through train cell, else `cell` itself."""
    if type(cell) in _PASS_THROUGH:   # pylint: disable=unidiomatic-typecheck
        return getattr(cell, "network", None)
    return cell


def around_compile(cell: nn.Cell, args: tuple):
    """Around the graph executor's compile of `cell` on `args` (called each time a cell is called in graph mode, with
    the call's inputs): the eager pass of the package cell compiled as the outermost, or of the one a pass-through
    train cell wraps."""
    if ms.get_context("mode") != ms.GRAPH_MODE:
        return contextlib.nullcontext()   # PyNative mode: the package cells prepare when called (their __call__)
    return prepared_for(inner_cell(cell), args)


# --- Errors the network raises on a micro-batch say so (_failures, imported when a compile fails) ---------------------
# The engine whose graph the compile under way built, if any: each compile clears the mark, building an engine's graph
# sets it, and _failures reads it.
_NOTED = {"engine": None}


def note_engine(engine: nn.Cell) -> None:
    """Marks the compile under way as one that builds `engine`'s micro-batch graph."""
    _NOTED["engine"] = weakref.ref(engine)


@contextlib.contextmanager
def clear_engine_mark(cell: nn.Cell, args: tuple):   # pylint: disable=unused-argument
    """Clears the engine's mark at the start of each compile (a graph found cached builds nothing and notes nothing)."""
    _NOTED["engine"] = None
    forget_layout()
    yield


def micro_batch_context(error: Exception, args: tuple) -> Optional[str]:
    """What to add to `error`, raised by the graph executor's compile of ``args[0]`` on ``args[1:]`` (_failures)."""
    noted = _NOTED["engine"]
    if noted is None or not args:
        return None
    from ms_gradaccum import _failures   # pylint: disable=import-outside-toplevel
    return _failures.micro_batch_context(error, inner_cell(args[0]), args[1:], noted())
