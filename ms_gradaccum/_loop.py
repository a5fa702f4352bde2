"""The in-graph micro-batch loop: forward and backward once per micro-batch, in turn, gradients summed.

Used by :class:`GradAccumulationCell` (stand-alone and data parallel) and by
:class:`AccumulatingTrainOneStepCell` when its network is a ``GradAccumulationCell``.
"""
import mindspore as ms
from mindspore import nn, ops, Tensor, ParameterTuple
from mindspore.common import dtype as mstype
from mindspore.ops.primitive import _primexpr

from ms_gradaccum._microbatch import check_loss_shape, check_loss_tuple, micro_batch, plan, split_batch


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


def add_gradients(buffers, grads, weight=1.0, overwrite=False, after=None):
    """``buffers += grads * weight`` (``=`` when `overwrite`), in place, in float32 for low-precision gradients.

    Returns `after` made to depend on the writes. The writes go last weight first: side effects on
    Parameters run in program order, and the backward pass produces the last layer's gradient first, so in
    this order each gradient is added, and freed, as soon as it exists instead of all of them waiting for the
    first layer's (measured on four 1536-wide Dense layers: 9 MB of gradients alive at once instead of 27 MB).
    """
    for j in range(len(grads) - 1, -1, -1):
        grad = ops.cast(grads[j], buffers[j].dtype)
        if weight != 1.0:
            grad = grad * weight
        write = ops.assign(buffers[j], grad) if overwrite else ops.assign_add(buffers[j], grad)
        after = write if after is None else ops.depend(after, write)
    return after


def scale_in_place(buffers, factor, after):
    """``buffers *= factor``, in place, one buffer after another, once `after` exists; returns `after` after them."""
    for buffer in buffers:
        # Writes to Parameters run in program order: after the adds before this call, before those after it.
        buffer *= ops.cast(factor, buffer.dtype)
        after = ops.depend(after, buffer)
    return after


class MicroBatchGradients(PrecisionNeutral):
    """Runs the micro-batches one after another, adding their scaled gradients into `buffers` in place.

    The buffers are Parameters (float32 for float16/bfloat16 weights): each micro-batch's gradient is added
    into them as it is produced, so no gradient-sized tensor is carried through the loop or copied after it.
    Nothing is unscaled here: the caller does that once.

    With ``per_batch_mean=False`` (:class:`GradAccumulationCell`) the buffers are overwritten by the first
    micro-batch and end up holding the micro-batch gradients summed, the larger micro-batches' unweighted and,
    for a batch not divisible by ``micro_size``, the smaller ones' weighted by their rows relative to the larger
    ones' (see :func:`mean_divisor`). With ``per_batch_mean=True`` (:class:`AccumulatingTrainOneStepCell`'s
    window) the batch's mean gradient, each micro-batch weighted by its share of the rows, is added to what
    the buffers hold. For a ``(loss_sum, count)`` network every micro-batch's gradient is added unweighted, to be
    divided by the count by the caller.

    Returns ``(mean loss,)`` for a network returning a mean loss (row-weighted, so a batch not divisible by
    ``micro_size`` gives the full batch's mean), ``(loss_sum, count)`` for a ``(loss_sum, count)`` network.
    Its ``bprop`` returns zeros for the inputs, so an outer ``GradOperation`` treats it as opaque and does not
    differentiate through the loop (which would recompute everything and hold every activation).
    """

    def __init__(self, network: nn.Cell, weights: ParameterTuple, buffers: ParameterTuple, micro_size: int,
                 per_batch_mean: bool):
        super().__init__(auto_prefix=False)
        self.scaled_loss = ScaledLoss(network)
        self.weights = weights
        self.buffers = buffers
        self.micro_size = micro_size
        self.per_batch_mean = per_batch_mean

    def _value_and_grads(self, micro, scale):
        return ms.value_and_grad(self.scaled_loss, None, self.weights)(micro, scale)

    def _accumulate(self, split, start, stop, loss_total, count_total, scale, token, weight):
        # A graph-mode while loop over a Tensor counter is compiled once, whatever the count is, and runs the
        # micro-batches strictly in turn, so micro-batch i's activations are freed before i + 1 starts.
        i = Tensor(start, mstype.int32)
        while i < stop:
            out, grads = self._value_and_grads(micro_batch(split, i), scale)
            loss_total = loss_total + out[1]
            if token:
                count_total = count_total + out[2]
            loss_total = add_gradients(self.buffers, grads, weight, after=loss_total)
            i = i + 1
        return loss_total, count_total

    # Compiled as a graph in PyNative mode too: there, a cell with a custom bprop runs its construct under
    # no_grad, where eager gradients are refused, and an eager loop would not free memory per micro-batch.
    @ms.jit
    def construct(self, inputs, scale):
        parts = split_batch(inputs, self.micro_size)
        split, count, rows = parts[0]
        batch = inputs[0].shape[0]
        # Micro-batch 0 runs before the loop: its output says, at compile time, which kind of loss this is.
        out, grads = self._value_and_grads(micro_batch(split, Tensor(0, mstype.int32)), scale)
        token = len(out) == 3
        # The micro-batch gradients are added unweighted (the smaller micro-batches of an uneven split weighted
        # by their rows over the larger ones'): a weighted add would create a gradient-sized product per weight
        # while the backward pass still holds its own. For the batch's mean on top of what the buffers hold
        # (per_batch_mean, mean losses), the buffers are divided by the larger micro-batches' share of the rows
        # before and multiplied by it after, in place, one buffer at a time.
        share = 1.0 if token or not self.per_batch_mean else rows / batch
        if share != 1.0:
            loss_total = scale_in_place(self.buffers, 1.0 / share, out[1])
        else:
            loss_total = out[1]
        loss_total = add_gradients(self.buffers, grads, overwrite=not self.per_batch_mean, after=loss_total)
        count_total = out[2] if token else Tensor(0.0, mstype.float32)
        loss_total, count_total = self._accumulate(split, 1, count, loss_total, count_total, scale, token, 1.0)
        if len(parts) == 2:
            split2, count2, rows2 = parts[1]
            weight2 = 1.0 if token else rows2 / rows
            loss2, count_total = self._accumulate(split2, 0, count2, Tensor(0.0, mstype.float32), count_total,
                                                  scale, token, weight2)
            if share != 1.0:
                loss2 = scale_in_place(self.buffers, share, loss2)
            if not token:
                return ((loss_total * rows + loss2 * rows2) / batch,)
            loss_total = loss_total + loss2
        elif share != 1.0:
            loss_total = scale_in_place(self.buffers, share, loss_total)
        if token:
            return loss_total, count_total
        return (loss_total / count,)

    def bprop(self, inputs, scale, out, dout):
        zeros = ()
        for x in inputs:
            zeros += (ops.zeros_like(x),)
        return zeros, ops.zeros_like(scale)


