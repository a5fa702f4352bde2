"""The micro-batch engine both cells own: forward and backward once per micro-batch, in turn, gradients added in place.

Contract: ``engine(inputs, shared, constants, layout, scale, count_unit, key) -> batch_totals(...)``. `inputs`
is split along axis 0 into ``micro_size`` micro-batches (`shared` and `constants` passed whole, in their places per
`layout`); each runs forward and backward once on its loss times ``scale * weight`` (the kind's tally; `count_unit`:
the rows of the largest micro-batch), adding its gradients into the buffers of the owner's weights
(:meth:`bind_targets`) as the backward produces them. One loop body, so the graph holds one copy of the network per
micro-batch shape (two for an uneven split). :func:`batch_totals` says what comes back; `key` names the trained weights,
so that PyNative mode compiles again when they change. The engine knows nothing of the diagnostics (``diagnostics/``
imports it).
"""
import inspect
from typing import Optional

import mindspore as ms
from mindspore import nn, ops, ParameterTuple, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.graph import compile_time, primexpr
from ms_gradaccum._mindspore.patches import ZEROS_LIKE
from ms_gradaccum._mindspore.step_graph import COUNT_SUM, FIRST_SUM, LOSS_SUM
from ms_gradaccum.core.base import PrecisionNeutral
from ms_gradaccum.core.buffers import add_gradients, dtypes_match, kept_gradients, zero_buffers
from ms_gradaccum.core.kinds import LossSpec
from ms_gradaccum.core.microbatch import (assemble, check_loss_dtype, check_loss_output, input_shapes, input_names,
                                          micro_batch, partition, plan_inputs, split_batch)
from ms_gradaccum.core.tokens import TokenCounter, counting_view
from ms_gradaccum.core.validation import readable, warn_batch_norm


class TupleInputs(PrecisionNeutral):
    """Calls ``network(*inputs)`` with the inputs packed in one tuple: ``mindspore.value_and_grad`` rejects a
    ``construct(*inputs)`` in graph mode ("The parameters number of the function is 1 ...")."""

    def __init__(self, network: nn.Cell):
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, inputs):
        return self.network(*inputs)


class CompileRecord:
    """What one engine's compile found and reads again, kept on its own engine (no module state): the shape of the
    network's loss, written while the loop body compiles and read after the loop (a value carried out of a graph-mode
    while loop gets a dynamic shape, so nothing outside the body sees it otherwise); and the inputs' layout, written
    when a graph holding the engine compiles (diagnostics.calls clears it before a compile it watches, to tell whether
    that compile built the engine; diagnostics.failures reads it for the context of an error the network raises on a
    micro-batch)."""

    def __init__(self):
        self.loss_shape = None
        self.layout = None   # (input shapes, input names, layout)
        self.signature = None   # per input: (shape, dtype) of a Tensor, else the value (None, a Python number)


@primexpr
def record_loss_shape(record: CompileRecord, shape: tuple) -> bool:
    record.loss_shape = tuple(shape)
    return True


@primexpr
def recorded_loss_shape(record: CompileRecord, after: tuple) -> tuple:
    """The recorded shape; `after` (the shape of a loop output) orders this after the loop body's compile."""
    return record.loss_shape


@primexpr
def record_signature(record: CompileRecord, signature: tuple) -> bool:
    """Keeps the inputs' shapes and dtypes on `record` (the loss contract reads the graph after a compile the batch did
    not reach beforehand: diagnostics.calls.read_after_compile)."""
    record.signature = tuple(signature)
    return True


@primexpr
def record_layout(record: CompileRecord, shapes: tuple, names: tuple, layout: tuple) -> tuple:
    """Keeps the inputs' layout on `record` and returns it."""
    record.layout = (shapes, names, layout)
    return layout


