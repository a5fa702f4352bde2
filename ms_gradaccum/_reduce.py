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
