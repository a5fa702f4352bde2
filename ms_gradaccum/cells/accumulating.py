"""AccumulatingTrainOneStepCell: one optimizer step every `accumulate_steps` batches, each batch optionally split into
`micro_size` micro-batches."""
import dataclasses
from typing import Optional

import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.graph import CompileChecks, compile_time, run_compile_checks
from ms_gradaccum._mindspore.surroundings import Surroundings
from ms_gradaccum._mindspore.surroundings import parallel_pass_in_force, phase_noting
from ms_gradaccum.cells.binding import BoundCell
from ms_gradaccum.cells.compile_hook import done_waiting, expect_compile
from ms_gradaccum.cells.grad_accumulation import DataParallelParts, GradAccumulationCell, data_parallel_module
from ms_gradaccum.core import buffers as _buffers
from ms_gradaccum.core.batch_norm import DEFAULT as BATCH_NORM_DEFAULT
from ms_gradaccum.core.batch_norm import check_batch_norm, freeze, moving_statistics
from ms_gradaccum.core.buffers import GradientBuffers
from ms_gradaccum.core.engine import MicroBatchGradients, field, warn_where_inexact
from ms_gradaccum.core.kinds import LossKind, LossSpec, RowMean, SpecFields, declares_kind
from ms_gradaccum.core.loss_scale import SCALE_MANAGERS, all_finite, scale_of
from ms_gradaccum.core.tokens import recognised
from ms_gradaccum.core.validation import (argument_error, check_cell, check_has_parameters, check_positive_float,
                                          check_positive_int, foreign_optimizer_error)
from ms_gradaccum.core.window import StateUnderOptimizer, Window
from ms_gradaccum.diagnostics.contract import LossContract


