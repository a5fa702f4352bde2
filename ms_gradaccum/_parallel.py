"""The hand-over to MindSpore's semi-auto/auto-parallel accumulation (Ascend/GPU only).

In these modes ``Model`` routes a cell named ``GradAccumulationCell`` into MindSpore's private
``_TrainGradAccuStepCell``, and the parallel compiler pass accumulates the micro-batch gradients into
``accu_grads`` buffers (sharded by the parallel optimizer). MindSpore's own
:class:`mindspore.parallel.nn.GradAccumulation` marks what that pass reads: a ``StridedSlice`` per micro-batch
carrying ``grad_accu_num`` and ``Add`` ops carrying ``forward_end``. This module only wraps it so that the
value is the mean loss and the loss scale is not lost on the way.
"""
import mindspore as ms
from mindspore import nn, ops
from mindspore.common import dtype as mstype
from mindspore.parallel.nn import GradAccumulation

from ms_gradaccum._loss_scale import missing_loss_scale

# In these modes the routing is MindSpore's real mechanism, and the cell hands the work to it.
PARALLEL_PASS_MODES = frozenset({ms.ParallelMode.SEMI_AUTO_PARALLEL, ms.ParallelMode.AUTO_PARALLEL})


def parallel_pass_mode() -> bool:
    """True when the semi-auto/auto-parallel compiler pass does the accumulation (Ascend/GPU only)."""
    return ms.get_auto_parallel_context("parallel_mode") in PARALLEL_PASS_MODES


class ParallelPassAccumulation(nn.Cell):
    """Returns the mean micro-batch loss, with the gradient of ``loss_scale * sum`` of the micro-batch losses.

    ``_TrainGradAccuStepCell`` reads ``micro_size`` from the cell tree and scales the gradient by
    ``1 / micro_size``, so the gradient handed to it must be that of the SUM. Built by ``Model`` for a
    ``FixedLossScaleManager(S, drop_overflow_update=False)``, it applies no loss scale at all while the optimizer
    still divides by its ``loss_scale`` S (``mindspore/train/amp.py::build_train_network``, 2.10.0): the update
    would be S times too small, and float16 gradients would underflow. So the backward is scaled here by the
    optimizer's ``loss_scale`` whenever the wrapper is that cell (:func:`missing_loss_scale`), and by 1 otherwise.
    """

    def __init__(self, network: nn.Cell, micro_size: int, key: str):
        super().__init__(auto_prefix=False)
        self.grad_accumulation = GradAccumulation(network, micro_size)
        self.micro_size = micro_size
        self.key = key

    def construct(self, *inputs):
        total = ops.cast(self.grad_accumulation(*inputs), mstype.float32)
        scaled = total * missing_loss_scale(self.key)
        # Value: the mean loss (what LossMonitor shows); gradient: that of the scaled sum.
        return ops.stop_gradient(total / self.micro_size) + (scaled - ops.stop_gradient(scaled))
