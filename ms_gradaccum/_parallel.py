"""The hand-over to MindSpore's semi-auto/auto-parallel accumulation (Ascend/GPU only).

In these modes ``Model`` routes a cell named ``GradAccumulationCell`` into MindSpore's private
``_TrainGradAccuStepCell``, and the parallel compiler pass accumulates the micro-batch gradients into
``accu_grads`` buffers (sharded by the parallel optimizer). MindSpore's own
:class:`mindspore.parallel.nn.GradAccumulation` marks what that pass reads: a ``StridedSlice`` per micro-batch
carrying ``grad_accu_num`` and ``Add`` ops carrying ``forward_end``. This variant of the cell only wraps it so that
the value is the mean loss and the loss scale is not lost on the way. ``GradAccumulationCell(...)`` builds it when
one of these modes is in force.
"""
from mindspore import nn, ops
from mindspore.common import dtype as mstype

from ms_gradaccum._cell import GradAccumulationCell, validate_arguments
from ms_gradaccum._internals import ParallelPassMarkers, compile_time, enclosing_train_cell, scale_left_out
from ms_gradaccum._loss_scale import PrecisionNeutral

_NAME = "GradAccumulationCell"


class ParallelPassGradAccumulationCell(GradAccumulationCell):
    """Returns the mean micro-batch loss, with the gradient of ``loss_scale * sum`` of the micro-batch losses.

    ``_TrainGradAccuStepCell`` reads ``micro_size`` from the cell tree and scales the gradient by
    ``1 / micro_size``, so the gradient handed to it must be that of the SUM. Built by ``Model`` for a
    ``FixedLossScaleManager(S, drop_overflow_update=False)``, it applies no loss scale at all while the optimizer
    still divides by its ``loss_scale`` S: the update would be S times too small, and float16 gradients would
    underflow. So the backward is scaled here by the optimizer's ``loss_scale`` whenever the wrapper is that cell,
    and by 1 otherwise (:func:`~ms_gradaccum._internals.scale_left_out`).
    """

    def __init__(self, network: nn.Cell, micro_size: int, loss_scale=None, per_token_loss: bool = False):
        micro_size, per_token_loss = validate_arguments(network, micro_size, per_token_loss)
        if per_token_loss:
            raise ValueError(
                f"For '{_NAME}', per_token_loss=True is not supported under semi-auto/auto parallel, where MindSpore's "
                f"parallel pass accumulates a scalar loss. Return the mean loss, or train data parallel.")
        if loss_scale is not None:
            raise ValueError(
                f"For '{_NAME}', the argument 'loss_scale' must be None under semi-auto/auto parallel, where the loss "
                f"scale comes from Model's loss_scale_manager (the cell scales its backward by the optimizer's "
                f"loss_scale), but got {loss_scale!r}.")
        PrecisionNeutral.__init__(self, auto_prefix=False)   # none of the stand-alone machinery is built
        self.network = network
        self.micro_size = micro_size
        self.per_token_loss = False
        self.explicit_loss_scale = False
        self.markers = ParallelPassMarkers(network, micro_size)

    @property
    def cls_name(self) -> str:
        # In these modes the routing into _TrainGradAccuStepCell is wanted (the markers would trigger it anyway).
        return "GradAccumulationCell"

    @compile_time
    def left_out_scale(self) -> float:
        """The optimizer's loss_scale when the wrapper never applies it, else 1 (read when the graph compiles)."""
        return scale_left_out(enclosing_train_cell(self))

    def construct(self, *inputs):
        total = ops.cast(self.markers(*inputs), mstype.float32)
        scaled = total * self.left_out_scale
        # Value: the mean loss (what LossMonitor shows); gradient: that of the scaled sum.
        return ops.stop_gradient(total / self.micro_size) + (scaled - ops.stop_gradient(scaled))