_NAME = "AccumulatingTrainOneStepCell"


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How an adapter's train step differs from :class:`AccumulatingTrainOneStepCell`'s own (``ms_gradaccum.adapters``
    states the contract), passed in as ``options=``."""

    #: The prefix of the buffers' names (checkpoints carry them).
    buffer_prefix: str = _buffers.GRAD_PREFIX
    #: The loss-scale update cells `scale_sense` may be (protocol: ``get_loss_scale()``,
    #: ``construct(scale, overflow) -> overflow``).
    scale_update_cells: tuple = SCALE_MANAGERS
    #: Whether an overflowing window's step is skipped (mindone's ``drop_overflow_update=False`` applies it anyway).
    skips_overflow: bool = True
    #: Whether the window's state (:meth:`AccumulatingTrainOneStepCell.state`) is registered under the optimizer too,
    #: for trainers whose resume loads a checkpoint into the model and the optimizer only (MindFormers, mindone).
    state_under_optimizer: bool = False


class AccumulatingTrainOneStepCell(BoundCell, DataParallelParts, SpecFields, nn.TrainOneStepCell):
    r"""
    A drop-in for ``nn.TrainOneStepCell`` that steps the optimizer once every `accumulate_steps` calls, each call's
    batch optionally split into `micro_size` micro-batches.

    Each call runs forward and backward on its batch (micro-batch by micro-batch, inside the compiled graph) and adds
    the gradients into ``accu_grads.<weight>``; when the window closes, the optimizer gets the mean gradient over all
    the rows of the window, reduced across devices once (in place), clipped once (`max_grad_norm`), skipped exactly
    when it overflows (`scale_sense`). Between steps the weights do not change. Windows close at `accumulate_steps`
    calls, at an epoch's last batch with `steps_per_epoch` or :class:`GradAccumulationScheduler`, or by :meth:`flush`.
    The window's state (``accu_state.*``) is in checkpoints: a run resumed mid-window ends with the same weights.
    Contract as :class:`GradAccumulationCell`; details in ``docs/design.md``.

    Args:
        network (Cell): A loss network (or a :class:`GradAccumulationCell`, whose settings are taken over).
        optimizer (nn.Optimizer): The optimizer for the network's weights.
        accumulate_steps (int): Calls per optimizer step (:meth:`set_accumulate_steps` changes it, no recompiling).
        micro_size, per_token_loss, shared_inputs, reduction, min_count, check_loss, kind: As for
            :class:`GradAccumulationCell` (keyword only).
        steps_per_epoch (int, optional): Batches per epoch, to close each epoch's last window.
        scale_sense (Union[None, float, Tensor, Cell]): The loss scale, or an ``nn.DynamicLossScaleUpdateCell`` /
            ``nn.FixedLossScaleUpdateCell``, as ``nn.TrainOneStepWithLossScaleCell`` takes it.
        max_grad_norm (float, optional): Clip the window's gradient to this global norm.
        batch_norm (str, optional): As for :class:`GradAccumulationCell`; with ``'per_step'`` the moving statistics
            move once per optimizer step, from every micro-batch of every batch of the window.

    Outputs:
        The batch's loss; with `scale_sense`, ``(loss, overflow, scale)``.

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
    """

    # The extension point for adapters (ms_gradaccum.adapters states the contract): `options` passed in, and the public
    # hooks below overridden: transform_gradients, after_optimizer_step (and construct, calling accumulate, when its
    # outputs differ).

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, accumulate_steps: int, *,
                 micro_size: Optional[int] = None, per_token_loss: Optional[bool] = None,
                 shared_inputs: Optional[tuple] = None, steps_per_epoch: Optional[int] = None, scale_sense=None,
                 max_grad_norm: Optional[float] = None, reduction: Optional[str] = None,
                 min_count: Optional[float] = None, check_loss: Optional[bool] = None, kind: Optional[LossKind] = None,
                 options: Optional[StepOptions] = None, batch_norm: Optional[str] = None):
        check_cell(network, "network", _NAME)
        batch_norm = _batch_norm_of(network, check_batch_norm(batch_norm, _NAME))
        options = StepOptions() if options is None else options
        if not isinstance(options, StepOptions):
            raise TypeError(argument_error(_NAME, "options", "None or an ms_gradaccum.cells.accumulating.StepOptions",
                                           options))
        if not isinstance(optimizer, nn.Optimizer):
            raise TypeError(argument_error(_NAME, "optimizer", "a mindspore.nn.Optimizer", optimizer))
        accumulate_steps = check_positive_int(accumulate_steps, "accumulate_steps", _NAME)
        loss_network, spec = _loss_network(network, dict(micro_size=micro_size, per_token_loss=per_token_loss,
                                                         shared_inputs=shared_inputs, reduction=reduction,
                                                         min_count=min_count, check_loss=check_loss, kind=kind))
        if steps_per_epoch is not None:
            steps_per_epoch = check_positive_int(steps_per_epoch, "steps_per_epoch", _NAME)
        if max_grad_norm is not None:
            max_grad_norm = check_positive_float(max_grad_norm, "max_grad_norm", _NAME, "None or a positive float")
        scale, manager = scale_of(scale_sense, loss_network, options.scale_update_cells, _NAME)
        check_has_parameters(loss_network, "network", _NAME)
        foreign = foreign_optimizer_error(_NAME, loss_network, optimizer)
        if foreign is not None:
            raise foreign
        splits = [f"micro_size={spec.micro_size} micro-batches"] if spec.micro_size > 1 else []
        splits += [f"accumulate_steps={accumulate_steps} batches per optimizer step"] if accumulate_steps > 1 else []
        if isinstance(network, GradAccumulationCell) and network.engine.combines_statistics:
            network.engine.statistics.release()   # taken apart: this cell's engine combines them
        statistics = moving_statistics(loss_network, batch_norm, _NAME, bool(splits))
        if batch_norm == "frozen":
            freeze(loss_network, _NAME)
        warn_where_inexact(loss_network, _NAME, splits, batch_norm)
        spec = recognised(spec, loss_network, bool(splits))
        if scale_sense is not None and float(getattr(optimizer, "loss_scale", 1.0)) != 1.0:
            raise ValueError(
                f"For '{_NAME}', the optimizer's loss_scale must be 1.0 when 'scale_sense' is given (this cell "
                f"unscales the gradients itself, and the optimizer would divide them again), but got "
                f"{optimizer.loss_scale}. Create the optimizer without loss_scale.")
        super().__init__(network, optimizer)
        self.use_spec(spec)
        self.options = options
        self.skips_overflow = options.skips_overflow
        self.state_under_optimizer = options.state_under_optimizer
        self.loss_scale = scale
        self.loss_scaled = scale_sense is not None
        self.loss_scaling_manager = manager
        if self.loss_scaled:
            self.scale_sense = scale.parameter
        # One set of buffers, for the optimizer's parameters (what nn.TrainOneStepCell differentiates); a
        # GradAccumulationCell network's own (from a graph of it compiled before) are dropped, one name each.
        if isinstance(network, GradAccumulationCell):
            network.gradient_buffers.for_weights([])
            done_waiting(network)   # taken apart: it never compiles
        self.gradient_buffers = GradientBuffers(options.buffer_prefix)
        self.grad_sums = self.gradient_buffers.for_weights(self.weights)
        #: The BatchNorm choice in force (``batch_norm``; None given: 'per_step').
        self.batch_norm = batch_norm or BATCH_NORM_DEFAULT
        self.engine = MicroBatchGradients(loss_network, spec, overwrite=False, cls_name=_NAME, loss_scale=scale,
                                          statistics=statistics)
        self.engine.bind_targets(self.weights, self.grad_sums)   # the optimizer's parameters, as nn.TrainOneStepCell
        self.contract = LossContract.of(self.engine, loss_network, spec, _NAME)
        # Data parallel: the window's gradient is reduced in its buffers, not into new tensors (see InPlaceAllReduce).
        # AdaSum optimizers keep MindSpore's reducer (their own group and degree).
        self.reduce_in_place = self.reducer_flag and isinstance(self.grad_reducer, nn.DistributedGradReducer) and \
            not isinstance(optimizer, (nn.AdaSumByGradWrapCell, nn.AdaSumByDeltaWeightWrapCell))
        if self.reduce_in_place:
            self.in_place_reducer = data_parallel_module().InPlaceAllReduce(self.grad_reducer)
        self.buffers_match_weights = _buffers.dtypes_match(self.weights, self.grad_sums)
        self.window = Window(accumulate_steps, steps_per_epoch or 0, _NAME)
        self.hyper_map = ops.HyperMap()
        self.clip = max_grad_norm is not None
        self.max_grad_norm = max_grad_norm
        self.compile_checks = CompileChecks(self)
        object.__setattr__(self, "_kept_state", [])
        if self.state_under_optimizer:
            optimizer.insert_child_to_cell("grad_accumulation_state", StateUnderOptimizer(self.state()))
        self.bind(None)
        expect_compile(self)

    def state(self) -> list:
        """The Parameters of the window's state: its buffers, the window (``accu_state.*``), the loss scale, and what a
        subclass keeps with :meth:`keep_state`."""
        statistics = self.engine.statistics.state_parameters() if self.engine.combines_statistics else []
        return list(self.grad_sums) + self.window.state_parameters() + \
            ([self.scale_sense] if self.loss_scaled else []) + statistics + list(self._kept_state)

    def keep_state(self, name: str, parameter: Parameter) -> None:
        """For subclasses: keeps `parameter` (state of a hook, e.g. the last global norm) as the attribute `name`, in
        checkpoints and in :meth:`state` (so under the optimizer too, with ``state_under_optimizer``)."""
        setattr(self, name, parameter)
        self._kept_state.append(parameter)
        if self.state_under_optimizer:
            self.optimizer.grad_accumulation_state.insert_param_to_cell(parameter.name, parameter,
                                                                        check_name_contain_dot=False)

    # --- hooks --------------------------------------------------------------------------------------------------

    def transform_gradients(self, grads):
        """Hook, once per optimizer step (in the graph): the window's mean gradient `grads` (one float32-or-weight-dtype
        Tensor per weight, reduced across devices, finite unless the step is skipped anyway) to ``(gradients for the
        optimizer, step)``, `step` being ``True`` or a bool scalar Tensor (``False`` skips this step, e.g. a spike in
        the norm). Default: clipped to the global norm `max_grad_norm` when it is set. A subclass that overrides it
        also sets :attr:`changes_gradients` when its transform may leave the gradients as they are."""
        if self.clip:
            return ops.clip_by_global_norm(grads, self.max_grad_norm), True
        return grads, True

    @compile_time
    def changes_gradients(self) -> bool:
        """Whether :meth:`transform_gradients` changes the gradients (read when the graph compiles). When it does not,
        the optimizer reads the buffers themselves, which saves a copy of the gradient under data parallel. Default:
        `max_grad_norm` is set, or a subclass overrides the hook."""
        return self.clip or type(self).transform_gradients is not AccumulatingTrainOneStepCell.transform_gradients

    def after_optimizer_step(self, stepped):
        """Hook, after each optimizer step that ran (in the graph): work on the updated weights, e.g. an EMA. Returns
        `stepped` (a scalar that exists once the step is done) made to depend on that work. Default: nothing."""
        return stepped

    # --- binding (cells.binding) --------------------------------------------------------------------------------------

    def _bind(self, found: Surroundings) -> None:
        """The data-parallel parts (the weights and buffers are the optimizer's, from construction)."""
        self.bind_data_parallel()

    #: Whether ``Model`` trains the cell: Model sets ``phase`` on the network it trains (mindspore/train/model.py,
    #: ``_exec_preprocess``; checked 2.7.0-2.10.0), which a loop of one's own does not.
    trained_by_model = False

    # Cell.phase, noting who sets it; read on every call without running the package's Python.
    phase = phase_noting("trained_by_model")

    def check_at_compile(self) -> None:
        """What is checked when the graph compiles (and at every call in PyNative mode): see
        _mindspore.graph.CompileChecks. It compares what is in force with what is bound (cells.binding), and changes
        nothing."""
        self.compiled_elsewhere()
        self.check_data_parallel(_NAME)
        if parallel_pass_in_force():
            raise RuntimeError(
                f"For '{_NAME}', semi-auto/auto parallel is not supported: there MindSpore's parallel pass does the "
                f"accumulation and shards its buffers. Train Model(GradAccumulationCell(loss_net, micro_size), "
                f"optimizer=...) instead (under set_auto_parallel_context or AutoParallel).")
        # Another optimizer around it: found in the tree of the root being compiled, or in PyNative mode (nothing around
        # is known there) told by the gradient a train cell around it takes of it (its set_grad).
        differentiated = self.surroundings.optimizer is not None or (self.calling_eagerly and self.requires_grad)
        if differentiated:
            raise ValueError(
                f"For '{_NAME}', the cell is a train cell with its own optimizer, but it is wrapped in another cell "
                f"that holds an optimizer too (Model(cell, optimizer=...) builds one), which would apply a second, "
                f"zero update. Train it as Model({_NAME}(...)) without optimizer=, or call it directly.")
        self.loss_scale.check()
        self.window.warn_if_left_open(type(self).__name__, self.trained_by_model)

    def _targets(self) -> tuple:
        """``(weights, buffers)``: the optimizer's parameters, as for nn.TrainOneStepCell, and their buffers."""
        return self.weights, self.grad_sums

    def construct(self, *inputs):
        loss, overflow, scale = self.accumulate(*inputs)
        if self.loss_scaled:
            return loss, overflow, scale
        return ops.depend(loss, overflow)

    def accumulate(self, *inputs):
        """One call's work, in the graph: ``(the batch's loss, whether the window this call closed overflowed, the loss
        scale)``. :meth:`construct` returns them; a subclass whose trainer reads other outputs overrides ``construct``
        and calls this."""
        run_compile_checks(self.compile_checks)
        scale, (split, shared, constants, layout), unit = self.batch_prologue(inputs)
        unit = self.window.unit(unit)   # the window's: its first batch's
        result = self.engine(split, shared, constants, layout, scale, unit, "")
        value = self.contract(split, (shared, constants, layout), field(result, "first_two_value"),
                              field(result, "first_two_count"), unit, field(result, "value"))
        count, loss_like = field(result, "count"), field(result, "loss_like")
        # What is returned per call: the batch's loss, normalised as its kind says.
        rows = Tensor(split[0].shape[0], mstype.float32)
        batch_loss = self.kind.normalise(scale, value, count, 1.0, rows, unit)[0]
        batch_loss = self.window.record(batch_loss, value, count, rows)
        overflow = Tensor(False, mstype.bool_)
        if self.window.closes():
            overflow = self._apply_window(scale)
        batch_loss = ops.reshape(batch_loss, loss_like.shape)   # the network's loss shape: () or (1,)
        return batch_loss, overflow, ops.depend(self.loss_scale(), overflow)

    def _apply_window(self, scale):
        """Optimizer step with the window's mean gradient, reduced across devices once; then reset.

        Returns whether the window overflowed (its step skipped). The buffers are divided once, in float32, by
        ``core.buffers.divisor`` (the loss scale times the window's count, counted on every device for token losses),
        after the all-reduce when it is done in place; overflow is judged on that reduced gradient, so every device
        decides the same; the scale is updated once; clipping and the optimizer run only on a finite gradient. A
        window without a single counted token updates nothing and leaves the scale alone.
        """
        window = self.window
        value, count, factor = window.loss_sum, window.count, 1.0
        if self.data_parallel:
            value, count, factor = self.token_totals(value, count)
        empty = self.kind.empty(count)
        window_loss, divisor = self.kind.normalise(scale, value, count, factor, window.rows, window.count_unit * 1.0)
        if self.reduce_in_place:
            # Summed across devices in the buffers, one after another, then divided in place (times the device count
            # when the reducer averages): no gradient-sized tensor per weight.
            after = self.in_place_reducer(self.grad_sums, divisor)
            mean = _buffers.divide_in_place(self.grad_sums, ops.depend(divisor, after) * self.in_place_reducer.devices)
        else:
            mean = self.grad_reducer(_buffers.divide_in_place(self.grad_sums, divisor))
        # The step depends on the quotients: MindSpore drops in-place kernels whose outputs nothing reads.
        overflow = ops.depend(Tensor(False, mstype.bool_), mean)
        if self.loss_scaled:
            overflow = ops.logical_not(all_finite(self.hyper_map, mean))
            if self.loss_scaling_manager is not None:
                if not empty:
                    overflow = self.loss_scaling_manager(self.scale_sense, overflow)
        skip = ops.logical_or(overflow, empty) if self.skips_overflow else empty
        stepped = ops.zeros((), mstype.int32)
        if not skip:
            stepped = ops.depend(stepped, self._step(mean))
        # A scalar that exists only once the optimizer has run (or was skipped): the resets depend on it.
        done = ops.depend(ops.zeros((), mstype.int32), stepped)
        done = ops.depend(done, _buffers.zero_buffers(self.grad_sums, done))
        if self.engine.combines_statistics:   # the window's BatchNorm statistics, once (core.batch_norm)
            done = self.engine.statistics.apply(done)
        return ops.depend(overflow, window.reset(done, window_loss))

    def _step(self, mean):
        """The hooks and the optimizer, on the window's mean gradient (the buffers, divided in place)."""
        stepped = ops.zeros((), mstype.int32)
        if not self.changes_gradients:
            # The optimizer reads the buffers themselves, each right before its update, where that saves memory.
            # Handing it `mean` would read them all at one point before the first update, and MindSpore copies every
            # read of a Parameter that is read more than once in a graph (TensorMove; under data parallel the
            # all-reduce reads them too): all the copies alive at once (docs/measurements.md).
            read_in_place = self.reduce_in_place and self.buffers_match_weights
            grads = self.grad_sums if read_in_place else _buffers.cast_like(mean, self.weights)
            return self.after_optimizer_step(ops.depend(stepped, self.optimizer(grads)))
        grads, step = self.transform_gradients(mean)
        if step:
            stepped = ops.depend(stepped, self.optimizer(_buffers.cast_like(grads, self.weights)))
            stepped = self.after_optimizer_step(stepped)
        return stepped

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
        return self.window.pending_batches

    @property
    def accumulate_steps(self) -> int:
        """Batches per optimizer step (:meth:`set_accumulate_steps` changes it)."""
        return self.window.accumulate_steps

    @property
    def last_window_loss(self) -> float:
        """Mean loss over the rows (or tokens) of the last completed window (NaN before the first optimizer step)."""
        return self.window.last_window_loss

    def set_accumulate_steps(self, accumulate_steps: int) -> None:
        """Change the window length between calls; takes effect from the next call, without recompiling."""
        self.window.set_accumulate_steps(accumulate_steps)

    def set_steps_per_epoch(self, steps_per_epoch: int) -> None:
        """Declare the epoch length, so the last window of each epoch is closed at its last batch."""
        self.window.set_steps_per_epoch(steps_per_epoch)


def _loss_network(network: nn.Cell, given: dict) -> tuple:
    """``(loss network, LossSpec)``: a GradAccumulationCell is taken apart into what it holds (the same as passing its
    arguments here); anything contradicting it, or a nested one, is an error."""
    if isinstance(network, GradAccumulationCell):
        spec = _merged(network.spec, given)
        if network.explicit_loss_scale:
            raise ValueError(
                f"For '{_NAME}', the GradAccumulationCell given as 'network' has its own loss_scale, which this cell "
                f"does not use (it scales every micro-batch by its own scale_sense). Build the GradAccumulationCell "
                f"without loss_scale and pass the scale as scale_sense=... here.")
        return network.network, spec
    spec = LossSpec.of(_NAME, **given)
    for name, cell in network.cells_and_names():
        if isinstance(cell, GradAccumulationCell):
            raise ValueError(
                f"For '{_NAME}', a GradAccumulationCell must be the 'network' itself, but it is nested in "
                f"{type(network).__name__} as '{name}'. Wrap the loss network in GradAccumulationCell last, or "
                f"pass micro_size here: {_NAME}(loss_net, optimizer, accumulate_steps, micro_size=...).")
    return network, spec


def _batch_norm_of(network: nn.Cell, given: Optional[str]) -> Optional[str]:
    """The BatchNorm choice: `given`, or that of the GradAccumulationCell given as 'network'; both given must agree."""
    if not isinstance(network, GradAccumulationCell) or not network.batch_norm_given:
        return given
    if given is not None and given != network.batch_norm:
        raise ValueError(
            f"For '{_NAME}', the argument 'batch_norm' is {given!r} but the GradAccumulationCell given as 'network' "
            f"has batch_norm={network.batch_norm!r}. Give it once: either {_NAME}(loss_net, optimizer, "
            f"accumulate_steps, batch_norm=...) or the GradAccumulationCell's.")
    return network.batch_norm


def _merged(spec: LossSpec, given: dict) -> LossSpec:
    """The spec of the GradAccumulationCell given as 'network', with the arguments `given` here as well: each given one
    must agree with it (``check_loss`` is taken as given)."""
    changes = {}
    for name, value in given.items():
        if value is None:
            continue
        context = {"per_token_loss": spec.per_token_loss} if name == "min_count" else {}
        checked = getattr(LossSpec.of(_NAME, **context, **{name: value}), name)
        if name == "check_loss":
            changes[name] = checked
        elif checked != getattr(spec, name):
            raise ValueError(
                f"For '{_NAME}', the argument '{name}' is {value!r} but the GradAccumulationCell given as 'network' "
                f"has {name}={getattr(spec, name)!r}. Give it once: either {_NAME}(loss_net, optimizer, "
                f"accumulate_steps, {name}=...) or the GradAccumulationCell's.")
    if declares_kind(**given):
        changes["declared"] = True
        if spec.kind.counts_in_network and given.get("kind") is None:
            changes["kind"] = RowMean()   # declared a row mean here: the recognised cells are no longer counted
    return dataclasses.replace(spec, **changes)
