"""Semi-auto/auto parallel (Ascend/GPU only): the hand-over to MindSpore's own accumulation (docs/design.md).

``Model`` routes a cell named ``GradAccumulationCell`` into MindSpore's ``_TrainGradAccuStepCell``, and the parallel
compiler pass accumulates into its ``accu_grads`` buffers, reading the marks of
:class:`mindspore.parallel.nn.GradAccumulation`. :class:`ParallelPassAccumulation` wraps that cell so that the value is
the mean loss and the loss scale is not lost on the way. Imported only in those modes: a stand-alone or data-parallel
step never reads this module.
"""
import weakref

from mindspore import nn, ops
from mindspore.common import dtype as mstype
# Marks micro-batch slices (`grad_accu_num`) and forward ends (`forward_end`) for the parallel pass; only the pass
# reads those attributes.
from mindspore.parallel.nn import GradAccumulation

from ms_gradaccum._mindspore.graph import compile_time, primexpr
from ms_gradaccum._mindspore.parallel import batch_axis_splits, scale_left_out
from ms_gradaccum._mindspore.surroundings import parallel_mode
from ms_gradaccum.core.base import PrecisionNeutral
from ms_gradaccum.core.microbatch import input_shapes

_NAME = "GradAccumulationCell"


class ParallelPassMarkers(GradAccumulation):
    """MindSpore's GradAccumulation under a name that Model does not route (GradAccumulationCell presents the routed
    name itself, in the modes where routing is wanted)."""

    @property
    def cls_name(self) -> str:
        return "ParallelPassMarkers"


def check_parallel_pass_arguments(explicit_loss_scale: bool, kind, shared_inputs: tuple = ()) -> None:
    """What the parallel pass cannot do: a loss kind other than a row mean (a token loss, a loss that sums its rows), a
    loss scale of the cell's own, inputs it does not slice."""
    if not kind.in_parallel_pass:
        raise ValueError(
            f"For '{_NAME}', {kind.setting} is not supported under semi-auto/auto parallel, where MindSpore's "
            f"parallel pass averages the micro-batch losses (a mean over rows). Return the mean loss, or train data "
            f"parallel.")
    if shared_inputs:
        raise ValueError(
            f"For '{_NAME}', shared_inputs={shared_inputs} is not supported under semi-auto/auto parallel, where "
            f"MindSpore's parallel pass slices every input along axis 0. Give those inputs one row per sample, or "
            f"train data parallel.")
    if explicit_loss_scale:
        raise ValueError(
            f"For '{_NAME}', the argument 'loss_scale' must be None under semi-auto/auto parallel, where the loss "
            f"scale comes from Model's loss_scale_manager (the cell scales its backward by the optimizer's "
            f"loss_scale).")


def rows_per_rank(rows: int, split: int) -> str:
    """``"29 rows"``, or ``"29 rows per rank (232 across 8 ranks)"`` when `split` ranks share axis 0."""
    return f"{rows} rows" if split == 1 else f"{rows // split} rows per rank ({rows} across {split} ranks)"


@primexpr
def check_parallel_pass_batch(shapes: tuple, splits: tuple, micro_size: int, mode: str) -> None:
    """Refuse, when the graph compiles, a batch the parallel pass cannot split into `micro_size` equal micro-batches.

    MindSpore's ``_MicroBatch`` (mindspore/nn/wrap/cell_wrapper.py) slices rows ``[n * i, n * (i + 1))`` with
    ``n = rows // micro_size`` for micro-batch ``i``, and ``_TrainGradAccuStepCell`` scales the summed gradient by
    ``1 / micro_size`` (its ``sens``): equal micro-batches are part of that contract, and a micro-batch of unequal rows
    could not be given its weight there. MindSpore checks only the global rows, and raises an internal
    message from its own wrapper; this check runs first, and on each rank's rows (`splits`, see
    :func:`~ms_gradaccum._mindspore.parallel.batch_axis_splits`), since every rank slices its own share.
    """
    for index, shape in enumerate(shapes):
        if shape is None or not shape:
            raise ValueError(
                f"For '{_NAME}', under {mode} MindSpore's parallel pass slices every input along axis 0, but input "
                f"{index} is {'not a Tensor' if shape is None else 'a 0-d Tensor'}. Pass only batched Tensors there, "
                f"or train data parallel, where such inputs reach every micro-batch.")
        if shape[0] < 0:
            continue   # a dynamic batch size: MindSpore's own checks speak for it
        split = splits[index] if len(splits) > 1 else splits[0]
        if shape[0] % (split * micro_size) != 0:
            raise ValueError(
                f"For '{_NAME}', under {mode} MindSpore's parallel pass splits every batch into micro_size="
                f"{micro_size} micro-batches of equal size, so micro_size must divide each rank's batch, but input "
                f"{index} (shape {shape}) holds {rows_per_rank(shape[0], split)}. Batch the dataset with "
                f"drop_remainder=True (dataset.batch(batch_size, drop_remainder=True)), or choose a batch size that "
                f"micro_size divides. Stand-alone and data parallel take any batch size.")


class ParallelPassAccumulation(PrecisionNeutral):
    """Returns the mean micro-batch loss, with the gradient of ``loss_scale * sum`` of the micro-batch losses.

    ``_TrainGradAccuStepCell`` reads ``micro_size`` from the cell tree and scales the gradient by
    ``1 / micro_size``, so the gradient handed to it must be that of the SUM. Built by ``Model`` for a
    ``FixedLossScaleManager(S, drop_overflow_update=False)``, it applies no loss scale at all while the optimizer
    still divides by its ``loss_scale`` S: the update would be S times too small, and float16 gradients would
    underflow. So the backward is scaled here by the optimizer's ``loss_scale`` whenever the wrapper is that cell,
    and by 1 otherwise (:func:`~ms_gradaccum._mindspore.parallel.scale_left_out`).
    """

    def __init__(self, network: nn.Cell, micro_size: int, owner: nn.Cell):
        super().__init__(auto_prefix=False)
        object.__setattr__(self, "_owner", weakref.ref(owner))   # the GradAccumulationCell: its surroundings
        self.markers = ParallelPassMarkers(network, micro_size)
        self.micro_size = micro_size

    @compile_time
    def left_out_scale(self) -> float:
        """The optimizer's loss_scale when the wrapper never applies it, else 1 (of the train cell around the owner as
        it was bound: cells.binding)."""
        return scale_left_out(self._owner().surroundings.train_cell)

    @compile_time
    def batch_splits(self) -> tuple:
        """How many ranks share axis 0 of each input (read when the graph compiles)."""
        return batch_axis_splits()

    @compile_time
    def mode(self) -> str:
        """The parallel mode in force when the graph compiles (for the message)."""
        return parallel_mode()

    def construct(self, *inputs):
        # Before the markers, whose own check would raise MindSpore's message (global rows only) from inside them.
        check_parallel_pass_batch(input_shapes(inputs), self.batch_splits, self.micro_size, self.mode)
        total = ops.cast(self.markers(*inputs), mstype.float32)
        scaled = total * self.left_out_scale
        # Value: the mean loss (what LossMonitor shows); gradient: that of the scaled sum.
        return ops.stop_gradient(total / self.micro_size) + (scaled - ops.stop_gradient(scaled))
