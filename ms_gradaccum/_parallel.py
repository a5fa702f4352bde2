"""The hand-over to MindSpore's semi-auto/auto-parallel accumulation (Ascend/GPU only).

In these modes ``Model`` routes a cell named ``GradAccumulationCell`` into MindSpore's private
``_TrainGradAccuStepCell``, and the parallel compiler pass accumulates the micro-batch gradients into
``accu_grads`` buffers (sharded by the parallel optimizer). MindSpore's own
:class:`mindspore.parallel.nn.GradAccumulation` marks what that pass reads: a ``StridedSlice`` per micro-batch
carrying ``grad_accu_num`` and ``Add`` ops carrying ``forward_end``. This part of ``GradAccumulationCell`` only wraps
it so that the value is the mean loss and the loss scale is not lost on the way. The cell uses it when one of these
modes is in force, set by ``set_auto_parallel_context`` or by ``AutoParallel`` (which sets it while ``Model`` builds
its train cell and while the graph compiles).
"""
from mindspore import nn, ops
from mindspore.common import dtype as mstype

from ms_gradaccum._internals import ParallelPassMarkers, compile_time, enclosing_train_cell, scale_left_out
from ms_gradaccum._loss_scale import PrecisionNeutral

_NAME = "GradAccumulationCell"


def check_parallel_pass_arguments(explicit_loss_scale: bool, per_token_loss: bool) -> None:
    """What the parallel pass cannot do: a token loss, a loss scale of the cell's own."""
    if per_token_loss:
        raise ValueError(
            f"For '{_NAME}', per_token_loss=True is not supported under semi-auto/auto parallel, where MindSpore's "
            f"parallel pass accumulates a scalar loss. Return the mean loss, or train data parallel.")
    if explicit_loss_scale:
        raise ValueError(
            f"For '{_NAME}', the argument 'loss_scale' must be None under semi-auto/auto parallel, where the loss "
            f"scale comes from Model's loss_scale_manager (the cell scales its backward by the optimizer's "
            f"loss_scale).")


class ParallelPassAccumulation(PrecisionNeutral):
    """Returns the mean micro-batch loss, with the gradient of ``loss_scale * sum`` of the micro-batch losses.

    ``_TrainGradAccuStepCell`` reads ``micro_size`` from the cell tree and scales the gradient by
    ``1 / micro_size``, so the gradient handed to it must be that of the SUM. Built by ``Model`` for a
    ``FixedLossScaleManager(S, drop_overflow_update=False)``, it applies no loss scale at all while the optimizer
    still divides by its ``loss_scale`` S: the update would be S times too small, and float16 gradients would
    underflow. So the backward is scaled here by the optimizer's ``loss_scale`` whenever the wrapper is that cell,
    and by 1 otherwise (:func:`~ms_gradaccum._internals.scale_left_out`).
    """

    def __init__(self, network: nn.Cell, micro_size: int):
        super().__init__(auto_prefix=False)
        self.markers = ParallelPassMarkers(network, micro_size)
        self.micro_size = micro_size

    @compile_time
    def left_out_scale(self) -> float:
        """The optimizer's loss_scale when the wrapper never applies it, else 1 (read when the graph compiles)."""
        return scale_left_out(enclosing_train_cell(self))

    def construct(self, *inputs):
        total = ops.cast(self.markers(*inputs), mstype.float32)
        scaled = total * self.left_out_scale
        # Value: the mean loss (what LossMonitor shows); gradient: that of the scaled sum.
        return ops.stop_gradient(total / self.micro_size) + (scaled - ops.stop_gradient(scaled))
