"""The micro-batch engine both cells own: forward and backward once per micro-batch, in turn, gradients added in place.

Contract: ``engine(inputs, scale, unit, key) -> (value, count)``. The batch `inputs` is split along axis 0 into
``micro_size`` micro-batches; each runs forward and backward once on its loss times ``scale * weight`` and its
gradients are added, as the backward pass produces them, into the buffers of the weights the owner trains
(:meth:`targets`, resolved when the graph compiles). ``value`` and ``count`` are the batch's loss value and count
as ``_buffers`` defines them (a mean loss counts rows in units of `unit`; a ``(loss_sum, count)`` network its
count). The owner divides the buffers by ``_buffers.divisor`` and the value by the count. `key` names the trained
weights, so that PyNative mode compiles again when they change.
"""
from typing import Callable

import mindspore as ms
from mindspore import nn, ops, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._buffers import add_gradients
from ms_gradaccum._internals import ZEROS_LIKE, compile_time
from ms_gradaccum._loss_scale import PrecisionNeutral
from ms_gradaccum._microbatch import check_loss_output, micro_batch, split_batch


class TupleInputs(PrecisionNeutral):
    """Calls ``network(*inputs)`` with the inputs packed in one tuple.

    ``mindspore.value_and_grad`` rejects a network whose ``construct`` takes ``*inputs`` in graph mode
    ("The parameters number of the function is 1 ..."); a fixed single argument works for any network.
    """

    def __init__(self, network: nn.Cell):
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, inputs):
        return self.network(*inputs)


class ScaledLoss(PrecisionNeutral):
    """``(loss * factor, loss, count)`` in float32: only the first carries a gradient, so differentiating this cell
    runs the backward pass on the loss times `factor` (the loss scale times the micro-batch's weight).

    The product is taken in float32, so a float16 loss times a large scale cannot overflow in the forward value; the
    backward then starts from `factor` in the loss's own dtype, as ``nn.TrainOneStepCell``'s ``sens`` does. With
    ``factor == 1`` the gradients are bit-identical to unscaled ones. A mean loss has count 1.
    """

    def __init__(self, network: nn.Cell, per_token_loss: bool, cls_name: str):
        super().__init__(auto_prefix=False)
        self.loss_of_inputs = TupleInputs(network)
        self.per_token_loss = per_token_loss
        self.owner_name = cls_name

    def construct(self, inputs, factor):
        out = self.loss_of_inputs(inputs)
        if isinstance(out, tuple):
            shapes = ()
            for item in out:
                shapes += (item.shape,)
            check_loss_output(self.owner_name, self.per_token_loss, True, shapes)
            loss = ops.cast(out[0], mstype.float32)
            return loss * factor, ops.stop_gradient(loss), ops.stop_gradient(ops.cast(out[1], mstype.float32))
        check_loss_output(self.owner_name, self.per_token_loss, False, (out.shape,))
        loss = ops.cast(out, mstype.float32)
        return loss * factor, ops.stop_gradient(loss), Tensor(1.0, mstype.float32)


