"""Cross-device sums for token-normalised losses, once per optimizer step.

For a ``(loss_sum, count)`` network the update is ``sum(gradients of loss_sum) / sum(count)`` over the global
batch. Gradients are still reduced by the wrapping train cell's ``DistributedGradReducer`` (which averages
over the ``group_size`` devices when ``gradients_mean`` is set); this module sums the loss and the count
across devices in one 2-element all-reduce, and says by how much the local gradient must be multiplied so
that the wrapper's reduction gives the global token mean.
"""
import mindspore as ms
from mindspore import ops
from mindspore.communication import get_group_size

from ms_gradaccum._loop import PrecisionNeutral


class TokenTotals(PrecisionNeutral):
    """``(global loss_sum, global count, gradient factor)`` from this device's sums.

    The factor is the device count when the gradients are averaged across devices (``gradients_mean=True``)
    and 1 otherwise, so that ``factor * local_gradient_sum / global_count``, reduced by the wrapper, equals the
    global batch's ``sum(gradients) / sum(count)``. Stand-alone, everything passes through.
    """

    def __init__(self):
        super().__init__(auto_prefix=False)
        self.data_parallel = ms.get_auto_parallel_context("parallel_mode") == ms.ParallelMode.DATA_PARALLEL
        self.factor = 1.0
        if self.data_parallel:
            self.all_reduce = ops.AllReduce()
            if ms.get_auto_parallel_context("gradients_mean"):
                self.factor = float(get_group_size())

    def construct(self, loss_sum, count):
        if self.data_parallel:
            both = self.all_reduce(ops.stack((loss_sum, count)))
            return both[0], both[1], self.factor
        return loss_sum, count, self.factor


class InPlaceAllReduce(PrecisionNeutral):
    """The all-reduce of a train cell's ``DistributedGradReducer``, done in place on Parameter buffers.

    The reducer all-reduces each gradient into a new tensor and, when ``gradients_mean`` is set, multiplies that
    by ``1 / group_size`` into another; the optimizer then holds all of them until its last update. A train cell
    whose gradient sits in ``accu_grads`` buffers can instead write each sum back into its buffer, one buffer
    after another, so that only one gradient-sized temporary exists at a time and the optimizer reads the
    buffers themselves. Same all-reduce primitives and the same filter of ``layerwise_parallel`` weights as the
    reducer; the caller divides by :attr:`mean_divisor` (the device count when the reducer averages, else 1).
    """

    def __init__(self, reducer):
        super().__init__(auto_prefix=False)
        self.reduce = tuple(reducer.allreduce_filter)
        if reducer.split_fusion:
            self.all_reduces = tuple(reducer.op_list)
        else:
            self.all_reduces = (reducer.allreduce,) * len(self.reduce)
        self.mean_divisor = float(round(1.0 / float(reducer.degree.asnumpy()))) if reducer.mean else 1.0

    def construct(self, buffers, after):
        """Sums every buffer across devices in place, once ``after`` exists; returns ``after`` after the writes."""
        for j in range(len(buffers)):
            if self.reduce[j]:
                buffer = buffers[j]
                # Writes to Parameters run in program order, so each read follows the previous write.
                after = ops.depend(after, ops.assign(buffer, self.all_reduces[j](ops.depend(buffer, after))))
        return after
