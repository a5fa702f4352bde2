"""AccumulatingTrainOneStepCell: accumulation across dataset steps, one optimizer step every N calls."""
from typing import Optional

import mindspore as ms
from mindspore import nn, ops, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum import _buffers, _loss_scale
from ms_gradaccum._cell import GradAccumulationCell
from ms_gradaccum._loop import MicroBatchGradients, ScaledLoss, add_gradients
from ms_gradaccum._reduce import InPlaceAllReduce, TokenTotals
from ms_gradaccum._validation import (argument_error, check_cell, check_has_trainable_params,
                                      check_positive_int, warn_batch_norm)

_NAME = "AccumulatingTrainOneStepCell"


class AccumulatingTrainOneStepCell(nn.TrainOneStepCell):
    r"""
    A drop-in for ``nn.TrainOneStepCell`` that steps the optimizer once every `accumulate_steps` calls.

    Each call runs forward and backward once on the given batch and adds the gradients into
    parameter-shaped buffers (``accu_grads.<weight>``). When the window is complete the optimizer receives
    the mean gradient of the window's batches, the gradients cross devices (data parallel) once, and the
    buffers are cleared. So `accumulate_steps` calls with batch b give the update of one full-batch step
    with batch ``accumulate_steps * b``. Between optimizer steps the weights do not change at all.

    Unlike :class:`GradAccumulationCell` (which splits ONE batch into micro-batches inside the graph), this
    accumulates over consecutive dataset batches: use it when even one batch of the target size does not fit.

    Windows and epochs: with `steps_per_epoch` set (the :class:`GradAccumulationScheduler` callback sets it
    from ``Model``'s dataset), the last window of an epoch closes at the epoch's last batch even when it is
    short, and it is weighted by its true number of batches (the mean over the batches it holds, not the sum
    divided by `accumulate_steps`); an epoch shorter than `accumulate_steps` still trains, once. Without it,
    windows run across epoch boundaries, and a partial window at the end of training stays pending until
    :meth:`flush` applies it.

    The optimizer's own step counter, and so its learning-rate schedule, advances once per optimizer step.
    The returned loss is the current batch's loss (what ``LossMonitor`` prints); the mean loss of the last
    completed window is :attr:`last_window_loss`. The buffers and the window position (``accu_state.*``) are
    parameters: checkpoints carry them, and a run resumed from a checkpoint taken mid-window ends with the
    same weights as an uninterrupted one.

    Mixed precision: with `scale_sense`, every batch's backward pass (and, for a :class:`GradAccumulationCell`
    network, every micro-batch's) runs on the loss times the current scale; the float32 window sums are
    averaged, reduced across devices and unscaled once. If that gradient is not finite (an overflow in any
    batch or micro-batch of the window, on any device) the optimizer step is skipped: weights and optimizer
    state (moments, ``global_step``) stay bit-unchanged, the buffers are cleared, and a
    ``nn.DynamicLossScaleUpdateCell`` lowers the scale once (and raises it after ``scale_window`` clean
    steps). This check works on CPU too, where MindSpore's own overflow-skipping wrappers do not compile.
    With `max_grad_norm`, the unscaled, reduced window gradient is clipped by global norm once per optimizer
    step (``ops.clip_by_global_norm``), as the full batch would be.

    A :class:`GradAccumulationCell` as `network` is driven directly: its micro-batch loop runs with this cell's
    scale, so ``Model(AccumulatingTrainOneStepCell(GradAccumulationCell(loss_net, 8), opt, 1,
    scale_sense=..., max_grad_norm=1.0))`` gives micro-batches, loss scaling, overflow skipping and clipping
    in one train cell.

    Data parallel: the window's buffers are all-reduced in place, one after another, with the all-reduce
    primitives of the ``DistributedGradReducer`` that ``nn.TrainOneStepCell`` builds, and the optimizer reads
    the buffers; that reducer would hold a reduced copy of every gradient at once. This is the train cell to
    use for parameter-heavy models on several devices, with or without a :class:`GradAccumulationCell` inside.

    Args:
        network (Cell): A cell returning a scalar loss, e.g. ``nn.WithLossCell(net, loss_fn)``, or a
            :class:`GradAccumulationCell`.
        optimizer (nn.Optimizer): The optimizer for the network's weights.
        accumulate_steps (int): Number of calls (batches) per optimizer step; 1 behaves like
            ``nn.TrainOneStepCell``. Changeable between calls with :meth:`set_accumulate_steps`, no recompiling.
        steps_per_epoch (int, optional): Batches per epoch, to close the last window of each epoch.
            Default: ``None`` (windows span epochs).
        scale_sense (Union[None, float, Tensor, Cell]): The loss scale, as ``nn.TrainOneStepWithLossScaleCell``
            takes it: a positive number or scalar Tensor (fixed), or an ``nn.DynamicLossScaleUpdateCell`` /
            ``nn.FixedLossScaleUpdateCell``. Kept in the Parameter :attr:`scale_sense`, so checkpoints carry
            it. The optimizer must then have ``loss_scale=1.0``. Default: ``None`` (no loss scaling).
        max_grad_norm (float, optional): Clip the window gradient to this global norm before the optimizer
            step. Default: ``None`` (no clipping).

    Inputs:
        - **\*inputs** (Tensor) - The inputs of `network`.

    Outputs:
        Without `scale_sense`: Tensor, the loss of this call's batch. With it, like
        ``nn.TrainOneStepWithLossScaleCell``: a tuple ``(loss, overflow, scale)``; `overflow` is True when
        this call closed a window whose step was skipped, and `scale` is the loss scale after the update.

    Raises:
        TypeError: If `network` is not a Cell, `optimizer` not an ``nn.Optimizer``, `accumulate_steps` /
            `steps_per_epoch` not an int, `scale_sense` not one of the accepted kinds, or `max_grad_norm` not a
            number (bool is none of these).
        ValueError: If `accumulate_steps` or `steps_per_epoch` < 1, `scale_sense` or `max_grad_norm` is not
            positive and finite, `network` has no trainable parameter, the optimizer has a ``loss_scale``
            other than 1 while `scale_sense` is given, or a GradAccumulationCell is nested inside `network`.

    Supported Platforms:
        ``CPU``

    Examples:
        >>> import numpy as np
        >>> import mindspore as ms
        >>> from mindspore import nn
        >>> from ms_gradaccum import AccumulatingTrainOneStepCell
        >>> ms.set_context(mode=ms.GRAPH_MODE)
        >>> net = nn.Dense(4, 2)
        >>> step = AccumulatingTrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
        ...                                     nn.SGD(net.trainable_params(), 0.1), accumulate_steps=2)
        >>> x, y = ms.Tensor(np.ones((8, 4), np.float32)), ms.Tensor(np.zeros((8, 2), np.float32))
        >>> before = net.weight.asnumpy().copy()
        >>> _ = step(x, y)            # gradients accumulated, weights unchanged
        >>> bool((net.weight.asnumpy() == before).all()), step.pending_batches
        (True, 1)
        >>> _ = step(x, y)            # window complete: one optimizer step
        >>> bool((net.weight.asnumpy() == before).all()), step.pending_batches
        (False, 0)
        >>> from ms_gradaccum import GradAccumulationCell
        >>> scaled = AccumulatingTrainOneStepCell(GradAccumulationCell(nn.WithLossCell(net, nn.MSELoss()), 4),
        ...                                       nn.SGD(net.trainable_params(), 0.1), 1,
        ...                                       scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 12, 2, 1000),
        ...                                       max_grad_norm=1.0)
        >>> loss, overflow, scale = scaled(x, y)
        >>> bool(overflow), float(scale.asnumpy())
        (False, 4096.0)
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, accumulate_steps: int,
                 steps_per_epoch: Optional[int] = None, scale_sense=None, max_grad_norm: Optional[float] = None):
        check_cell(network, "network", _NAME)
        if not isinstance(optimizer, nn.Optimizer):
            raise TypeError(argument_error(_NAME, "optimizer", "a mindspore.nn.Optimizer", optimizer))
        accumulate_steps = check_positive_int(accumulate_steps, "accumulate_steps", _NAME)
        if steps_per_epoch is not None:
            steps_per_epoch = check_positive_int(steps_per_epoch, "steps_per_epoch", _NAME)
        max_grad_norm = _loss_scale.check_max_grad_norm(max_grad_norm, _NAME)
        scale = None if scale_sense is None else _loss_scale.scale_parameter(scale_sense, _NAME)
        check_has_trainable_params(network, "network", _NAME)
        micro = _micro_batch_cell(network)
        if micro is None and accumulate_steps > 1:
            warn_batch_norm(network, _NAME, f"accumulate_steps={accumulate_steps} batches per optimizer step")
        if scale is not None and float(getattr(optimizer, "loss_scale", 1.0)) != 1.0:
            raise ValueError(
                f"For '{_NAME}', the optimizer's loss_scale must be 1.0 when 'scale_sense' is given (this cell "
                f"unscales the gradients itself, and the optimizer would divide them again), but got "
                f"{optimizer.loss_scale}. Create the optimizer without loss_scale.")
        super().__init__(network, optimizer)
        # A GradAccumulationCell network is not differentiated through its gradient hand-over: its micro-batch
        # loop runs here directly, with this cell's live loss scale, adding into its buffers, which then serve as
        # this cell's window buffers (one set, ``accu_grads.<weight>``, as for any other network).
        self.split_micro_batches = micro is not None
        if self.split_micro_batches:
            self.grad_sums = micro.accu_grads
            self.micro_batch_gradients = MicroBatchGradients(micro.network, self.weights, self.grad_sums,
                                                             micro.micro_size, per_batch_mean=True)
        else:
            self.grad_sums = _buffers.gradient_buffers(self.weights)
            self.scaled_loss = ScaledLoss(network)
        self.token_totals = TokenTotals()
        # Data parallel: the window's gradient is reduced in its buffers, not into new tensors (see InPlaceAllReduce).
        # AdaSum optimizers keep MindSpore's reducer (their own group and degree).
        self.reduce_in_place = self.reducer_flag and isinstance(self.grad_reducer, nn.DistributedGradReducer) and \
            not isinstance(optimizer, (nn.AdaSumByGradWrapCell, nn.AdaSumByDeltaWeightWrapCell))
        if self.reduce_in_place:
            self.in_place_reducer = InPlaceAllReduce(self.grad_reducer)
        self.buffers_match_weights = all(b.dtype == w.dtype for b, w in zip(self.grad_sums, self.weights))
        self.window_position = _buffers.state_scalar("window_position", 0)
        self.epoch_position = _buffers.state_scalar("epoch_position", 0)
        self.accumulate_steps = _buffers.state_scalar("accumulate_steps", accumulate_steps)
        self.steps_per_epoch = _buffers.state_scalar("steps_per_epoch", steps_per_epoch or 0)
        self.window_loss_sum = _buffers.state_scalar("window_loss_sum", 0.0, mstype.float32)
        # For (loss_sum, count) networks: the window's count (stays 0 for mean losses).
        self.window_count = _buffers.state_scalar("window_count", 0.0, mstype.float32)
        self.window_loss = _buffers.state_scalar("last_window_loss", float("nan"), mstype.float32)
        self.hyper_map = ops.HyperMap()
        self.loss_scaled = scale is not None
        if self.loss_scaled:
            self.scale_sense, self.loss_scaling_manager = scale
        self.has_scale_manager = self.loss_scaled and self.loss_scaling_manager is not None
        self.clip = max_grad_norm is not None
        self.max_grad_norm = max_grad_norm

    def _scale(self):
        if self.loss_scaled:
            return ops.cast(self.scale_sense, mstype.float32).reshape(())
        return Tensor(1.0, mstype.float32)

    def construct(self, *inputs):
        scale = self._scale()
        if self.split_micro_batches:
            # Adds the batch's gradient (its mean, or its sum for a (loss_sum, count) network) into grad_sums.
            result = self.micro_batch_gradients(ms.mutable(inputs), scale)
            loss = result[0]
            extra = result[1:]
        else:
            out, grads = ms.value_and_grad(self.scaled_loss, None, self.weights)(inputs, scale)
            loss = add_gradients(self.grad_sums, grads, after=out[1])
            extra = out[2:]
        token = len(extra) == 1
        # What is returned per call: the batch's mean loss (its token mean for a (loss_sum, count) network).
        batch_loss = loss
        if token:
            count = extra[0]
            batch_loss = ops.depend(loss / count, ops.assign_add(self.window_count, count))
        batch_loss = ops.depend(batch_loss, ops.assign_add(self.window_loss_sum, loss))
        batch_loss = ops.depend(batch_loss, ops.assign_add(self.window_position, ops.ones((), mstype.int32)))
        batch_loss = ops.depend(batch_loss, ops.assign_add(self.epoch_position, ops.ones((), mstype.int32)))
        epoch_end = ops.logical_and(self.steps_per_epoch > 0, self.epoch_position >= self.steps_per_epoch)
        if epoch_end:
            batch_loss = ops.depend(batch_loss, ops.assign(self.epoch_position, ops.zeros((), mstype.int32)))
        overflow = Tensor(False, mstype.bool_)
        if ops.logical_or(self.window_position >= self.accumulate_steps, epoch_end):
            overflow = self._apply_window(token)
        if self.loss_scaled:
            return batch_loss, overflow, ops.depend(self._scale(), overflow)
        return ops.depend(batch_loss, overflow)

    def _apply_window(self, token):
        """Optimizer step with the window's mean gradient, reduced across devices once; then reset.

        Returns whether the window overflowed (its step skipped). Order: mean of the window (over its
        batches, or over its tokens for a (loss_sum, count) network, counted on every device), reduced across
        devices, unscaled, all in float32; overflow is judged on that reduced gradient, so every device
        decides the same; the scale is updated once; clipping and the optimizer run only on a finite gradient.
        """
        if token:
            loss_sum, count, factor = self.token_totals(self.window_loss_sum, self.window_count)
            divisor = count / factor
            window_loss = loss_sum / count
        else:
            divisor = ops.cast(self.window_position, mstype.float32)
            window_loss = self.window_loss_sum / divisor
        if self.reduce_in_place:
            # Summed across devices in the buffers, one after another, then divided in place by the window's
            # divisor times the device count when the reducer averages: no gradient-sized tensor per weight.
            after = self.in_place_reducer(self.grad_sums, divisor)
            divisor = ops.depend(divisor, after) * self.in_place_reducer.mean_divisor
            mean = _buffers.divided_in_place(self.grad_sums, divisor)
        else:
            mean = self.grad_reducer(_buffers.divided_in_place(self.grad_sums, divisor))
        overflow = Tensor(False, mstype.bool_)
        if self.loss_scaled:
            mean = _buffers.divided_in_place(mean, self.scale_sense)
            overflow = ops.logical_not(_loss_scale.all_finite(self.hyper_map, mean))
            if self.has_scale_manager:
                overflow = self.loss_scaling_manager(self.scale_sense, overflow)
        stepped = ops.zeros((), mstype.int32)
        if not overflow:
            stepped = ops.depend(stepped, self._step(mean))
        # A scalar that exists only once the optimizer has run (or was skipped): resets depend on it.
        done = ops.depend(ops.zeros((), mstype.int32), stepped)
        done = ops.depend(done, ops.assign(self.window_loss, window_loss))
        done = ops.depend(done, _buffers.clear(self.grad_sums, done))
        done = ops.depend(done, ops.assign(self.window_loss_sum, ops.cast(done, mstype.float32)))
        done = ops.depend(done, ops.assign(self.window_count, ops.cast(done, mstype.float32)))
        done = ops.depend(done, ops.assign(self.window_position, done))
        return ops.depend(overflow, done)

    def _step(self, mean):
        """Clipping (if set) and the optimizer, on the window's mean gradient."""
        if self.clip:
            mean = ops.clip_by_global_norm(mean, self.max_grad_norm)
        elif self.reduce_in_place and self.buffers_match_weights:
            # The optimizer reads the buffers themselves, each right before its update. Handing it `mean` would
            # read them all at one point before the first update, and MindSpore copies every read of a Parameter
            # that is read more than once in a graph (TensorMove; here the all-reduce reads them too): all the
            # copies alive at once, +1.0x the weights, measured on 2 ranks.
            return self.optimizer(self.grad_sums)
        return self.optimizer(_buffers.cast_like(self.hyper_map, mean, self.weights))

    @ms.jit
    def _flush_tokens_graph(self):
        return self._apply_window(True)

    @ms.jit
    def _flush_graph(self):
        return self._apply_window(False)

    def flush(self) -> bool:
        """Apply a pending partial window now (e.g. at the end of a hand-written loop); True if there was one."""
        if self.pending_batches == 0:
            return False
        # Only a (loss_sum, count) network leaves a count: the window is then divided by it.
        if float(self.window_count.asnumpy()) > 0:
            self._flush_tokens_graph()
        else:
            self._flush_graph()
        return True

    @property
    def pending_batches(self) -> int:
        """Batches accumulated since the last optimizer step."""
        return int(self.window_position.asnumpy())

    @property
    def last_window_loss(self) -> float:
        """Mean loss over the batches of the last completed window (NaN before the first optimizer step)."""
        return float(self.window_loss.asnumpy())

    def set_accumulate_steps(self, accumulate_steps: int) -> None:
        """Change the window length between calls; takes effect from the next call, without recompiling."""
        value = check_positive_int(accumulate_steps, "accumulate_steps", _NAME)
        self.accumulate_steps.set_data(ms.Tensor(value, mstype.int32))

    def set_steps_per_epoch(self, steps_per_epoch: int) -> None:
        """Declare the epoch length, so the last window of each epoch is closed at its last batch."""
        value = check_positive_int(steps_per_epoch, "steps_per_epoch", _NAME)
        self.steps_per_epoch.set_data(ms.Tensor(value, mstype.int32))


def _micro_batch_cell(network: nn.Cell) -> Optional[GradAccumulationCell]:
    """``network`` if it is a GradAccumulationCell this cell can drive directly; errors for the other cases."""
    if isinstance(network, GradAccumulationCell):
        if network.parallel_pass:
            raise ValueError(
                f"For '{_NAME}', the argument 'network' is a GradAccumulationCell created under semi-auto/auto "
                f"parallel, where MindSpore's parallel pass does the accumulation; train it with "
                f"Model(GradAccumulationCell(...), optimizer=...) instead.")
        return network
    for name, cell in network.cells_and_names():
        if isinstance(cell, GradAccumulationCell):
            raise ValueError(
                f"For '{_NAME}', a GradAccumulationCell must be the 'network' itself, but it is nested in "
                f"{type(network).__name__} as '{name}'. Wrap the loss network in GradAccumulationCell last: "
                f"{_NAME}(GradAccumulationCell(loss_net, micro_size), optimizer, accumulate_steps).")
    return None