@_primexpr
def mean_divisor(batch: int, micro_size: int) -> float:
    """What :class:`MicroBatchGradients` (``per_batch_mean=False``) sums must be divided by for the batch mean.

    ``micro_size`` when it divides the batch; otherwise the batch over the rows of the larger micro-batches
    (whose gradients are summed unweighted, the smaller ones' being weighted by their rows over those).
    """
    return batch / plan(batch, micro_size)[0][1]


class GradientOf(PrecisionNeutral):
    """Zero in the forward pass; in the backward pass, hands ``buffer * dout / divisor`` to `weight` as its gradient.

    This is how an unmodified ``nn.TrainOneStepCell`` (and so ``Model``) receives the accumulated gradient: the
    backward of this cell scales the buffer in place and returns the buffer itself, so no gradient-sized
    tensor is created after the loop (autodiff of ``sum(stop_gradient(g) * weight)`` would create one).
    ``dout`` is the wrapper's ``sens`` (its loss scale, or 1) and `divisor` the backward scale of the
    micro-batches times the number the sums are divided by, so the wrapper gets exactly ``mean_gradient * sens``.
    """

    def construct(self, weight, buffer, divisor):
        # Depends on `weight`, or autodiff prunes this cell and `weight` gets no gradient from it.
        return ops.depend(ops.zeros((), mstype.float32), weight)

    def bprop(self, weight, buffer, divisor, out, dout):
        # In graph mode `*=` updates the Parameter in place (CPU kernel graph: Mul then Assign, weight by weight); an
        # ops.assign(buffer, buffer * f) would allocate a product per weight, all alive at once (measured: +27 MB
        # on four 1536-wide Dense layers). In PyNative mode it is an ordinary product, as correct.
        buffer *= ops.cast(dout, buffer.dtype) / ops.cast(divisor, buffer.dtype)
        return ops.cast(buffer, weight.dtype), ops.zeros_like(buffer), ops.zeros_like(divisor)
