"""AccumulatingTrainOneStepCell: one optimizer step every `accumulate_steps` batches, each batch optionally split into
`micro_size` micro-batches."""
import warnings
from typing import Optional

import mindspore as ms
from mindspore import nn, ops, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum import _buffers, _loss_scale
from ms_gradaccum._buffers import GradientBuffers
from ms_gradaccum._contract import prepared_for
from ms_gradaccum._cell import GradAccumulationCell, loss_rows
from ms_gradaccum._engine import MicroBatchGradients
from ms_gradaccum._mindspore.graph import CompileChecks, primexpr, run_compile_checks
from ms_gradaccum._mindspore.routing import PARALLEL_PASS_MODES, parallel_mode
from ms_gradaccum._mindspore.surroundings import discover
from ms_gradaccum._reduce import InPlaceAllReduce, ReplicaCheck, TokenTotals, check_data_parallel_ready
from ms_gradaccum._tokens import LabelWatch, warn_token_mean
from ms_gradaccum._validation import (argument_error, check_bool, check_cell, check_has_parameters,
                                      check_input_indices, check_min_count, check_positive_int, check_reduction,
                                      warn_batch_norm)

_NAME = "AccumulatingTrainOneStepCell"


@primexpr
def _count_unit(batch: int, micro_size: int) -> float:
    return float(_buffers.count_unit(batch, micro_size))


