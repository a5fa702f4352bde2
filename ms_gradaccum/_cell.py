"""GradAccumulationCell: validate, wire the parts, ``construct`` (the hand-over to the wrapping train cell)."""
from typing import Optional

import mindspore as ms
from mindspore import nn, ops, ParameterTuple, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum import _buffers, _loss_scale
from ms_gradaccum._buffers import GradientBuffers
from ms_gradaccum._contract import prepared_for
from ms_gradaccum._engine import MicroBatchGradients
from ms_gradaccum._mindspore.graph import (CompileChecks, compile_time, compiling_graph, primexpr,
                                           run_compile_checks)
from ms_gradaccum._mindspore.patches import AUTODIFF_ZEROS_LIKE, ZEROS_LIKE, bprops_calling_zeros_like
from ms_gradaccum._mindspore.routing import PARALLEL_PASS_MODES, ROUTED_NAMES, TrainGradAccuStepCell, parallel_mode
from ms_gradaccum._mindspore.surroundings import discover
from ms_gradaccum._parallel import ParallelPassAccumulation, check_parallel_pass_arguments
from ms_gradaccum._loss_scale import PrecisionNeutral
from ms_gradaccum._reduce import ReplicaCheck, TokenTotals, check_data_parallel_ready
from ms_gradaccum._tokens import LabelWatch, warn_token_mean
from ms_gradaccum._validation import (check_bool, check_cell, check_has_parameters, check_input_indices,
                                      check_min_count, check_positive_int, check_reduction, check_weights,
                                      no_trained_weights_error, warn_batch_norm)

_UNROUTED_NAME = "MicroBatchGradAccumulationCell"
_NAME = "GradAccumulationCell"


@primexpr
def _count_unit(batch: int, micro_size: int) -> float:
    return float(_buffers.count_unit(batch, micro_size))


def check_loss_inside(cell: nn.Cell) -> None:
    """Refuse a cell whose output another cell turns into the loss (``Model(cell, loss_fn=...)`` builds one): it is
    given only the data, so it cannot split the labels with it, and would accumulate the gradient of its output."""
    wrapper = discover(cell).loss_wrapper
    if wrapper is not None:
        raise ValueError(
            f"For '{_NAME}', the loss must be computed inside the cell, but it is the backbone of "
            f"{type(wrapper).__name__}, which computes the loss of its output (Model(GradAccumulationCell(network, "
            f"micro_size), loss_fn=..., optimizer=...) builds one around it). The cell would receive the data without "
            f"its labels. Put the loss inside: Model(GradAccumulationCell(nn.WithLossCell(network, loss_fn), "
            f"micro_size), optimizer=...).")


def check_bprops(network: nn.Cell, micro_size: int) -> None:
    """When a graph compiles: give autodiff a zeros_like of its own, so that custom bprops calling
    ``mindspore.ops.zeros_like`` (MindFormers' loss cells) compile inside this cell's nested gradient (see
    _mindspore.patches); where MindSpore is laid out otherwise, refuse a network with such a bprop, naming the cells."""
    if AUTODIFF_ZEROS_LIKE.install():
        return
    cells = bprops_calling_zeros_like(network)
    if cells:
        raise RuntimeError(
            f"For '{_NAME}', the argument 'network' holds cells whose bprop calls mindspore.ops.zeros_like: "
            f"{', '.join(cells)}. In a compiled graph this MindSpore ({ms.__version__}, laid out otherwise than the "
            f"versions checked) cannot compile that bprop inside a gradient that is itself differentiated (\"The "
            f"func graph is empty ... zeros_like\"), which is how "
            f"{_NAME} hands its gradient to the train cell around it. Either train with AccumulatingTrainOneStepCell("
            f"loss_net, optimizer, 1, micro_size={micro_size}) (the same update; under Model without optimizer=), or "
            f"in PYNATIVE_MODE without ms.jit, or return ops.ZerosLike()(x) instead of ops.zeros_like(x) in that "
            f"bprop.")