class ScaledLoss(PrecisionNeutral):
    """``(loss * scale * weight, value, count, calls)`` of one micro-batch in float32 scalars, as its loss kind tallies
    them (core.kinds); only the first carries a gradient. The product is taken in float32 (a float16 loss times a large
    scale cannot overflow); with a factor of 1 the gradients are bit-identical to unscaled ones. Where the kind counts
    in the network (``core.tokens.CountedMean``) the network is its counting copy, and `calls` is how many times its
    recognised cells ran (1 otherwise)."""

    def __init__(self, network: nn.Cell, kind, cls_name: str):
        super().__init__(auto_prefix=False)
        counter = TokenCounter() if kind.counts_in_network else None
        object.__setattr__(self, "_network", network)   # the user's network (not a second child)
        self.loss_of_inputs = TupleInputs(network if counter is None else counting_view(network, kind, counter))
        # The counter's Parameters, plain attributes (held outside every cell tree: not in checkpoints).
        object.__setattr__(self, "counted", None if counter is None else counter.count)
        object.__setattr__(self, "counted_calls", None if counter is None else counter.calls)
        self.counts_in_network = counter is not None
        self.kind = kind
        self.returns_count = kind.returns_count
        self.owner_name = cls_name
        self.record = CompileRecord()

    def uncount(self) -> None:
        """Runs the user's network as it is, no longer its counting copy (a kind that counts from the inputs took over
        from a recognised loss's counting: MicroBatchGradients.use_kind)."""
        self.loss_of_inputs = TupleInputs(self._network)
        object.__setattr__(self, "counted", None)
        object.__setattr__(self, "counted_calls", None)
        self.counts_in_network = False

    def loss_and_count(self, inputs, rows):
        """``(loss, count, calls)`` of the network on `inputs` (`rows` of them): its loss as a float32 scalar, and its
        count (1 where it returns none; what its recognised cells counted, where the kind counts in the network)."""
        calls = Tensor(1.0, mstype.float32)
        if self.counts_in_network:
            zero = Tensor(0.0, mstype.float32)
            inputs = ops.depend(inputs, (ops.assign(self.counted, zero), ops.assign(self.counted_calls, zero)))
        out = self.loss_of_inputs(inputs)
        # Sums, not reshapes: exact for the single element checked, and no shape error can come before the check's.
        if isinstance(out, tuple):
            shapes = ()
            for item in out:
                shapes += (item.shape,)
            check_loss_output(self.owner_name, self.returns_count, True, shapes)
            check_loss_dtype(self.owner_name, (out[0].dtype,))
            # Marked sums: the loss contract finds the network's outputs in the step's graph (_mindspore.step_graph).
            scalar = FIRST_SUM(ops.cast(out[0], mstype.float32))
            count = COUNT_SUM(ops.cast(out[1], mstype.float32)) if len(out) > 1 else \
                Tensor(1.0, mstype.float32)
            shape = out[0].shape
        else:
            check_loss_output(self.owner_name, self.returns_count, False, (out.shape,))
            check_loss_dtype(self.owner_name, (out.dtype,))
            scalar = LOSS_SUM(ops.cast(out, mstype.float32))
            count = Tensor(1.0, mstype.float32)
            shape = out.shape
        if self.counts_in_network:
            # Read after the network's writes (MindSpore orders a Parameter's reads and writes as written). A forward
            # pass that did not call the recognised cells counts its rows, as a row mean.
            calls = ops.depend(self.counted_calls * 1.0, scalar)
            count = ops.select(calls > 0, ops.depend(self.counted * 1.0, scalar), Tensor(rows, mstype.float32))
        # A single-element loss of shape (1,) is tallied as a scalar; its shape goes back to the owner (loss_like).
        scalar = ops.depend(scalar, record_loss_shape(self.record, shape))
        return scalar, count, calls

    def construct(self, inputs, scale, rows, count_unit):
        scalar, count, calls = self.loss_and_count(inputs, rows)
        weight, value, count = self.kind.tally(ops.stop_gradient(scalar), ops.stop_gradient(count), rows, count_unit,
                                               inputs)
        factor = ops.stop_gradient(scale * weight)
        return scalar * factor, ops.stop_gradient(value), ops.stop_gradient(count), ops.stop_gradient(calls)