class MicroBatchGradients(PrecisionNeutral):
    """The engine (see the module docstring).

    Args:
        network (Cell): The loss network.
        micro_size (int): The number of micro-batches per batch.
        per_token_loss (bool): Whether `network` returns ``(loss_sum, count)``.
        overwrite (bool): Whether the first micro-batch overwrites the buffers (a fresh sum per batch) instead of
            adding to what they hold (a sum over a window of batches).
        targets (Callable): Returns ``(weights, buffers)``, the ParameterTuples of the trained weights and their
            buffers; read when the graph compiles.
        cls_name (str): The public cell, for error messages.

    Its ``bprop`` returns zeros for its inputs, so an outer ``GradOperation`` treats it as opaque and does not
    differentiate through the loop (which would recompute everything and hold every activation).
    """

    def __init__(self, network: nn.Cell, micro_size: int, per_token_loss: bool, overwrite: bool,
                 targets: Callable, cls_name: str):
        super().__init__(auto_prefix=False)
        self.scaled_loss = ScaledLoss(network, per_token_loss, cls_name)
        self.micro_size = micro_size
        self.per_token_loss = per_token_loss
        self.overwrite = overwrite
        self.owner_name = cls_name
        object.__setattr__(self, "_targets", targets)   # a bound method of the owner, not a child cell

    @compile_time
    def weights(self):
        """The weights whose gradients are accumulated."""
        return self._targets()[0]

    @compile_time
    def buffers(self):
        """Their ``accu_grads`` buffers."""
        return self._targets()[1]

    def _value_and_grads(self, micro, factor):
        return ms.value_and_grad(self.scaled_loss, None, self.weights)(micro, factor)

    def _tally(self, out, weight, totals):
        """Adds one micro-batch's value and count, and tracks the smallest and any non-finite count (checked for
        token losses). The same four loop variables for both loss kinds: with fewer, MindSpore's allocator reached a
        higher actual peak (fragmentation: 28 instead of 24 MB on the benchmark MLP at micro_size 8, measured)."""
        value, count, smallest, finite = totals
        if self.per_token_loss:
            return (value + out[1], count + out[2], ops.minimum(smallest, out[2]),
                    ops.logical_and(finite, ops.isfinite(out[2])))
        return value + out[1] * weight, count + weight, smallest, finite

    def _accumulate(self, split, start, stop, totals, factor, weight):
        # A graph-mode while loop over a Tensor counter is compiled once, whatever the count is, and runs the
        # micro-batches strictly in turn, so micro-batch i's activations are freed before i + 1 starts.
        i = Tensor(start, mstype.int32)
        while i < stop:
            out, grads = self._value_and_grads(micro_batch(split, i), factor)
            totals = self._tally(out, weight, totals)
            value = add_gradients(self.buffers, grads, after=totals[0])
            totals = (value,) + totals[1:]
            i = i + 1
        return totals

    def _check_counts(self, smallest, finite):
        if not finite:
            raise ValueError(f"For '{self.owner_name}', with per_token_loss=True the count returned by 'network' must be "
                             f"a finite number >= 0 (e.g. the number of valid tokens), but a micro-batch returned a "
                             f"non-finite count (inf or nan).")
        if smallest < 0:
            raise ValueError(f"For '{self.owner_name}', with per_token_loss=True the count returned by 'network' must be "
                             f"a finite number >= 0 (e.g. the number of valid tokens), but a micro-batch returned "
                             f"{smallest}.")
        return smallest

    # Compiled as a graph in PyNative mode too: there, a cell with a custom bprop runs its construct under
    # no_grad, where eager gradients are refused, and an eager loop would not free memory per micro-batch.
    @ms.jit
    def construct(self, inputs, scale, unit, key):
        parts = split_batch(inputs, self.micro_size, self.owner_name)
        split, count, rows = parts[0]
        weight = Tensor(1.0, mstype.float32) if self.per_token_loss else rows / unit
        factor = scale * weight
        # Micro-batch 0 runs before the loop, so that it can overwrite the buffers (no zeroing pass per step).
        out, grads = self._value_and_grads(micro_batch(split, Tensor(0, mstype.int32)), factor)
        zero = Tensor(0.0, mstype.float32)
        totals = self._tally(out, weight, (zero, zero, Tensor(float("inf"), mstype.float32), Tensor(True)))
        value = add_gradients(self.buffers, grads, overwrite=self.overwrite, after=totals[0])
        totals = self._accumulate(split, 1, count, (value,) + totals[1:], factor, weight)
        if len(parts) == 2:
            split2, count2, rows2 = parts[1]
            weight2 = weight if self.per_token_loss else rows2 / unit
            totals = self._accumulate(split2, 0, count2, totals, scale * weight2, weight2)
        value, count_total, smallest, finite = totals
        if self.per_token_loss:
            value = ops.depend(value, self._check_counts(smallest, finite))
        return value, count_total

    def bprop(self, inputs, scale, unit, key, out, dout):
        zeros = ()
        for x in inputs:
            zeros += (ZEROS_LIKE(x),)
        return zeros, ZEROS_LIKE(scale), ZEROS_LIKE(unit), 0