class AccumulatingTrainOneStepCell(nn.TrainOneStepCell):
    r"""
    A drop-in for ``nn.TrainOneStepCell`` that steps the optimizer once every `accumulate_steps` calls, each call's
    batch optionally split into `micro_size` micro-batches.

    Each call runs forward and backward on the given batch (once per micro-batch, in turn, inside the compiled
    graph) and adds the gradients into parameter-shaped buffers (``accu_grads.<weight>``, one per parameter of
    the optimizer, as ``nn.TrainOneStepCell`` differentiates). When the window is complete the optimizer receives
    the mean gradient over all the rows of the window's batches, the gradients cross devices (data parallel) once,
    and the buffers are cleared. So `accumulate_steps` calls with batches of b rows give the update of one
    full-batch step on their ``accumulate_steps * b`` rows; a shorter batch in a window counts its rows, not a full
    batch's. Between optimizer steps the weights do not change at all.

    ``AccumulatingTrainOneStepCell(loss_net, opt, 1, micro_size=8)`` is :class:`GradAccumulationCell` as a train
    cell; ``AccumulatingTrainOneStepCell(GradAccumulationCell(loss_net, 8), opt, 1)`` is the same thing (the
    cell's `micro_size` and `per_token_loss` are taken over; giving them again differently is an error). Use
    `accumulate_steps` when even one batch of the target size does not fit.

    Windows and epochs: with `steps_per_epoch` set, the last window of an epoch closes at the epoch's last batch
    even when it is short, weighted by what it holds; an epoch shorter than `accumulate_steps` still trains, once.
    Under ``Model``, :class:`GradAccumulationScheduler` closes every epoch's last window at the end of the epoch
    that actually ran. Otherwise windows run across epoch boundaries, and a partial window at the end of training
    stays pending until :meth:`flush` applies it; under ``Model`` the cell then warns when it compiles.

    The optimizer's own step counter, and so its learning-rate schedule, advances once per optimizer step.
    The returned loss is the current batch's loss (what ``LossMonitor`` prints); the mean loss of the last
    completed window is :attr:`last_window_loss`. The buffers and the window position (``accu_state.*``) are
    parameters: checkpoints carry them, and a run resumed from a checkpoint taken mid-window ends with the
    same weights as an uninterrupted one.

    Mixed precision: with `scale_sense`, every batch's (and micro-batch's) backward pass runs on the loss times the
    current scale; the float32 window sums are reduced across devices and divided once by the scale and the
    window's count. If that gradient is not finite (an overflow in any batch or micro-batch of the window, on any
    device) the optimizer step is skipped: weights and optimizer state (moments, ``global_step``) stay
    bit-unchanged, the buffers are cleared, and a ``nn.DynamicLossScaleUpdateCell`` lowers the scale once (and
    raises it after ``scale_window`` clean steps). This check works on CPU too, where MindSpore's own
    overflow-skipping wrappers do not compile. A float16 network without `scale_sense` gets a ``UserWarning`` when
    the graph compiles. With `max_grad_norm`, the unscaled, reduced window gradient is clipped by global norm once
    per optimizer step (``ops.clip_by_global_norm``), as the full batch would be.

    Token losses: with `per_token_loss`, `network` returns ``(loss_sum, count)`` and the window's gradient is
    divided by the window's total count (over all devices). A window whose total count is 0 updates nothing
    (weights and optimizer state bit-unchanged, the loss scale untouched) and its loss is 0.

    Data parallel: the window's buffers are all-reduced in place, one after another, with the all-reduce
    primitives of the ``DistributedGradReducer`` that ``nn.TrainOneStepCell`` builds, and the optimizer reads
    the buffers; that reducer would hold a reduced copy of every gradient at once. This is the train cell to
    use for parameter-heavy models on several devices. The first step checks that every rank starts from the
    same weights.

    Args:
        network (Cell): A cell returning a scalar loss, e.g. ``nn.WithLossCell(net, loss_fn)`` (or
            ``(loss_sum, count)`` with `per_token_loss`), or a :class:`GradAccumulationCell`.
        optimizer (nn.Optimizer): The optimizer for the network's weights.
        accumulate_steps (int): Number of calls (batches) per optimizer step; 1 behaves like
            ``nn.TrainOneStepCell``. Changeable between calls with :meth:`set_accumulate_steps`, no recompiling.
        micro_size (int, optional): The number of micro-batches each batch is split into (keyword only).
            Default: ``None``: 1, or the `micro_size` of a :class:`GradAccumulationCell` `network`.
        per_token_loss (bool, optional): Whether `network` returns ``(loss_sum, count)`` (keyword only).
            Default: ``None``: ``False``, or that of a :class:`GradAccumulationCell` `network`; undeclared, a loss
            that averages over valid tokens gets a ``UserWarning`` where the update can differ (see
            :class:`GradAccumulationCell`).
        shared_inputs (Union[int, tuple[int]], optional): Indices of the inputs every micro-batch receives whole
            (keyword only; see :class:`GradAccumulationCell`). Default: ``None``: ``()``, or that of a
            :class:`GradAccumulationCell` `network`.
        steps_per_epoch (int, optional): Batches per epoch, to close the last window of each epoch (keyword only).
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
        TypeError: If `network` is not a Cell, `optimizer` not an ``nn.Optimizer``, `accumulate_steps`,
            `micro_size` or `steps_per_epoch` not an int, `per_token_loss` not a bool, `scale_sense` not one of the
            accepted kinds, or `max_grad_norm` not a number (bool is none of these).
        ValueError: If `accumulate_steps`, `micro_size` or `steps_per_epoch` < 1, `scale_sense` or `max_grad_norm`
            is not positive and finite, `network` has no parameter, the optimizer has a ``loss_scale`` other than 1
            while `scale_sense` is given, a GradAccumulationCell is nested inside `network`, or a
            GradAccumulationCell `network` contradicts `micro_size` / `per_token_loss` or has its own
            ``loss_scale``.
        ValueError: At graph compile time, if `network` does not return what `per_token_loss` says; at run time,
            with `per_token_loss`, if a count is negative or not finite; under data parallel, if the ranks start
            from different weights.
        RuntimeError: At graph compile time, under data parallel without ``mindspore.communication.init()``.

    Supported Platforms:
        ``CPU``: stand-alone and data parallel, in CI. GPU and Ascend were not run since its GPU fixes (the suite ran
        once on one H100 before them); ``bash run.sh N --check`` there first.

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
        >>> scaled = AccumulatingTrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
        ...                                       nn.SGD(net.trainable_params(), 0.1), 1, micro_size=4,
        ...                                       scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 12, 2, 1000),
        ...                                       max_grad_norm=1.0)
        >>> loss, overflow, scale = scaled(x, y)
        >>> bool(overflow), float(scale.asnumpy())
        (False, 4096.0)
    """

    # For subclasses that adapt another trainer (ms_gradaccum.mindformers): the prefix of the buffers' names, which
    # checkpoints carry, and the loss-scale update cells `scale_sense` may be (same protocol: get_loss_scale(), and
    # construct(scale, overflow) -> overflow).
    buffer_prefix = _buffers.GRAD_PREFIX
    scale_update_cells = _loss_scale.SCALE_MANAGERS

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, accumulate_steps: int, *,
                 micro_size: Optional[int] = None, per_token_loss: Optional[bool] = None,
                 shared_inputs: Optional[tuple] = None, steps_per_epoch: Optional[int] = None, scale_sense=None,
                 max_grad_norm: Optional[float] = None, reduction: Optional[str] = None,
                 min_count: Optional[float] = None, check_loss: Optional[bool] = None):
        check_cell(network, "network", _NAME)
        if not isinstance(optimizer, nn.Optimizer):
            raise TypeError(argument_error(_NAME, "optimizer", "a mindspore.nn.Optimizer", optimizer))
        accumulate_steps = check_positive_int(accumulate_steps, "accumulate_steps", _NAME)
        declared = per_token_loss is not None or reduction not in (None, "mean") or (
            isinstance(network, GradAccumulationCell) and network.declared_per_token_loss)
        loss_network, micro_size, per_token_loss, shared_inputs, reduction, min_count = _loss_network(
            network, micro_size, per_token_loss, shared_inputs, reduction, min_count)
        if check_loss is None:
            check_loss = network.check_loss if isinstance(network, GradAccumulationCell) else True
        check_loss = check_bool(check_loss, "check_loss", _NAME)
        if steps_per_epoch is not None:
            steps_per_epoch = check_positive_int(steps_per_epoch, "steps_per_epoch", _NAME)
        max_grad_norm = _loss_scale.check_max_grad_norm(max_grad_norm, _NAME)
        scale, manager = _loss_scale.for_train_cell(scale_sense, loss_network, _NAME, self.scale_update_cells)
        check_has_parameters(loss_network, "network", _NAME)
        parts = [f"micro_size={micro_size} micro-batches"] if micro_size > 1 else []
        parts += [f"accumulate_steps={accumulate_steps} batches per optimizer step"] if accumulate_steps > 1 else []
        if parts:
            warn_batch_norm(loss_network, _NAME, " and ".join(parts))
            if not declared:
                warn_token_mean(loss_network, _NAME)
        if scale_sense is not None and float(getattr(optimizer, "loss_scale", 1.0)) != 1.0:
            raise ValueError(
                f"For '{_NAME}', the optimizer's loss_scale must be 1.0 when 'scale_sense' is given (this cell "
                f"unscales the gradients itself, and the optimizer would divide them again), but got "
                f"{optimizer.loss_scale}. Create the optimizer without loss_scale.")
        super().__init__(network, optimizer)
        self.micro_size = micro_size
        self.per_token_loss = per_token_loss
        self.reduction = reduction
        self.min_count = min_count
        self.loss_scale = scale
        self.loss_scaled = scale_sense is not None
        self.loss_scaling_manager = manager
        if self.loss_scaled:
            self.scale_sense = scale.parameter
        # One set of buffers, for the optimizer's parameters (what nn.TrainOneStepCell differentiates). A
        # GradAccumulationCell network is not differentiated through its hand-over: its loss network runs in this
        # cell's engine, and its own buffers (if a graph of it was compiled before) are dropped, one name each.
        if isinstance(network, GradAccumulationCell):
            network.gradient_buffers.for_weights([])
        self.gradient_buffers = GradientBuffers(self.buffer_prefix)
        self.grad_sums = self.gradient_buffers.for_weights(self.weights)
        self.shared_inputs = shared_inputs
        self.engine = MicroBatchGradients(loss_network, micro_size, per_token_loss, overwrite=False,
                                          targets=self._targets, cls_name=_NAME, shared_inputs=shared_inputs,
                                          sum_over_rows=reduction == "sum", check_loss=check_loss,
                                          labels=LabelWatch(loss_network, _NAME, declared or not parts))
        self.token_totals = TokenTotals(per_token_loss, _NAME)
        self.replicas = ReplicaCheck(self._targets, _NAME)
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
        # The window's loss value and count (see _buffers: rows in units of count_unit for a mean loss, the
        # network's count for a token loss), and the unit, fixed by the window's first batch.
        self.window_loss_sum = _buffers.state_scalar("window_loss_sum", 0.0, mstype.float32)
        self.window_count = _buffers.state_scalar("window_count", 0.0, mstype.float32)
        self.window_rows = _buffers.state_scalar("window_rows", 0.0, mstype.float32)
        self.count_unit = _buffers.state_scalar("count_unit", 1.0, mstype.float32)
        self.window_loss = _buffers.state_scalar("last_window_loss", float("nan"), mstype.float32)
        self.hyper_map = ops.HyperMap()
        self.clip = max_grad_norm is not None
        self.max_grad_norm = max_grad_norm
        self.compile_checks = CompileChecks(self)

    def check_at_compile(self) -> None:
        """What is checked when the graph compiles (and at every call in PyNative mode): see
        _mindspore.graph.CompileChecks."""
        check_data_parallel_ready(_NAME)
        if parallel_mode() in PARALLEL_PASS_MODES:
            raise RuntimeError(
                f"For '{_NAME}', semi-auto/auto parallel is not supported: there MindSpore's parallel pass does the "
                f"accumulation and shards its buffers. Train Model(GradAccumulationCell(loss_net, micro_size), "
                f"optimizer=...) instead (under set_auto_parallel_context or AutoParallel).")
        outer = discover(self).optimizer
        if outer is not None:
            raise ValueError(
                f"For '{_NAME}', the cell is a train cell with its own optimizer, but it is wrapped in another cell "
                f"that holds an optimizer too (Model(cell, optimizer=...) builds one), which would apply a second, "
                f"zero update. Train it as Model({_NAME}(...)) without optimizer=, or call it directly.")
        self.loss_scale.check()
        self._warn_windows_across_epochs()

    def _warn_windows_across_epochs(self) -> None:
        """One UserWarning when Model trains this cell with windows of several batches and nothing closes an epoch's
        last window: it would run on into the next epoch, and the last one of training would never be applied."""
        if self.__dict__.get("_epoch_windows_closed") or self.__dict__.get("_warned_windows"):
            return
        steps = int(self.accumulate_steps.asnumpy())
        if steps > 1 and int(self.steps_per_epoch.asnumpy()) == 0 and discover(self).under_model:
            object.__setattr__(self, "_warned_windows", True)
            warnings.warn(
                f"{type(self).__name__}: Model trains windows of accumulate_steps={steps} batches, but nothing closes "
                f"an epoch's last window: it runs on into the next epoch, and a window still open when training ends "
                f"is never applied (pending_batches counts it). Pass callbacks=[GradAccumulationScheduler({{0: "
                f"{steps}}})] to Model.train, which closes every epoch's last window as Lightning does, or "
                f"steps_per_epoch=<batches per epoch> to the cell.", UserWarning, stacklevel=2)

    def _targets(self) -> tuple:
        """``(weights, buffers)``: the optimizer's parameters, as for nn.TrainOneStepCell, and their buffers."""
        return self.weights, self.grad_sums

    def _unit(self, batch):
        """The count unit of this window: that of its first batch (see _buffers); unused for token losses."""
        if self.per_token_loss:
            return Tensor(1.0, mstype.float32)
        unit = Tensor(_count_unit(batch, self.micro_size), mstype.float32)
        if self.window_position == 0:
            ops.assign(self.count_unit, unit)
        return ops.depend(self.count_unit * 1.0, unit)

    def __call__(self, *args, **kwargs):
        if ms.get_context("mode") == ms.PYNATIVE_MODE:
            # The loss contract's eager pass on the batch (in graph mode, where the graph compiles: _contract).
            with prepared_for(self, args):
                return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def construct(self, *inputs):
        loss, overflow, scale = self._train_step(*inputs)
        if self.loss_scaled:
            return loss, overflow, scale
        return ops.depend(loss, overflow)

    def _train_step(self, *inputs):
        """One call: ``(the batch's loss, whether the window closed here overflowed, the loss scale)``."""
        run_compile_checks(self.compile_checks)
        # Under data parallel, the first step first checks that every rank holds the same weights.
        scale = self.replicas(self.loss_scale())
        split, shared, constants, layout = self.engine.split_inputs(inputs)
        unit = self._unit(split[0].shape[0])
        value, count, loss_like = self.engine(split, shared, constants, layout, scale, unit, "")
        # What is returned per call: the batch's loss (its mean, token mean, or sum as its reduction says).
        rows = Tensor(split[0].shape[0], mstype.float32)
        batch_loss = _buffers.normalise(scale, value, count, 1.0, self.min_count,
                                        loss_rows(self.per_token_loss, self.reduction == "sum", count, unit, rows))[0]
        batch_loss = ops.depend(batch_loss, ops.assign_add(self.window_loss_sum, value))
        batch_loss = ops.depend(batch_loss, ops.assign_add(self.window_count, count))
        batch_loss = ops.depend(batch_loss, ops.assign_add(self.window_rows, rows))
        batch_loss = ops.depend(batch_loss, ops.assign_add(self.window_position, ops.ones((), mstype.int32)))
        batch_loss = ops.depend(batch_loss, ops.assign_add(self.epoch_position, ops.ones((), mstype.int32)))
        epoch_end = ops.logical_and(self.steps_per_epoch > 0, self.epoch_position >= self.steps_per_epoch)
        if epoch_end:
            batch_loss = ops.depend(batch_loss, ops.assign(self.epoch_position, ops.zeros((), mstype.int32)))
        overflow = Tensor(False, mstype.bool_)
        if ops.logical_or(self.window_position >= self.accumulate_steps, epoch_end):
            overflow = self._apply_window(scale)
        batch_loss = ops.reshape(batch_loss, loss_like.shape)   # the network's loss shape: () or (1,)
        return batch_loss, overflow, ops.depend(self.loss_scale(), overflow)

    def _apply_window(self, scale):
        """Optimizer step with the window's mean gradient, reduced across devices once; then reset.

        Returns whether the window overflowed (its step skipped). The buffers are divided once, in float32, by
        ``_buffers.divisor`` (the loss scale times the window's count, counted on every device for token losses),
        after the all-reduce when it is done in place; overflow is judged on that reduced gradient, so every device
        decides the same; the scale is updated once; clipping and the optimizer run only on a finite gradient. A
        window without a single counted token updates nothing and leaves the scale alone.
        """
        value, count, factor = self.token_totals(self.window_loss_sum, self.window_count)
        empty = ops.maximum(count, self.min_count) <= 0
        rows = loss_rows(self.per_token_loss, self.reduction == "sum", count, self.count_unit * 1.0, self.window_rows)
        window_loss, divisor = _buffers.normalise(scale, value, count, factor, self.min_count, rows)
        if self.reduce_in_place:
            # Summed across devices in the buffers, one after another, then divided in place (times the device count
            # when the reducer averages): no gradient-sized tensor per weight.
            after = self.in_place_reducer(self.grad_sums, divisor)
            mean = _buffers.divide_in_place(self.grad_sums, ops.depend(divisor, after) * self.in_place_reducer.devices)
        else:
            mean = self.grad_reducer(_buffers.divide_in_place(self.grad_sums, divisor))
        # The step depends on the quotients: where the optimizer reads the buffers themselves (see _step), nothing else
        # would use them, and MindSpore drops in-place kernels whose outputs are unused (measured 2.10.0).
        overflow = ops.depend(Tensor(False, mstype.bool_), mean)
        if self.loss_scaled:
            overflow = ops.logical_not(_loss_scale.all_finite(self.hyper_map, mean))
            if self.loss_scaling_manager is not None:
                if not empty:
                    overflow = self.loss_scaling_manager(self.scale_sense, overflow)
        stepped = ops.zeros((), mstype.int32)
        if not ops.logical_or(overflow, empty):
            stepped = ops.depend(stepped, self._step(mean))
        # A scalar that exists only once the optimizer has run (or was skipped): resets depend on it.
        done = ops.depend(ops.zeros((), mstype.int32), stepped)
        done = ops.depend(done, ops.assign(self.window_loss, window_loss))
        done = ops.depend(done, _buffers.clear(self.grad_sums, done))
        done = ops.depend(done, ops.assign(self.window_loss_sum, ops.cast(done, mstype.float32)))
        done = ops.depend(done, ops.assign(self.window_count, ops.cast(done, mstype.float32)))
        done = ops.depend(done, ops.assign(self.window_rows, ops.cast(done, mstype.float32)))
        done = ops.depend(done, ops.assign(self.window_position, done))
        return ops.depend(overflow, done)

    def _step(self, mean):
        """Clipping (if set) and the optimizer, on the window's mean gradient (the buffers, divided in place)."""
        if self.clip:
            return self._optimize(ops.clip_by_global_norm(mean, self.max_grad_norm), False)
        return self._optimize(mean, True)

    def _optimize(self, grads, are_buffers: bool):
        """The optimizer on `grads`; `are_buffers` says they are the buffers themselves (a constant)."""
        if are_buffers and self.reduce_in_place and self.buffers_match_weights:
            # The optimizer reads the buffers themselves, each right before its update. Handing it `grads` would
            # read them all at one point before the first update, and MindSpore copies every read of a Parameter
            # that is read more than once in a graph (TensorMove; here the all-reduce reads them too): all the
            # copies alive at once, +1.0x the weights, measured on 2 ranks.
            return self.optimizer(self.grad_sums)
        return self.optimizer(_buffers.cast_like(self.hyper_map, grads, self.weights))

    @ms.jit
    def _flush_graph(self):
        return self._apply_window(self.loss_scale())

    def flush(self) -> bool:
        """Apply a pending partial window now (e.g. at the end of a hand-written loop); True if there was one."""
        if self.pending_batches == 0:
            return False
        self._flush_graph()
        return True

    @property
    def pending_batches(self) -> int:
        """Batches accumulated since the last optimizer step. A hand-written loop that ends with pending batches has
        not applied them: call :meth:`flush` (or declare `steps_per_epoch`). Under ``Model`` without
        :class:`GradAccumulationScheduler` or `steps_per_epoch` the cell warns when it compiles."""
        return int(self.window_position.asnumpy())

    @property
    def last_window_loss(self) -> float:
        """Mean loss over the rows (or tokens) of the last completed window (NaN before the first optimizer step)."""
        return float(self.window_loss.asnumpy())

    def set_accumulate_steps(self, accumulate_steps: int) -> None:
        """Change the window length between calls; takes effect from the next call, without recompiling."""
        value = check_positive_int(accumulate_steps, "accumulate_steps", _NAME)
        self.accumulate_steps.set_data(ms.Tensor(value, mstype.int32))

    def set_steps_per_epoch(self, steps_per_epoch: int) -> None:
        """Declare the epoch length, so the last window of each epoch is closed at its last batch."""
        value = check_positive_int(steps_per_epoch, "steps_per_epoch", _NAME)
        self.steps_per_epoch.set_data(ms.Tensor(value, mstype.int32))


