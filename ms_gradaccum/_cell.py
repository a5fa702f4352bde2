"""The public cells: validate the arguments, wire the parts, ``construct``."""
import mindspore as ms
from mindspore import nn, ops, Tensor, ParameterTuple
from mindspore.common import dtype as mstype

from ms_gradaccum import _buffers, _loss_scale
from ms_gradaccum._loop import GradientOf, MicroBatchGradients, PrecisionNeutral, mean_divisor
from ms_gradaccum._reduce import TokenTotals
from ms_gradaccum._parallel import ParallelPassAccumulation, parallel_pass_mode
from ms_gradaccum._validation import check_cell, check_has_trainable_params, check_positive_int, warn_batch_norm

# Names that mindspore.train.amp._is_grad_accumulation routes into _TrainGradAccuStepCell, whose optimizer
# reads buffers that only the semi-auto-parallel compiler pass fills: outside that mode it trains nothing.
_ROUTED_NAMES = frozenset({"GradAccumulationCell", "GradAccumulation"})
_UNROUTED_NAME = "MicroBatchGradAccumulationCell"
_NAME = "GradAccumulationCell"


class GradAccumulationCell(PrecisionNeutral):
    r"""
    Gradient accumulation over micro-batches that trains in every mode, including under ``mindspore.Model``.

    Unlike :class:`mindspore.nn.GradAccumulationCell`, which only accumulates under semi-auto/auto parallel
    (elsewhere ``Model`` routes it into a wrapper whose optimizer reads buffers nobody writes, so it silently
    trains nothing), this cell computes the accumulated gradient itself: each batch is split along axis 0
    into ``micro_size`` micro-batches inside the compiled graph; each runs forward and backward once, in turn;
    their gradients are summed, and the wrapping ``nn.TrainOneStepCell`` (built by you or by ``Model``) sees
    exactly the mean gradient, so the optimizer steps once per batch with the full-batch update.

    How it plugs into an unmodified ``nn.TrainOneStepCell``: each micro-batch's gradient is added, in place
    and as soon as the backward pass produces it, into one buffer per weight, ``accu_grads.<weight>`` (float32
    for float16 weights; a Parameter, so it is visible in ``get_parameters()`` and saved in checkpoints).
    The cell's value is the loss; in the wrapper's backward pass a small cell with its own ``bprop`` scales
    each buffer in place to the mean gradient (times the wrapper's ``sens``) and hands the buffer itself over
    as that weight's gradient, so no gradient-sized tensor is created after the loop. Gradient reduction
    across devices (data parallel) and loss scaling therefore happen once per batch, in the wrapping cell, as
    for any other network. The buffers carry nothing from one step to the next (each step's first micro-batch
    overwrites them), so a run resumed from a checkpoint is exact with or without them.

    Loss scaling (mixed precision): every micro-batch's backward pass runs on its loss times the loss scale,
    so float16/bfloat16 gradients do not underflow; the sums are kept in float32 and unscaled once, in float32,
    before the wrapping cell's ``sens`` multiplies them back and the optimizer divides it out (no double
    scaling). The scale is `loss_scale` when given, else the fixed ``sens`` of the MindSpore train cell that
    wraps this one (``nn.TrainOneStepCell(..., sens=S)``, which ``Model`` builds for
    ``FixedLossScaleManager(S, drop_overflow_update=False)``), read when the graph is compiled. An overflowing
    micro-batch makes the gradient non-finite, so wrappers that check for overflow skip the step. For a scale
    that changes while training, and to skip overflowing steps on CPU, wrap this cell in
    :class:`AccumulatingTrainOneStepCell` with ``scale_sense``.

    Under ``SEMI_AUTO_PARALLEL`` and ``AUTO_PARALLEL`` (Ascend/GPU) the cell instead presents itself to
    MindSpore's own parallel pipeline: it wraps :class:`mindspore.parallel.nn.GradAccumulation` (which marks
    the micro-batch slices and the end of each micro-batch's forward), ``Model`` routes it into MindSpore's
    accumulating train cell, and the parallel pass accumulates into ``accu_grads`` buffers that the parallel
    optimizer shards. The output is still the mean loss. The parallel mode in force when the cell is
    created decides which mechanism it uses.

    Peak memory follows the micro-batch: it is that of one plain training step on one micro-batch, plus the
    input batch and the accumulator (one float32 copy of the weights), less the gradients a plain step holds
    all at once and the accumulation frees as they come. The loop over micro-batches is a graph-mode
    ``while`` loop, so compile time does not grow with ``micro_size``.

    Equivalence with full-batch training holds when the loss is a mean over the batch and the network treats
    samples independently, or when `network` returns ``(loss_sum, count)`` (e.g. a masked token loss and the
    number of valid tokens): then the gradient is that of ``sum(loss_sum) / sum(count)`` over the whole batch
    (and over all devices under data parallel, the count being summed once per step). It does not hold for
    BatchNorm (statistics are per micro-batch, and moving averages are updated ``micro_size`` times per step;
    a ``UserWarning`` at construction names such cells) or dropout (different random masks).

    Args:
        network (Cell): A cell returning a scalar loss, e.g. ``nn.WithLossCell(net, loss_fn)``, or any loss
            cell taking one or more tensor inputs (data, label, sample weight, ...); or a cell returning
            ``(loss_sum, count)``, two scalars. Every input is split along axis 0.
        micro_size (int): The NUMBER of micro-batches each batch is split into (not the size of one; the name
            is MindSpore's). Any batch size works: a batch not divisible by it is split as evenly as possible
            (sizes differing by at most one row) and each micro-batch is weighted by its rows.
        loss_scale (Union[None, float, Tensor, Parameter]): The loss scale of the micro-batch backward passes.
            ``None``: that of the train cell wrapping this one (1.0 if none). A number or scalar Tensor: fixed.
            A Parameter is read live at every step, e.g. ``mindspore.amp.DynamicLossScaler(...).scale_value`` in
            a functional training step. Default: ``None``.

    Inputs:
        - **\*inputs** (Tensor) - The inputs of `network`, all with the same batch size :math:`B` on axis 0.

    Outputs:
        Tensor, a float32 scalar: the full-batch loss, i.e. the row-weighted mean of the micro-batch losses, or
        ``sum(loss_sum) / sum(count)`` for a ``(loss_sum, count)`` network. ``LossMonitor`` prints this number.

    Raises:
        TypeError: If `network` is not a Cell, `micro_size` is not an int (bool included), or `loss_scale` is
            not None, a number or a scalar Tensor.
        ValueError: If `micro_size` < 1, `loss_scale` is not positive and finite, or `network` has no trainable
            parameter.
        ValueError: At graph compile time, if the wrapping train cell changes its loss scale while training
            (``nn.TrainOneStepWithLossScaleCell`` with a ``DynamicLossScaleUpdateCell``); the message gives the fix.
        ValueError: At graph compile time, if an input has no batch axis or an empty one, the inputs' batch sizes
            differ, or `network` returns neither a scalar loss nor a tuple of two scalars.

    Supported Platforms:
        ``CPU``

    Examples:
        >>> import numpy as np
        >>> import mindspore as ms
        >>> from mindspore import nn
        >>> from ms_gradaccum import GradAccumulationCell
        >>> ms.set_context(mode=ms.GRAPH_MODE)
        >>> net = nn.Dense(4, 2)
        >>> loss_net = GradAccumulationCell(nn.WithLossCell(net, nn.MSELoss()), micro_size=4)
        >>> train_step = nn.TrainOneStepCell(loss_net, nn.SGD(net.trainable_params(), 0.1))
        >>> x = ms.Tensor(np.ones((8, 4), np.float32))
        >>> y = ms.Tensor(np.zeros((8, 2), np.float32))
        >>> loss = train_step(x, y)
        >>> loss.shape
        ()
    """

    def __init__(self, network: nn.Cell, micro_size: int, loss_scale=None):
        check_cell(network, "network", _NAME)
        micro_size = check_positive_int(micro_size, "micro_size", _NAME)
        loss_scale = _loss_scale.explicit_loss_scale(loss_scale, _NAME)
        weights = check_has_trainable_params(network, "network", _NAME)
        if micro_size > 1:
            warn_batch_norm(network, _NAME, f"micro_size={micro_size} micro-batches")
        super().__init__(auto_prefix=False)
        self.network = network
        self.micro_size = micro_size
        self.weights = ParameterTuple(weights)
        # Where the scale of the micro-batch backward passes comes from (see _loss_scale): a Parameter kept
        # as an attribute is read live each step; a number is a constant; None is the wrapper's, at compile time.
        self.live_scale = isinstance(loss_scale, ms.Parameter)
        if self.live_scale:
            self.loss_scale = loss_scale
        else:
            self.fixed_scale = loss_scale
        self.key = _loss_scale.register(self)
        self.parallel_pass = parallel_pass_mode()
        if self.parallel_pass:
            self.parallel_accumulation = ParallelPassAccumulation(network, micro_size, self.key)
        else:
            self.accu_grads = _buffers.gradient_buffers(self.weights)
            self.micro_batch_gradients = MicroBatchGradients(network, self.weights, self.accu_grads, micro_size,
                                                             per_batch_mean=False)
            self.token_totals = TokenTotals()
            self.gradient_of = GradientOf()

    @property
    def cls_name(self) -> str:
        # mindspore.train.amp._is_grad_accumulation reads cls_name to pick Model's training wrapper.
        # Under a routed name this cell would be handed to _TrainGradAccuStepCell and train nothing.
        # In the parallel-pass modes that routing is wanted (and the wrapped MindSpore cell triggers it anyway).
        if getattr(self, "parallel_pass", False):
            return "GradAccumulationCell"
        name = type(self).__name__
        return _UNROUTED_NAME if name in _ROUTED_NAMES else name

    def backward_scale(self):
        """The loss scale the micro-batch backward passes run with, as a float32 scalar Tensor."""
        if self.live_scale:
            return ops.cast(self.loss_scale, mstype.float32).reshape(())
        if self.fixed_scale is None:
            return Tensor(_loss_scale.wrapper_loss_scale(self.key), mstype.float32)
        return Tensor(self.fixed_scale, mstype.float32)

    def construct(self, *inputs):
        if self.parallel_pass:
            return self.parallel_accumulation(*inputs)
        scale = self.backward_scale()
        result = self.micro_batch_gradients(ms.mutable(inputs), scale)
        if len(result) == 2:   # a (loss_sum, count) network: divide by the count of the whole (global) batch
            loss_sum, count, factor = self.token_totals(result[0], result[1])
            loss = loss_sum / count
            divisor = scale * count / factor
        else:
            loss = result[0]
            divisor = scale * mean_divisor(inputs[0].shape[0], self.micro_size)
        # The hand-over reads the buffers: this data dependency orders it after the micro-batch loop (the loss
        # exists only once the loop is done). Behind stop_gradient, or autodiff fails on networks with BatchNorm.
        loss = ops.stop_gradient(loss)
        divisor = ops.depend(divisor, loss)
        for weight, buffer in zip(self.weights, self.accu_grads):
            # Adds zero; its backward hands each weight its buffer, unscaled (in float32) and times the sens.
            loss = loss + self.gradient_of(weight, buffer, divisor)
        return loss