# Why a micro-batch's loss is not finite where the whole batch's is: said by the engine's check and by
# check_loss_contract (diagnostics.loss_contract), each with the fix in its own arguments' terms.
NON_FINITE_CAUSE = ("A loss normalised by a count taken over its own rows is 0/0 on a micro-batch without a single "
                    "valid row or token (a masked mean (loss * mask).sum() / mask.sum())")

# Named fields of a tuple in the graph, their order written once, in the function that builds the tuple (positional
# and keyword arguments in its signature). Not a NamedTuple: MindSpore 2.10 fails to run a graph where a named tuple
# crosses a jit graph's boundary (2.7 accepts it); not a function of ``**fields``: building the tuple from a dict by
# name compiled into 276 more subgraphs at any depth (docs/measurements.md, "Why the code is shaped so").

def batch_totals(value, count, loss_like, first_two_value, first_two_count) -> tuple:
    """What the engine returns for a batch, float32 Tensors: the sum of the micro-batches' tallied values (the kind's)
    and of their counts; zeros of the network's loss shape (``()`` or ``(1,)``); the value and count of micro-batches 0
    and 1 (the loss contract's in-graph comparison). Read by name with :func:`field`."""
    return (value, count, loss_like, first_two_value, first_two_count)


def _totals(value, count, smallest, finite, first_two_value, first_two_count, bad, bad_first_row, bad_last_row,
            any_finite, calls) -> tuple:
    """What the loop carries per micro-batch, as one float32 vector (one Unstack per step, not an indexing each, each
    compiled through MindSpore's indexing functions: docs/measurements.md): the sums of value and count, the smallest
    count and whether every count was finite (kinds that check counts), the sums after the first two micro-batches,
    the first micro-batch with a non-finite loss or count (-1: none) with its first and last row, whether any
    micro-batch was finite, and the most calls of the recognised loss cells in one forward pass. Read by name with
    ``_AT``."""
    return (value, count, smallest, finite, first_two_value, first_two_count, bad, bad_first_row, bad_last_row,
            any_finite, calls)


_AT_BATCH = {name: index for index, name in enumerate(inspect.signature(batch_totals).parameters)}
_AT = {name: index for index, name in enumerate(inspect.signature(_totals).parameters)}


def field(values: tuple, name: str):
    """The field `name` of the engine's output `values` (:func:`batch_totals`), in the graph too."""
    return values[_AT_BATCH[name]]