def _loss_network(network: nn.Cell, micro_size: Optional[int], per_token_loss: Optional[bool],
                  shared_inputs: Optional[tuple], reduction: Optional[str], min_count: Optional[float]) -> tuple:
    """``(loss network, micro_size, per_token_loss, shared_inputs, reduction, min_count)``: a GradAccumulationCell is
    taken apart into what it holds (the same as passing its arguments here); anything contradicting it, or a nested
    one, is an error."""
    if reduction is not None:
        reduction = check_reduction(reduction, _NAME)
    if micro_size is not None:
        micro_size = check_positive_int(micro_size, "micro_size", _NAME)
    if per_token_loss is not None:
        per_token_loss = check_bool(per_token_loss, "per_token_loss", _NAME)
    if shared_inputs is not None:
        shared_inputs = check_input_indices(shared_inputs, "shared_inputs", _NAME)
    if isinstance(network, GradAccumulationCell):
        for name, given, held in (("micro_size", micro_size, network.micro_size),
                                  ("per_token_loss", per_token_loss, network.per_token_loss),
                                  ("shared_inputs", shared_inputs, network.shared_inputs),
                                  ("reduction", reduction, network.reduction),
                                  ("min_count", min_count, network.min_count)):
            if given is not None and given != held:
                raise ValueError(
                    f"For '{_NAME}', the argument '{name}' is {given!r} but the GradAccumulationCell given as "
                    f"'network' has {name}={held!r}. Give it once: either AccumulatingTrainOneStepCell(loss_net, "
                    f"optimizer, accumulate_steps, {name}=...) or the GradAccumulationCell's.")
        if network.explicit_loss_scale:
            raise ValueError(
                f"For '{_NAME}', the GradAccumulationCell given as 'network' has its own loss_scale, which this cell "
                f"does not use (it scales every micro-batch by its own scale_sense). Build the GradAccumulationCell "
                f"without loss_scale and pass the scale as scale_sense=... here.")
        return (network.network, network.micro_size, network.per_token_loss, network.shared_inputs, network.reduction,
                network.min_count)
    for name, cell in network.cells_and_names():
        if isinstance(cell, GradAccumulationCell):
            raise ValueError(
                f"For '{_NAME}', a GradAccumulationCell must be the 'network' itself, but it is nested in "
                f"{type(network).__name__} as '{name}'. Wrap the loss network in GradAccumulationCell last, or "
                f"pass micro_size here: {_NAME}(loss_net, optimizer, accumulate_steps, micro_size=...).")
    per_token_loss = bool(per_token_loss)
    min_count = check_min_count(0.0 if min_count is None else min_count, per_token_loss, _NAME)
    return network, 1 if micro_size is None else micro_size, per_token_loss, shared_inputs or (), reduction or "mean", \
        min_count