def validate_arguments(network, micro_size, per_token_loss, shared_inputs, reduction, min_count) -> tuple:
    """The checks run before assigning anything: ``(micro_size, per_token_loss, shared_inputs, reduction,
    min_count)``."""
    check_cell(network, "network", _NAME)
    micro_size = check_positive_int(micro_size, "micro_size", _NAME)
    per_token_loss = False if per_token_loss is None else check_bool(per_token_loss, "per_token_loss", _NAME)
    shared_inputs = check_input_indices(shared_inputs, "shared_inputs", _NAME)
    reduction = check_reduction(reduction, _NAME)
    min_count = check_min_count(min_count, per_token_loss, _NAME)
    check_has_parameters(network, "network", _NAME)
    return micro_size, per_token_loss, shared_inputs, reduction, min_count


def loss_rows(per_token_loss: bool, sum_over_rows: bool, count, unit, rows):
    """The `rows` factor of ``_buffers.normalise``: 1 for a mean or a token mean; for a loss that sums its rows, the
    rows: ``count * unit`` (a row loss counts its rows in units of `unit`) or `rows` (a token loss)."""
    if not sum_over_rows:
        return Tensor(1.0, mstype.float32)
    if per_token_loss:
        if isinstance(rows, int):
            return Tensor(rows, mstype.float32)
        # A Tensor (a Parameter: AccumulatingTrainOneStepCell's window rows): read, not wrapped in a new Tensor, which
        # MindSpore 2.7.0 ran into an Assign without a device address ("input_data does not have a valid ptr").
        return ops.cast(rows, mstype.float32) * 1.0
    return count * unit