class MicroBatchGradients(PrecisionNeutral):
    """The engine (see the module docstring).

    Args:
        network (Cell): The loss network.
        spec (LossSpec): What the owner was told about the loss (core.kinds), its kind among it.
        overwrite (bool): Whether the first micro-batch overwrites the buffers (a fresh sum per batch) instead of
            adding to what they hold (a sum over a window of batches).
        cls_name (str): The public cell, for error messages.
        loss_scale (LossScale): The owner's loss scale (core.loss_scale): where it skips non-finite steps, a micro-batch
            with a non-finite loss is left to it (an overflow); elsewhere it stops the step.

    Its ``bprop`` returns zeros for its inputs, so an outer ``GradOperation`` treats it as opaque and does not
    differentiate through the loop (which would recompute everything and hold every activation).
    """

    def __init__(self, network: nn.Cell, spec: LossSpec, overwrite: bool, cls_name: str,
                 loss_scale: nn.Cell, statistics: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)
        micro_size = spec.micro_size
        self.scaled_loss = ScaledLoss(network, spec.kind, cls_name)
        self.micro_size = micro_size
        self.shared_inputs = spec.shared_inputs
        self.input_names = input_names(network)
        self.checks_counts = spec.kind.checks_counts
        self.counts_in_network = spec.kind.counts_in_network
        self.skips_empty = spec.kind.skips_empty
        self.counted_cells = ", ".join(spec.kind.cells)
        self.kind_setting = spec.kind.setting   # names the kind in the count's messages
        self.overwrite = overwrite
        self.owner_name = cls_name
        object.__setattr__(self, "_loss_scale", loss_scale)   # the owner's child, read here
        # BatchNorm's moving statistics once per optimizer step (core.batch_norm), None where there are none to
        # combine; a child, so that its sums are in checkpoints (accu_state.batch_norm.*).
        self.statistics = statistics
        self.combines_statistics = statistics is not None

    def use_kind(self, kind) -> None:
        """Trains with `kind` from the next compile on (the kind the loss network's graph showed: diagnostics.contract).
        A kind that counts from the inputs replaces a recognised loss's counting (two recognised cells on the same
        labels: one count from the inputs serves both), and the user's network runs as it is."""
        scaled = self.scaled_loss
        scaled.kind = kind
        self.kind_setting = kind.setting
        self.skips_empty = kind.skips_empty
        if scaled.counts_in_network and not kind.counts_in_network:
            scaled.uncount()
            self.counts_in_network, self.counted_cells = False, ""

    @compile_time
    def skips_non_finite(self) -> bool:
        """Whether a non-finite micro-batch is the owner's loss scale's to handle (it skips the step)."""
        return self._loss_scale.skips_non_finite

    def split_inputs(self, inputs):
        """``(split, shared, constants, layout)`` of the network's inputs, for :meth:`construct`: Tensors are split
        along axis 0 unless declared in ``shared_inputs`` or 0-d; None and Python numbers are passed as they are."""
        shapes = input_shapes(inputs)
        signature = ()
        for x in inputs:
            signature += ((x.shape, x.dtype),) if isinstance(x, Tensor) else (x,)
        record_signature(self.scaled_loss.record, signature)
        layout = record_layout(self.scaled_loss.record, shapes, self.input_names,
                               plan_inputs(self.owner_name, shapes, self.shared_inputs, self.input_names,
                                           self.micro_size))
        split, shared, constants = partition(inputs, layout)
        return ms.mutable(split), ms.mutable(shared) if shared else shared, constants, layout

    def bind_targets(self, weights, buffers) -> None:
        """The weights whose gradients are accumulated and their buffers (as the owner binds them: cells.binding), kept
        last first, as the backward pass produces them: each gradient is added, and freed, as soon as it exists
        (docs/measurements.md); reversed here, not by slicing in the graph (a node per weight). Plain attributes, not
        registered (the weights are the network's, the buffers the owner's)."""
        object.__setattr__(self, "weights", ParameterTuple(list(weights)[::-1]))
        object.__setattr__(self, "buffers", ParameterTuple(list(buffers)[::-1]))
        # Only where a buffer's dtype differs from its weight's (float32 sums of float16 weights) is each gradient
        # cast before it is added.
        object.__setattr__(self, "adds_with_cast", not dtypes_match(weights, buffers))

    def _value_and_grads(self, micro, scale, rows, count_unit):
        return ms.value_and_grad(self.scaled_loss, None, self.weights)(micro, scale, rows, count_unit)

    @staticmethod
    def _micro_inputs(split, i, others):
        """Micro-batch `i` of the split inputs, with the shared inputs and constants in their places."""
        shared, constants, layout = others
        return assemble(micro_batch(split, i), shared, constants, layout)

    def _tally(self, out, totals, index, first_row, rows):
        """The loop's `totals` (see ``_AT``) after micro-batch `index` (rows `first_row` on), whose ScaledLoss
        output is `out`. All float32: a bool carried by the loop compiles slower (docs/measurements.md)."""
        value, count = totals[_AT["value"]] + out[1], totals[_AT["count"]] + out[2]
        smallest, finite = totals[_AT["smallest"]], totals[_AT["finite"]]
        if self.checks_counts:
            smallest = ops.minimum(smallest, out[2])
            finite = ops.minimum(finite, ops.cast(ops.isfinite(out[2]), mstype.float32))
        second = index == 1
        ok = ops.logical_and(ops.isfinite(out[1]), ops.isfinite(out[2]))
        bad = totals[_AT["bad"]]
        first_bad = ops.logical_and(ops.logical_not(ok), bad < 0)
        row = ops.cast(first_row, mstype.float32)
        return _totals(value=value, count=count, smallest=smallest, finite=finite,
                       first_two_value=ops.select(second, value, totals[_AT["first_two_value"]]),
                       first_two_count=ops.select(second, count, totals[_AT["first_two_count"]]),
                       bad=ops.select(first_bad, ops.cast(index, mstype.float32), bad),
                       bad_first_row=ops.select(first_bad, row, totals[_AT["bad_first_row"]]),
                       bad_last_row=ops.select(first_bad, row + (rows - 1), totals[_AT["bad_last_row"]]),
                       any_finite=ops.maximum(totals[_AT["any_finite"]], ops.cast(ok, mstype.float32)),
                       calls=ops.maximum(totals[_AT["calls"]], out[3]))

    def _run_micro_batches(self, split, others, stop, totals, scale, rows, count_unit, offset, row_offset):
        # A while loop over a Tensor counter compiles once and runs the micro-batches strictly in turn (each one's
        # activations freed before the next). The tallies travel as one float32 vector (docs/measurements.md).
        i = Tensor(0, mstype.int32)
        packed = ops.stack(totals)
        while i < stop:
            micro = self._micro_inputs(split, i, others)
            if self.combines_statistics:
                before = self.statistics.before()   # read in program order: the values before this micro-batch
            out, grads = self._value_and_grads(micro, scale, rows, count_unit)
            if self.skips_empty:
                # A micro-batch whose count is 0 adds nothing (its loss and gradients are 0/0): core.kinds.
                keep = out[2] > 0
                grads = kept_gradients(grads, keep)
                out = (out[0], ops.select(keep, out[1], ops.zeros_like(out[1]))) + out[2:]
            if self.combines_statistics:
                # Read from the moving statistics the micro-batch moved, then put back (core.batch_norm).
                moved = self.statistics.after(before, rows, out[1], out[0].shape)
                out = (out[0], ops.depend(out[1], moved)) + out[2:]
            totals = self._tally(out, ops.unstack(packed), i + offset, i * rows + row_offset, rows)
            value = add_gradients(self.buffers, grads, totals[_AT["value"]], self.adds_with_cast)
            packed = ops.stack((value,) + totals[1:])   # "value" first: made to depend on the buffers' additions
            i = i + 1
        return ops.unstack(packed)

    def _check_counts(self, smallest, finite):
        if finite < 1:
            raise ValueError(f"For '{self.owner_name}', with {self.kind_setting} the count returned by 'network' must "
                             f"be a finite number >= 0 (e.g. the number of valid tokens), but a micro-batch returned a "
                             f"non-finite count (inf or nan).")
        if smallest < 0:
            raise ValueError(f"For '{self.owner_name}', with {self.kind_setting} the count returned by 'network' must "
                             f"be a finite number >= 0 (e.g. the number of valid tokens), but a micro-batch returned "
                             f"{readable(smallest)}.")
        return smallest

    def _check_calls(self, calls):
        if calls > 1:
            raise ValueError(
                f"For '{self.owner_name}', the network's loss averages over valid labels ({self.counted_cells}), and "
                f"these loss cells ran {ops.cast(calls, mstype.int32)} times in one forward pass. The cell weighs each "
                f"micro-batch by the labels one call counts; with several calls, each dividing by its own count, no "
                f"weight per micro-batch gives the full batch's update. Return (loss_sum, count) from the network and "
                f"pass per_token_loss=True (ms_gradaccum.token_sum_loss gives each loss its sum and count), or, if "
                f"every micro-batch holds the same number of valid labels for each call, pass per_token_loss=False "
                f"and check_loss=False (the loss contract stops a mean over valid labels declared a row mean).")
        return calls

    def _check_finite(self, bad, first_row, last_row, any_finite, batch):
        if bad >= 0:
            if any_finite > 0:
                raise ValueError(
                    f"For '{self.owner_name}', micro-batch {ops.cast(bad, mstype.int32)} (rows "
                    f"{ops.cast(first_row, mstype.int32)} to {ops.cast(last_row, mstype.int32)} of the batch of "
                    f"{batch}, micro_size={self.micro_size}) returned a non-finite loss or count (nan or inf), while "
                    f"other micro-batches returned finite ones: the step is stopped before any weight changes. "
                    f"{NON_FINITE_CAUSE}; where the whole batch's is finite, "
                    f"return (loss_sum, count) from the network and pass per_token_loss=True: the cell then divides "
                    f"the whole batch's sum by the whole batch's count (ms_gradaccum.token_sum_loss does this for "
                    f"nn.CrossEntropyLoss and nn.NLLLoss).")
        return bad

    # Compiled as a graph in PyNative mode too: there, a cell with a custom bprop runs its construct under
    # no_grad, where eager gradients are refused, and an eager loop would not free memory per micro-batch.
    @ms.jit
    def construct(self, inputs, shared, constants, layout, scale, count_unit, key):
        others = (shared, constants, layout)
        zero = Tensor(0.0, mstype.float32)
        none = Tensor(-1.0, mstype.float32)
        totals = _totals(value=zero, count=zero, smallest=Tensor(float("inf"), mstype.float32),
                         finite=Tensor(1.0, mstype.float32), first_two_value=zero, first_two_count=zero, bad=none,
                         bad_first_row=none, bad_last_row=none, any_finite=zero, calls=zero)
        if self.overwrite:
            # A fresh sum per batch: the buffers are cleared once, before the loop, so that every micro-batch goes
            # through the same loop body (one copy of the network in the graph) and adds its gradient.
            totals = (zero_buffers(self.buffers, zero),) + totals[1:]
        offset, row_offset = 0, 0
        for split, count, rows in split_batch(inputs, self.micro_size):
            # One loop per micro-batch shape: a batch micro_size divides has one, any other two (sizes differ by 1).
            totals = self._run_micro_batches(split, others, count, totals, scale, rows, count_unit, offset, row_offset)
            offset += count
            row_offset += count * rows
        value = totals[_AT["value"]]
        if self.checks_counts:
            value = ops.depend(value, self._check_counts(totals[_AT["smallest"]], totals[_AT["finite"]]))
        if self.counts_in_network:
            value = ops.depend(value, self._check_calls(totals[_AT["calls"]]))
        if not self.skips_non_finite:
            value = ops.depend(value, self._check_finite(totals[_AT["bad"]], totals[_AT["bad_first_row"]],
                                                         totals[_AT["bad_last_row"]], totals[_AT["any_finite"]],
                                                         row_offset))
        loss_like = ops.zeros(recorded_loss_shape(self.scaled_loss.record, value.shape), mstype.float32)
        return batch_totals(value=value, count=totals[_AT["count"]], loss_like=loss_like,
                        first_two_value=totals[_AT["first_two_value"]], first_two_count=totals[_AT["first_two_count"]])

    def bprop(self, inputs, shared, constants, layout, scale, count_unit, key, out, dout):
        zeros, shared_zeros = (), ()
        for x in inputs:
            zeros += (ZEROS_LIKE(x),)
        for x in shared:
            shared_zeros += (ZEROS_LIKE(x),)
        return zeros, shared_zeros, 0, 0, ZEROS_LIKE(scale), ZEROS_LIKE(count_unit), 0


def warn_where_inexact(network: nn.Cell, cls_name: str, splits: list, batch_norm: Optional[str] = None) -> None:
    """The construction warning of a cell that splits or sums batches (`splits` says how, empty if it does not) where
    the user chose nothing for BatchNorm (`batch_norm` None): each part is normalised by its own statistics."""
    if splits and batch_norm is None:
        warn_batch_norm(network, cls_name, " and ".join(splits))
