"""The in-graph micro-batch loop: forward and backward once per micro-batch, in turn, gradients summed.

Used by :class:`GradAccumulationCell` (stand-alone and data parallel) and by
:class:`AccumulatingTrainOneStepCell` when its network is a ``GradAccumulationCell``.
"""
import mindspore as ms
from mindspore import nn, ops, Tensor, ParameterTuple
from mindspore.common import dtype as mstype
from mindspore.ops.primitive import _primexpr

from ms_gradaccum._microbatch import check_loss_shape, check_loss_tuple, micro_batch, split_batch


_PRECISION_FLAGS = ("fp16", "fp32", "bf16")


class PrecisionNeutral(nn.Cell):
    """A cell of this package's machinery that ``to_float`` / amp levels pass through to the user's network.

    ``Cell.to_float`` (what ``Model``'s ``amp_level="O2"/"O3"`` calls) flags every cell in the tree, and a
    flagged cell casts every float tensor it handles, including the float32 loop-carried sums and the loss
    scale, which breaks the loop ("Type Join Failed: Float32, Float16"). The network inside keeps its flags.
    """

    def add_flags_recursive(self, **flags):
        self.add_flags(**{key: value for key, value in flags.items() if key not in _PRECISION_FLAGS})
        for cell in self.cells():
            cell.add_flags_recursive(**flags)
        return self


@_primexpr
def accumulation_dtype(dtype):
    """Sum low-precision gradients in float32 so K micro-batches cannot overflow or lose the small terms."""
    if dtype in (mstype.float16, mstype.bfloat16):
        return mstype.float32
    return dtype


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
    """``(loss * scale, loss)``, or ``(loss_sum * scale, loss_sum, count)`` for a ``(loss_sum, count)`` network.

    Only the first output carries a gradient (the others are behind ``stop_gradient``), so differentiating
    this cell runs the backward pass on the scaled loss. The product is taken in float32, so a float16 loss
    times a large scale cannot overflow in the forward value; the backward then starts from ``scale`` in the
    loss's own dtype, as ``nn.TrainOneStepCell``'s ``sens`` does. With ``scale == 1`` the gradients are
    bit-identical to unscaled ones.
    """

    def __init__(self, network: nn.Cell):
        super().__init__(auto_prefix=False)
        self.loss_of_inputs = TupleInputs(network)

    def construct(self, inputs, scale):
        out = self.loss_of_inputs(inputs)
        if isinstance(out, tuple):
            shapes = ()
            for item in out:
                shapes += (item.shape,)
            check_loss_tuple(shapes)
            loss_sum = ops.cast(out[0], mstype.float32)
            return loss_sum * scale, ops.stop_gradient(loss_sum), ops.stop_gradient(ops.cast(out[1], mstype.float32))
        check_loss_shape(out.shape)
        loss = ops.cast(out, mstype.float32)
        return loss * scale, ops.stop_gradient(loss)


class MicroBatchGradients(PrecisionNeutral):
    """Runs the micro-batches one after another and sums their scaled gradients (float32 for float16/bfloat16).

    Returns, for a network returning a mean loss: ``(mean scaled gradient, mean loss)``, each micro-batch
    weighted by its number of rows (so a batch not divisible by ``micro_size`` gives the full batch's mean);
    for a ``(loss_sum, count)`` network: ``(summed scaled gradient, loss_sum, count)``, to be divided by the
    count (summed across devices and windows by the caller). Nothing is unscaled here: the caller does that
    once. Its ``bprop`` returns zeros for the inputs, so an outer ``GradOperation`` treats it as opaque and does
    not differentiate through the loop (which would recompute everything and hold every activation).
    """

    def __init__(self, network: nn.Cell, weights: ParameterTuple, micro_size: int):
        super().__init__(auto_prefix=False)
        self.scaled_loss = ScaledLoss(network)
        self.weights = weights
        self.micro_size = micro_size

    def _value_and_grads(self, micro, scale):
        return ms.value_and_grad(self.scaled_loss, None, self.weights)(micro, scale)

    def _zeros(self):
        sums = ()
        for w in self.weights:
            sums += (ops.zeros(w.shape, accumulation_dtype(w.dtype)),)
        return sums

    def _accumulate(self, split, start, stop, sums, loss_total, count_total, scale, token):
        # A graph-mode while loop over a Tensor counter is compiled once, whatever the count is, and runs the
        # micro-batches strictly in turn, so micro-batch i's activations are freed before i + 1 starts.
        i = Tensor(start, mstype.int32)
        while i < stop:
            out, grads = self._value_and_grads(micro_batch(split, i), scale)
            loss_total = loss_total + out[1]
            if token:
                count_total = count_total + out[2]
            new_sums = ()
            for total, grad in zip(sums, grads):
                new_sums += (total + ops.cast(grad, total.dtype),)
            sums = new_sums
            i = i + 1
        return sums, loss_total, count_total

    # Compiled as a graph in PyNative mode too: there, a cell with a custom bprop runs its construct under
    # no_grad, where eager gradients are refused, and an eager loop would not free memory per micro-batch.
    @ms.jit
    def construct(self, inputs, scale):
        parts = split_batch(inputs, self.micro_size)
        split, count, rows = parts[0]
        # Micro-batch 0 runs before the loop: its output says, at compile time, which kind of loss this is.
        out, grads = self._value_and_grads(micro_batch(split, Tensor(0, mstype.int32)), scale)
        token = len(out) == 3
        sums = ()
        for zero, grad in zip(self._zeros(), grads):
            sums += (zero + ops.cast(grad, zero.dtype),)
        count_total = out[2] if token else Tensor(0.0, mstype.float32)
        sums, loss_total, count_total = self._accumulate(split, 1, count, sums, out[1], count_total, scale, token)
        if token:
            if len(parts) == 2:
                split, count, _ = parts[1]
                sums, loss_total, count_total = self._accumulate(split, 0, count, sums, loss_total, count_total,
                                                                 scale, token)
            return sums, loss_total, count_total
        if len(parts) == 1:
            means = ()
            for total in sums:
                means += (total / count,)
            return means, loss_total / count
        # Two sizes of micro-batch: weight each part's sums by its rows per micro-batch, divide by the batch.
        split2, count2, rows2 = parts[1]
        sums2, loss2, _ = self._accumulate(split2, 0, count2, self._zeros(), Tensor(0.0, mstype.float32),
                                           count_total, scale, token)
        batch = count * rows + count2 * rows2
        means = ()
        for total, total2 in zip(sums, sums2):
            means += ((total * rows + total2 * rows2) / batch,)
        return means, (loss_total * rows + loss2 * rows2) / batch

    def bprop(self, inputs, scale, out, dout):
        zeros = ()
        for x in inputs:
            zeros += (ops.zeros_like(x),)
        return zeros, ops.zeros_like(scale)