class GradAccumulationCell(PrecisionNeutral):
    r"""
    Gradient accumulation over micro-batches that trains in every mode, including under ``mindspore.Model``.

    Unlike :class:`mindspore.nn.GradAccumulationCell`, which under ``Model`` trains only in semi-auto/auto parallel
    (MindSpore's parallel pass accumulates; on one process too, with ``AutoParallel(...).hsdp()``'s parallel
    optimizer) and in stand-alone or data-parallel mode silently trains nothing (``Model`` routes it into a wrapper
    whose optimizer reads buffers nobody writes), this cell computes the accumulated gradient itself: each batch is split along axis 0
    into ``micro_size`` micro-batches inside the compiled graph; each runs forward and backward once, in turn;
    their gradients are summed, and the wrapping ``nn.TrainOneStepCell`` (built by you or by ``Model``) sees
    exactly the mean gradient, so the optimizer steps once per batch with the full-batch update.

    Which weights: `weights` when given (nothing is then inferred). Otherwise found when the graph compiles: those
    the wrapping train cell differentiates (its optimizer's parameters); without a train cell around it, the
    ``weights`` given to ``mindspore.value_and_grad``/``grad`` (also inside an ``ms.jit`` train step that uses grad
    functions by name); else those with ``requires_grad=True``, so freezing or unfreezing after the cell is built is
    followed. A grad function reached in another way (an object's attribute) is not found: pass `weights` there.
    Only those weights get a buffer.

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
    so float16 gradients do not underflow; the sums are kept in float32 and unscaled once, in float32,
    before the wrapping cell's ``sens`` multiplies them back and the optimizer divides it out (no double
    scaling). The scale is `loss_scale` when given, else the fixed ``sens`` of the MindSpore train cell that
    wraps this one (``nn.TrainOneStepCell(..., sens=S)``, which ``Model`` builds for
    ``FixedLossScaleManager(S, drop_overflow_update=False)``), read when the graph is compiled. A network that
    computes in float16 with no scale at all gets a ``UserWarning`` when the graph compiles. For a scale that
    changes while training, and to skip overflowing steps on CPU, use :class:`AccumulatingTrainOneStepCell` with
    ``micro_size`` and ``scale_sense``.

    Under ``SEMI_AUTO_PARALLEL`` and ``AUTO_PARALLEL`` (Ascend/GPU) the cell instead presents itself to
    MindSpore's own parallel pipeline: it wraps :class:`mindspore.parallel.nn.GradAccumulation` (which marks
    the micro-batch slices and the end of each micro-batch's forward), ``Model`` routes it into MindSpore's
    accumulating train cell, and the parallel pass accumulates into ``accu_grads`` buffers that the parallel
    optimizer shards. The output is still the mean loss. The parallel mode in force when ``Model`` builds its
    train cell and when the graph compiles (``set_auto_parallel_context`` or ``AutoParallel``) decides which mechanism
    it uses.

    Under data parallel, the first step checks that every rank starts from the same weights (one small
    all-gather) and stops with the name of the first differing parameter if not.

    Equivalence with full-batch training holds when the loss is a mean over the batch and the network treats
    samples independently, or, with ``per_token_loss=True``, when `network` returns ``(loss_sum, count)`` (e.g. a
    masked token loss and the number of valid tokens): then the gradient is that of ``sum(loss_sum) / sum(count)``
    over the whole batch (and over all devices under data parallel, the count being summed once per step). It does
    not hold for BatchNorm (statistics are per micro-batch, and moving averages are updated ``micro_size`` times
    per step; a ``UserWarning`` at construction names such cells) or dropout (different random masks).

    Args:
        network (Cell): A cell returning a single-element loss (shape ``()`` or ``(1,)``, any float dtype), e.g.
            ``nn.WithLossCell(net, loss_fn)`` or a MindFormers model given its labels, or any loss
            cell taking one or more tensor inputs (data, label, sample weight, ...). Every input is split along
            axis 0. Only the loss is carried through: a network returning a tuple is refused unless
            `per_token_loss` says it is ``(loss_sum, count)``.
        micro_size (int): The NUMBER of micro-batches each batch is split into (not the size of one; the name
            is MindSpore's). Any batch size works: a batch not divisible by it is split as evenly as possible
            (sizes differing by at most one row) and each micro-batch is weighted by its rows.
        loss_scale (Union[None, float, Tensor, Parameter]): The loss scale of the micro-batch backward passes.
            ``None``: that of the train cell wrapping this one (1.0 if none). A number or scalar Tensor: fixed.
            A Parameter is read live at every step, e.g. ``mindspore.amp.DynamicLossScaler(...).scale_value`` in
            a functional training step. Default: ``None``.
        per_token_loss (bool, optional): Whether `network` returns ``(loss_sum, count)``, two single-element Tensors
            (for a loss cell that returns a mean over valid tokens, :func:`token_sum_loss` makes it so): the gradient
            is then divided by the count of the whole batch. A batch whose total count is 0 hands over a zero
            gradient and returns loss 0 (under ``nn.TrainOneStepCell`` the optimizer still steps on that zero
            gradient; :class:`AccumulatingTrainOneStepCell` skips such a step exactly). ``None`` means ``False``, and
            a loss that averages over valid tokens gets a ``UserWarning`` where the update can differ: at
            construction for class weights and MindFormers' ``CrossEntropyLoss``; on the first step for
            ``nn.CrossEntropyLoss``/``nn.NLLLoss`` when the batch holds labels equal to ``ignore_index`` or the
            loss gets several labels per row (one label per row, none ignored, is a row mean: nothing is said).
            Pass ``False`` to declare that every row holds the same number of valid tokens. Default: ``None``.
        shared_inputs (Union[int, tuple[int]]): Indices of the inputs that every micro-batch receives whole instead of
            split, e.g. position ids of shape ``(1, T)`` shared by the batch. None, Python numbers and 0-d Tensors
            are always passed whole. Not supported under semi-auto/auto parallel. Default: ``()``.
        weights (Union[None, list[Parameter], tuple[Parameter]]): The weights whose gradients are accumulated, e.g.
            ``optimizer.parameters`` (as optax's ``MultiSteps`` takes the params): each a Parameter of `network`,
            once. Under a train cell whose optimizer updates a weight of the network not in `weights`, the graph
            refuses to compile. Default: ``None``: found when the graph compiles (see above).

    Inputs:
        - **\*inputs** (Tensor) - The inputs of `network`. Tensors are split along axis 0 (all with the same batch
          size :math:`B`) unless declared in `shared_inputs` or 0-d; None and Python numbers reach every micro-batch.

    Outputs:
        Tensor, float32, of the network's loss shape (``()`` or ``(1,)``): the full-batch loss, i.e. the row-weighted
        mean of the micro-batch losses, or ``sum(loss_sum) / sum(count)`` with `per_token_loss`. ``LossMonitor``
        prints this number.

    Raises:
        TypeError: If `network` is not a Cell, `micro_size` is not an int (bool included), `per_token_loss` is not
            a bool, `loss_scale` is not None, a number or a scalar Tensor, or `weights` is not None or a list/tuple of
            Parameters.
        ValueError: If `micro_size` < 1, `loss_scale` is not positive and finite, `network` has no parameter, or
            `weights` is empty, names a Parameter twice or one `network` does not hold.
        ValueError: At graph compile time, if no weight of `network` is trained, the wrapping train cell changes
            its loss scale while training (``nn.TrainOneStepWithLossScaleCell`` with a
            ``DynamicLossScaleUpdateCell``; the message gives the fix), an input has no batch axis or an empty one,
            the inputs' batch sizes differ, or `network` does not return what `per_token_loss` says.
        ValueError: At run time, with `per_token_loss`, if a count is negative or not finite; under data parallel,
            if the ranks start from different weights.
        RuntimeError: At graph compile time, under data parallel without ``mindspore.communication.init()``.

    Supported Platforms:
        ``CPU`` ``GPU``: CPU stand-alone and data parallel in CI; GPU once on one H100 (stand-alone, data parallel over
        NCCL, semi-auto parallel with the parallel optimizer on one rank). Ascend, and semi-auto parallel on several
        cards, were not run (``bash run.sh N --check`` there first).

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

    def __init__(self, network: nn.Cell, micro_size: int, loss_scale=None, per_token_loss: Optional[bool] = None,
                 shared_inputs: tuple = (), reduction: str = "mean", min_count: float = 0.0, check_loss: bool = True,
                 weights=None):
        declared = per_token_loss is not None or reduction != "mean"
        micro_size, per_token_loss, shared_inputs, reduction, min_count = validate_arguments(
            network, micro_size, per_token_loss, shared_inputs, reduction, min_count)
        check_loss = check_bool(check_loss, "check_loss", _NAME)
        weights = check_weights(weights, network, _NAME)
        scale = _loss_scale.for_grad_accumulation_cell(loss_scale, self, network, _NAME)
        if parallel_mode() in PARALLEL_PASS_MODES:
            check_parallel_pass_arguments(loss_scale is not None, per_token_loss, shared_inputs, reduction)
        if micro_size > 1:
            warn_batch_norm(network, _NAME, f"micro_size={micro_size} micro-batches")
            if not declared:
                warn_token_mean(network, _NAME)
        super().__init__(auto_prefix=False)
        self.network = network
        self.micro_size = micro_size
        self.per_token_loss = per_token_loss
        self.declared_per_token_loss = declared
        self.reduction = reduction
        self.min_count = min_count
        self.check_loss = check_loss
        self.shared_inputs = shared_inputs
        self.explicit_loss_scale = loss_scale is not None
        self.loss_scale = scale
        object.__setattr__(self, "_explicit_weights", weights)   # a plain tuple: the weights stay the network's
        self.gradient_buffers = GradientBuffers()
        if parallel_mode() not in PARALLEL_PASS_MODES:
            # The buffers of the weights trained as of now; each compile adjusts them to what it trains (_resolve).
            self.gradient_buffers.for_weights(list(weights) if weights is not None else network.trainable_params())
        self.engine = MicroBatchGradients(network, micro_size, per_token_loss, overwrite=True,
                                          targets=self._targets, cls_name=_NAME, shared_inputs=shared_inputs,
                                          sum_over_rows=reduction == "sum", check_loss=check_loss,
                                          labels=LabelWatch(network, _NAME, declared or micro_size == 1))
        self.token_totals = TokenTotals(per_token_loss, _NAME)
        self.replicas = ReplicaCheck(self._targets, _NAME)
        self.gradient_of = GradientOf()
        self.hyper_map = ops.HyperMap()
        # Both mechanisms exist from the start; the parallel mode in force when Model builds its train cell and when
        # the graph compiles (AutoParallel sets it only then) picks one: see parallel_pass.
        self.parallel_pass_part = ParallelPassAccumulation(network, micro_size)
        self.compile_checks = CompileChecks(self)

    def check_at_compile(self) -> None:
        """What is checked when the graph compiles (and at every call in PyNative mode): see
        _mindspore.graph.CompileChecks."""
        check_data_parallel_ready(_NAME)
        check_loss_inside(self)
        wrapper = discover(self).train_cell
        if self.parallel_pass:
            check_parallel_pass_arguments(self.explicit_loss_scale, self.per_token_loss, self.shared_inputs,
                                          self.reduction)
            # _TrainGradAccuStepCell makes accu_grads.<weight> buffers of its own: ours (from an earlier stand-alone
            # graph) would clash by name, and are not used here.
            self.gradient_buffers.for_weights([])
            return
        if isinstance(wrapper, TrainGradAccuStepCell):
            raise RuntimeError(
                f"For '{_NAME}', the train cell around it is MindSpore's _TrainGradAccuStepCell, which Model builds "
                f"for semi-auto/auto parallel, but the graph compiles in {parallel_mode()} mode, where nothing would "
                f"fill its buffers (it would train nothing). Keep the same parallel mode (or AutoParallel) for "
                f"Model(...) and model.train(...).")
        if not self._trained_weights():
            raise no_trained_weights_error(_NAME, self.network)
        if self._explicit_weights is not None:
            self._check_explicit_weights()
        if compiling_graph():
            check_bprops(self.network, self.micro_size)
        self._resolve()
        self.loss_scale.check()

    @property
    def cls_name(self) -> str:
        # mindspore.train.amp._is_grad_accumulation reads cls_name when Model builds its train cell (_mindspore.routing):
        # a routed name gets MindSpore's _TrainGradAccuStepCell, which only the semi-auto/auto-parallel pass feeds.
        # So the routed name only in those modes (in force then, whether set globally or by AutoParallel).
        if self.parallel_pass:
            return "GradAccumulationCell"
        name = type(self).__name__
        return _UNROUTED_NAME if name in ROUTED_NAMES else name

    @compile_time
    def parallel_pass(self) -> bool:
        """Whether MindSpore's semi-auto/auto-parallel pass does the accumulation: read when ``Model`` builds its train
        cell and when the graph compiles, so it follows ``set_auto_parallel_context`` and ``AutoParallel`` alike."""
        return parallel_mode() in PARALLEL_PASS_MODES

    def _check_explicit_weights(self) -> None:
        """Refuses `weights` that leave out a weight of the network the wrapping optimizer updates: it would be handed
        a zero gradient (and still be moved by momentum or weight decay)."""
        optimizer = discover(self).optimizer
        if optimizer is None:
            return
        given = {id(weight) for weight in self._explicit_weights}
        owned = {id(param) for param in self.network.get_parameters()}
        left_out = [param.name for param in optimizer.parameters if id(param) in owned and id(param) not in given]
        if left_out:
            raise ValueError(
                f"For '{_NAME}', the argument 'weights' must hold every weight of the network that the wrapping "
                f"optimizer updates, but it leaves out {', '.join(left_out[:5])}{', ...' if len(left_out) > 5 else ''}"
                f" ({len(left_out)} in all), which would get a zero gradient. Pass weights=optimizer.parameters, or "
                f"build the optimizer over the weights you pass.")

    def _trained_weights(self) -> list:
        """`weights` when given. Otherwise the weights the wrapping train cell differentiates (its optimizer's);
        without one, the ``weights`` of the ``mindspore.value_and_grad``/``grad`` call differentiating this cell; else
        those with ``requires_grad=True``."""
        if self._explicit_weights is not None:
            return list(self._explicit_weights)
        surroundings = discover(self)
        optimizer = surroundings.optimizer
        differentiated = optimizer.parameters if optimizer is not None else surroundings.differentiated
        if differentiated is None:
            return self.network.trainable_params()
        trained = {id(weight) for weight in differentiated}
        return [param for param in self.network.get_parameters() if id(param) in trained]

    def _resolve(self) -> None:
        """Resolves the trained weights and their buffers (created when first needed, dropped when unused) from this
        cell's own graph, where the wrapping train cell is visible, once per compile (check_at_compile, the first
        thing the graph does; every call in PyNative mode). The attributes below and the engine, whose graph is
        compiled apart, only read the result: reading them creates and deletes nothing."""
        weights = self._trained_weights() or list(self.network.get_parameters())
        resolved = (ParameterTuple(weights), self.gradient_buffers.for_weights(weights))
        object.__setattr__(self, "_resolved", resolved)   # not a Cell attribute: nothing is registered

    def _targets(self) -> tuple:
        """``(weights, buffers)`` as last resolved; before the first compile, the weights that would be trained and
        the buffers that exist (none)."""
        resolved = self.__dict__.get("_resolved")
        if resolved is None:
            return (ParameterTuple(self._trained_weights()),
                    ParameterTuple(list(self.gradient_buffers.get_parameters())))
        return resolved

    @compile_time
    def weights(self) -> ParameterTuple:
        """The weights whose gradients this cell accumulates (as resolved when the graph last compiled)."""
        return self._targets()[0]

    @compile_time
    def accu_grads(self) -> ParameterTuple:
        """Their ``accu_grads.<weight>`` buffers."""
        return self._targets()[1]

    @compile_time
    def targets_key(self) -> str:
        # Names the weights for the engine's compile cache, so PyNative mode compiles again when they change.
        return ",".join(f"{weight.name}#{id(weight)}" for weight in self._targets()[0])

    def __call__(self, *args, **kwargs):
        if ms.get_context("mode") == ms.PYNATIVE_MODE:
            # The loss contract's eager pass on the batch (in graph mode, where the graph compiles: _contract).
            with prepared_for(self, args):
                return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def construct(self, *inputs):
        run_compile_checks(self.compile_checks)
        if self.parallel_pass:
            return self.parallel_pass_part(*inputs)
        # Under data parallel, the first step first checks that every rank holds the same weights.
        scale = self.replicas(self.loss_scale())
        split, shared, constants, layout = self.engine.split_inputs(inputs)
        unit = Tensor(_count_unit(split[0].shape[0], self.micro_size), mstype.float32)
        value, count, loss_like = self.engine(split, shared, constants, layout, scale, unit, self.targets_key)
        value, count, factor = self.token_totals(value, count)
        rows = loss_rows(self.per_token_loss, self.reduction == "sum", count, unit, split[0].shape[0])
        loss, divisor = _buffers.normalise(scale, value, count, factor, self.min_count, rows)
        # The hand-over reads the buffers: this data dependency orders it after the micro-batch loop (the loss
        # exists only once the loop is done). Behind stop_gradient (the engine's outputs carry no gradient), or
        # autodiff fails on networks with BatchNorm ("Operator 'k_hole' is invalid").
        loss = ops.stop_gradient(loss)
        divisor = ops.stop_gradient(ops.depend(divisor, loss))
        # Adds zero; its backward hands each weight its buffer, unscaled (in float32) and times the sens. One call per
        # weight through a HyperMap (see _buffers: a Python loop over the weights compiles far slower).
        zeros = self.hyper_map(ops.partial(_hand_over, self.gradient_of, divisor), self.weights[::-1],
                               self.accu_grads[::-1])
        loss = loss + ops.stack(zeros).sum()
        return ops.reshape(loss, loss_like.shape)   # the network's loss shape: () or (1,)


_hand_over = ops.MultitypeFuncGraph("_hand_over")


@_hand_over.register("Function", "Tensor", "Tensor", "Tensor")
def _hand_over_weight(gradient_of, divisor, weight, buffer):
    return gradient_of(weight, buffer, divisor)


class GradientOf(PrecisionNeutral):
    """Zero in the forward pass; in the backward pass, hands ``buffer * dout / divisor`` to `weight` as its gradient.

    This is how an unmodified ``nn.TrainOneStepCell`` (and so ``Model``) receives the accumulated gradient: the
    backward of this cell scales the buffer in place and returns the buffer itself, so no gradient-sized
    tensor is created after the loop (autodiff of ``sum(stop_gradient(g) * weight)`` would create one).
    ``dout`` is the wrapper's ``sens`` (its loss scale, or 1) and `divisor` the ``_buffers.divisor`` of the sums,
    so the wrapper gets exactly ``mean_gradient * sens``.
    """

    def construct(self, weight, buffer, divisor):
        # Depends on `weight`, or autodiff prunes this cell and `weight` gets no gradient from it.
        return ops.depend(ops.zeros((), mstype.float32), weight)

    def bprop(self, weight, buffer, divisor, out, dout):
        # In place where MindSpore does that (CPU kernel graph: Mul then Assign, weight by weight); an
        # ops.assign(buffer, buffer * f) would allocate a product per weight, all alive at once (measured: +27 MB
        # on four 1536-wide Dense layers). In PyNative mode it is an ordinary product, as correct.
        product = _buffers.multiply_in_place(buffer, dout, divisor)
        return ops.cast(product, weight.dtype), ZEROS_LIKE(buffer), ZEROS_LIKE(divisor)
