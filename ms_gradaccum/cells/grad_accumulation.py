"""GradAccumulationCell: validate, wire the parts, ``construct`` (the hand-over to the wrapping train cell)."""
from typing import Optional

import mindspore as ms
from mindspore import nn, ops, ParameterTuple, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.graph import CompileChecks, run_compile_checks
from ms_gradaccum._mindspore.patches import AUTODIFF_ZEROS_LIKE, ZEROS_LIKE
from ms_gradaccum._mindspore.surroundings import (ROUTED_NAMES, Surroundings, TrainGradAccuStepCell, child,
                                                  data_parallel_in_force, parallel_mode, parallel_pass_in_force,
                                                  set_child)
from ms_gradaccum.cells.binding import BoundCell
from ms_gradaccum.cells.compile_hook import expect_compile
from ms_gradaccum.core import buffers as _buffers
from ms_gradaccum.core import loss_scale as _loss_scale
from ms_gradaccum.core.base import PrecisionNeutral
from ms_gradaccum.core.batch_norm import DEFAULT as BATCH_NORM_DEFAULT
from ms_gradaccum.core.batch_norm import check_batch_norm, freeze, moving_statistics
from ms_gradaccum.core.buffers import GradientBuffers
from ms_gradaccum.core.engine import MicroBatchGradients, field, warn_where_inexact
from ms_gradaccum.core.kinds import LossKind, LossSpec, SpecFields
from ms_gradaccum.core.tokens import recognised
from ms_gradaccum.core.validation import (check_cell, check_has_parameters, check_positive_int, check_weights,
                                          foreign_optimizer_error, is_batch_statistic, no_trained_weights_error,
                                          weights_required_error)
from ms_gradaccum.diagnostics.contract import LossContract

_UNROUTED_NAME = "MicroBatchGradAccumulationCell"
_NAME = "GradAccumulationCell"


def _parallel_pass():
    """The semi-auto/auto-parallel hand-over (parallel.parallel_pass), imported in those modes only."""
    from ms_gradaccum.parallel import parallel_pass  # pylint: disable=import-outside-toplevel
    return parallel_pass


def child_once(owner: nn.Cell, name: str, build) -> nn.Cell:
    """`owner`'s child cell `name`, made by ``build()`` where it has none (when the cell is bound, never while a graph
    compiles)."""
    part = child(owner, name)
    if part is None:
        part = build()
        set_child(owner, name, part)
    return part


def data_parallel_module():
    """Data parallel's cross-rank parts (parallel.data_parallel), imported in that mode only: a stand-alone step never
    reads them."""
    from ms_gradaccum.parallel import data_parallel  # pylint: disable=import-outside-toplevel
    return data_parallel


class DataParallelParts:
    """Mixed into both cells: the start of a step (:meth:`batch_prologue`), and their parts under data parallel
    (parallel.data_parallel), built when the cell is bound in that mode: ``replicas``, the first step's check that every
    rank holds the same weights; ``token_totals``, the sums across ranks. ``data_parallel``: whether data parallel was
    in force when the cell was bound."""

    data_parallel = False

    def bind_data_parallel(self) -> None:
        """Whether data parallel is in force, and its parts where it is; only once communication is set up (before
        ``init()`` no collective can be built: the compile checks say so, and the compile that follows ``init()`` binds
        the parts)."""
        data_parallel = data_parallel_in_force() and data_parallel_module().communication_initialized()
        if data_parallel:
            child_once(self, "replicas", lambda: data_parallel_module().ReplicaCheck(self._targets,
                                                                                     self.engine.owner_name))
            child_once(self, "token_totals", lambda: data_parallel_module().TokenTotals(self.kind,
                                                                                        self.engine.owner_name))
        object.__setattr__(self, "data_parallel", data_parallel)

    def check_data_parallel(self, cls_name: str) -> None:
        """At compile: data parallel, where it is in force, is ready (``init()``), and the cell was bound for it."""
        if data_parallel_in_force():
            data_parallel_module().check_data_parallel_ready(cls_name)
        if data_parallel_in_force() != self.data_parallel:
            raise RuntimeError(
                f"For '{cls_name}', the graph compiles in {parallel_mode()} mode, but the cell was bound in "
                f"{'data_parallel' if self.data_parallel else 'another'} mode (the parallel mode changed between its "
                f"last binding and this compile, with no new train cell built around it). Call cell.rebind() after "
                f"setting the parallel mode.")

    def batch_prologue(self, inputs):
        """The start of a step in either cell, in the graph: ``(scale, (split, shared, constants, layout), unit)``: the
        loss scale (under data parallel, with the first step's check that every rank holds the same weights), the
        inputs as the engine lays them out, and the batch's count unit (its largest micro-batch: core.kinds)."""
        scale = self.loss_scale()
        if self.data_parallel:
            scale = self.replicas(scale)
        split, shared, constants, layout = self.engine.split_inputs(inputs)
        unit = Tensor(_buffers.unit_of(split[0].shape[0], self.micro_size), mstype.float32)
        return scale, (split, shared, constants, layout), unit


def check_loss_inside(found: Surroundings) -> None:
    """Refuses a cell whose output another cell turns into the loss (``Model(cell, loss_fn=...)``; `found`: its
    surroundings): it would get the data without its labels."""
    wrapper = found.loss_wrapper
    if wrapper is not None:
        raise ValueError(
            f"For '{_NAME}', the loss must be computed inside the cell, but it is the backbone of "
            f"{type(wrapper).__name__}, which computes the loss of its output (Model(GradAccumulationCell(network, "
            f"micro_size), loss_fn=..., optimizer=...) builds one around it). The cell would receive the data without "
            f"its labels. Put the loss inside: Model(GradAccumulationCell(nn.WithLossCell(network, loss_fn), "
            f"micro_size), optimizer=...).")


def check_bprops(network: nn.Cell, micro_size: int) -> None:
    """Where a cell of `network` has a bprop calling ``ops.zeros_like`` (MindFormers' loss cells), autodiff gets a
    zeros_like of its own, so that the bprop compiles in the nested gradient (_mindspore.patches; removed by
    ``ms_gradaccum.remove_patches()``); where it cannot, such a network is refused when a graph compiles. Nothing is
    patched for a network without such a bprop."""
    from ms_gradaccum._mindspore.bprops import bprops_calling_zeros_like   # pylint: disable=import-outside-toplevel
    cells = bprops_calling_zeros_like(network)
    if not cells or AUTODIFF_ZEROS_LIKE.install() or ms.get_context("mode") != ms.GRAPH_MODE:
        return
    raise RuntimeError(
        f"For '{_NAME}', the argument 'network' holds cells whose bprop calls mindspore.ops.zeros_like: "
        f"{', '.join(cells)}. In a compiled graph this MindSpore ({ms.__version__}, laid out otherwise than the "
        f"versions checked) cannot compile that bprop inside a gradient that is itself differentiated (\"The "
        f"func graph is empty ... zeros_like\"), which is how "
        f"{_NAME} hands its gradient to the train cell around it. Either train with AccumulatingTrainOneStepCell("
        f"loss_net, optimizer, 1, micro_size={micro_size}) (the same update; under Model without optimizer=), or "
        f"in PYNATIVE_MODE without ms.jit, or return ops.ZerosLike()(x) instead of ops.zeros_like(x) in that "
        f"bprop.")


class GradAccumulationCell(BoundCell, DataParallelParts, SpecFields, PrecisionNeutral):
    r"""
    Gradient accumulation over micro-batches that trains in every mode, including under ``mindspore.Model``.

    Each batch is split along axis 0 into `micro_size` micro-batches inside the compiled graph; each runs forward and
    backward in turn, its gradient is added in place into ``accu_grads.<weight>`` (a Parameter per trained weight), and
    the wrapping ``nn.TrainOneStepCell`` (yours, or the one ``Model`` builds) receives exactly the mean gradient of the
    batch: one optimizer step with the full-batch update. Unlike :class:`mindspore.nn.GradAccumulationCell`, it trains
    stand-alone and under data parallel; under semi-auto/auto parallel it hands the work to MindSpore's parallel pass.

    Contract: the full-batch update, exactly, when the loss is a mean over independent rows (or, with
    ``per_token_loss=True``, ``(loss_sum, count)``, or a sum with ``reduction='sum'``). A mean over valid labels that
    the cell recognises (``nn.CrossEntropyLoss``/``nn.NLLLoss`` with ``reduction='mean'``, MindFormers'
    ``CrossEntropyLoss``, and a loss of one's own found to be a mean over labels other than -100) is made exact
    whatever its labels, weighting each micro-batch by its count. The contract is decided from the loss's structure on
    the first call (``check_loss``), whatever the batch holds, and a micro-batch whose loss is not finite while others'
    are stops the step; either stops before any update, with the cause and the route. BatchNorm is warned about (its
    statistics are per micro-batch); random draws (dropout, noise) differ, equal in distribution, and are not. Which
    weights: `weights`, else those the wrapping train cell differentiates, else those with ``requires_grad=True``,
    bound before the graph compiles from the tree it compiles (PyNative mode: those with ``requires_grad=True``); after
    freezing or unfreezing weights between two trainings with no new train cell around it, call :meth:`rebind`.
    Details: ``docs/design.md``.

    Args:
        network (Cell): Returns a single-element loss (``()`` or ``(1,)``), e.g. ``nn.WithLossCell(net, loss_fn)``.
        micro_size (int): The NUMBER of micro-batches per batch; any batch size works (uneven splits are weighted).
        loss_scale (Union[None, float, Tensor, Parameter]): The micro-batches' loss scale. Default: that of the train
            cell around it (1.0 if none).
        per_token_loss (bool, optional): `network` returns ``(loss_sum, count)``. Default: ``None`` (``False``, and
            the token-mean losses the cell recognises are counted).
        shared_inputs (Union[int, tuple[int]]): Inputs every micro-batch receives whole. Default: ``()``.
        reduction (str, optional): ``'mean'`` or ``'sum'`` over the rows. Default: ``None`` (``'mean'``).
        min_count (float, optional): With `per_token_loss`, the floor of the batch's count. Default: ``None`` (0).
        check_loss (bool): Probe the loss's structure on the first call, eagerly (some rows' inputs changed, the
            gradient on others compared; every row's values where the network draws no random values): a loss that
            does not combine over micro-batches stops before any update. Where the batch cannot be reached, the graph
            compares the first step's values. Default: ``True``.
        weights (Union[None, list[Parameter], tuple[Parameter]]): The weights to accumulate, each of `network`, once.
        kind (LossKind, optional): The loss kind as an object (``ms_gradaccum.LossKind``: what a micro-batch tallies,
            how the sums are normalised), instead of `per_token_loss`, `reduction` and `min_count`; see
            ``docs/design.md``, "Loss kinds". Default: ``None``.
        batch_norm (str, optional): What the network's BatchNorm cells do in training (``docs/design.md``,
            "BatchNorm"): ``'per_step'``, each micro-batch normalised by its own statistics and the moving statistics
            updated once per optimizer step from all micro-batches combined (for the first BatchNorm layer exactly
            the full batch's); ``'frozen'``, normalised with their moving statistics, none updated (exact; sets
            ``use_batch_statistics=False`` on those cells, which ``None`` undoes); ``'micro'``, each micro-batch
            updating them. Default: ``None`` (``'per_step'``, with a warning where the network has BatchNorm).

    Outputs:
        Tensor, float32, of the network's loss shape: the full-batch loss (``LossMonitor`` prints it).

    Raises:
        TypeError, ValueError: On bad arguments (the message names the argument, the value and what is expected), and
            when the graph compiles, on inputs, outputs or surroundings it cannot train exactly.

    Examples:
        >>> import numpy as np
        >>> import mindspore as ms
        >>> from mindspore import nn
        >>> from ms_gradaccum import GradAccumulationCell
        >>> ms.set_context(mode=ms.GRAPH_MODE)
        >>> net = nn.Dense(4, 2)
        >>> loss_net = GradAccumulationCell(nn.WithLossCell(net, nn.MSELoss()), micro_size=4)
        >>> train_step = nn.TrainOneStepCell(loss_net, nn.SGD(net.trainable_params(), 0.1))
        >>> loss = train_step(ms.Tensor(np.ones((8, 4), np.float32)), ms.Tensor(np.zeros((8, 2), np.float32)))
        >>> loss.shape
        ()
    """

    def __init__(self, network: nn.Cell, micro_size: int, loss_scale=None, per_token_loss: Optional[bool] = None,
                 shared_inputs: tuple = (), reduction: Optional[str] = None, min_count: Optional[float] = None,
                 check_loss: bool = True, weights=None, kind: Optional[LossKind] = None,
                 batch_norm: Optional[str] = None):
        check_cell(network, "network", _NAME)
        batch_norm = check_batch_norm(batch_norm, _NAME)
        spec = LossSpec.of(_NAME, check_positive_int(micro_size, "micro_size", _NAME), per_token_loss, shared_inputs,
                           reduction, min_count, check_loss, kind)
        check_has_parameters(network, "network", _NAME)
        weights = check_weights(weights, network, _NAME)
        scale = _loss_scale.for_grad_accumulation_cell(loss_scale, network, _NAME)
        statistics = moving_statistics(network, batch_norm, _NAME, spec.micro_size > 1)
        if batch_norm == "frozen":
            freeze(network, _NAME)
        warn_where_inexact(network, _NAME, [f"micro_size={spec.micro_size} micro-batches"]
                           if spec.micro_size > 1 else [], batch_norm)
        spec = recognised(spec, network, spec.micro_size > 1)
        super().__init__(auto_prefix=False)
        self.network = network
        self.use_spec(spec)
        self.explicit_loss_scale = loss_scale is not None
        self.loss_scale = scale
        object.__setattr__(self, "_explicit_weights", weights)   # a plain tuple: the weights stay the network's
        self.gradient_buffers = GradientBuffers()
        #: The BatchNorm choice in force (``batch_norm``; None given: 'per_step'), and whether it was given.
        self.batch_norm = batch_norm or BATCH_NORM_DEFAULT
        self.batch_norm_given = batch_norm is not None
        self.engine = MicroBatchGradients(network, spec, overwrite=True, cls_name=_NAME, loss_scale=scale,
                                          statistics=statistics)
        self.contract = LossContract.of(self.engine, network, spec, _NAME)
        self.gradient_of = GradientOf()
        self.hyper_map = ops.HyperMap()
        self.compile_checks = CompileChecks(self)
        self.bind(None)   # the buffers of the weights trained as of now (cells.binding)
        expect_compile(self)

    # --- binding (cells.binding) --------------------------------------------------------------------------------------

    #: Whether MindSpore's semi-auto/auto-parallel pass accumulates, as bound.
    bound_parallel_pass = False

    def trainable_now(self) -> frozenset:
        """The network's weights with ``requires_grad=True`` now (their ids): what the cell follows where no optimizer
        says what is trained."""
        return frozenset(id(param) for param in self.network.trainable_params())

    def _bind(self, found: Surroundings) -> None:
        """The trained weights and their buffers (created where missing, dropped where unused), the parallel pass's
        part or the data-parallel parts, and the loss scale of the train cell around it."""
        # Model routes the cell to _TrainGradAccuStepCell in semi-auto/auto parallel, which AutoParallel sets only
        # while Model builds it and while the graph compiles: that train cell around it says so too.
        self.bind_data_parallel()
        parallel_pass = parallel_pass_in_force() or isinstance(found.train_cell, TrainGradAccuStepCell)
        object.__setattr__(self, "bound_parallel_pass", parallel_pass)
        if parallel_pass:   # what the pass cannot do is refused here, before any compile
            if self.batch_norm_given and self.batch_norm == "per_step" and self.engine.combines_statistics:
                raise ValueError(
                    f"For '{_NAME}', the argument 'batch_norm' is 'per_step', but under semi-auto/auto parallel "
                    f"MindSpore's parallel pass runs the micro-batches, and its BatchNorm cells update their moving "
                    f"statistics on each. Pass batch_norm='frozen' (exact) or 'micro' (that behaviour, stated).")
            _parallel_pass().check_parallel_pass_arguments(self.explicit_loss_scale, self.kind, self.shared_inputs)
            child_once(self, "parallel_pass_part", lambda: _parallel_pass().ParallelPassAccumulation(
                self.network, self.micro_size, self))
            # _TrainGradAccuStepCell makes accu_grads.<weight> buffers of its own: ours would clash by name.
            weights, buffers = [], self.gradient_buffers.for_weights([])
        else:
            weights = self._trained_weights(found) or list(self.network.get_parameters())
            buffers = self.gradient_buffers.for_weights(weights)
        object.__setattr__(self, "_resolved", (ParameterTuple(weights), buffers))   # not registered: no Cell attribute
        object.__setattr__(self, "targets_key", ",".join(f"{weight.name}#{id(weight)}" for weight in weights))
        self.engine.bind_targets(weights, buffers)
        self.loss_scale.bind(found.train_cell)

    def _trained_weights(self, found: Surroundings) -> list:
        """`weights` when given; otherwise the weights the wrapping train cell differentiates (its optimizer's, `found`
        around the cell); without one, those with ``requires_grad=True``: every weight, since a network with frozen
        ones needs `weights` there (check_at_compile)."""
        if self._explicit_weights is not None:
            return list(self._explicit_weights)
        if found.optimizer is None:
            return self.network.trainable_params()
        trained = {id(weight) for weight in found.optimizer.parameters}
        return [param for param in self.network.get_parameters() if id(param) in trained]

    def _targets(self) -> tuple:
        """``(weights, buffers)`` as bound."""
        return self._resolved

    @property
    def weights(self) -> ParameterTuple:
        """The weights whose gradients this cell accumulates (as bound)."""
        return self._resolved[0]

    @property
    def accu_grads(self) -> ParameterTuple:
        """Their ``accu_grads.<weight>`` buffers."""
        return self._resolved[1]

    # --- checks when a graph compiles --------------------------------------------------------------------------------

    def check_at_compile(self) -> None:
        """What is checked when the graph compiles (every call in PyNative mode): _mindspore.graph.CompileChecks. It
        compares what is in force with what is bound (cells.binding), and changes nothing."""
        self.compiled_elsewhere()
        self.check_data_parallel(_NAME)
        if self.calling_eagerly:   # PyNative mode: bound from the arguments for this call (nothing around is known)
            self.loss_scale.check()
            return
        found = self.surroundings
        check_loss_inside(found)
        in_force = parallel_pass_in_force()
        if isinstance(found.train_cell, TrainGradAccuStepCell) and not in_force:
            raise RuntimeError(
                f"For '{_NAME}', the train cell around it is MindSpore's _TrainGradAccuStepCell, which Model builds "
                f"for semi-auto/auto parallel, but the graph compiles in {parallel_mode()} mode, where nothing would "
                f"fill its buffers (it would train nothing). Keep the same parallel mode (or AutoParallel) for "
                f"Model(...) and model.train(...).")
        if in_force != self.bound_parallel_pass:
            raise RuntimeError(
                f"For '{_NAME}', the graph compiles in {parallel_mode()} mode, but the cell was bound for "
                f"{'semi-auto/auto parallel' if self.bound_parallel_pass else 'stand-alone or data parallel'} (the "
                f"parallel mode changed between its last binding and this compile, with no new train cell built "
                f"around it). Call cell.rebind() after setting the parallel mode.")
        if in_force:   # its arguments were checked when it was bound for the pass
            return
        if found.optimizer is None and self._explicit_weights is None:
            # Batch statistics are state, not weights: no grad call differentiates them.
            frozen = [param.name for param in self.network.get_parameters() if not param.requires_grad and
                      not is_batch_statistic(param.name)]
            if frozen:
                raise weights_required_error(_NAME, self.network, frozen)
        if self._explicit_weights is None and self.trainable_now() != self.bound_trainable:
            changed = [param.name for param in self.network.get_parameters()
                       if (id(param) in self.bound_trainable) != param.requires_grad]
            raise RuntimeError(
                f"For '{_NAME}', the network's weights with requires_grad=True changed since the cell was bound ("
                f"{', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}), and this compile is not one the cell "
                f"rebinds by itself (a new nn.TrainOneStepCell or Model around it, or PyNative mode). Call "
                f"cell.rebind() after freezing or unfreezing weights, or pass weights= to the cell.")
        if not self._trained_weights(found):
            raise foreign_optimizer_error(_NAME, self.network, found.optimizer) or \
                no_trained_weights_error(_NAME, self.network)
        if self._explicit_weights is not None:
            self._check_explicit_weights(found)
        check_bprops(self.network, self.micro_size)
        self.loss_scale.check()

    @property
    def cls_name(self) -> str:
        # Model routes by cls_name (_mindspore.surroundings, "Routing") to _TrainGradAccuStepCell, which only the
        # semi-auto/auto-parallel pass feeds: the routed name only in those modes.
        if self.parallel_pass:
            return "GradAccumulationCell"
        name = type(self).__name__
        return _UNROUTED_NAME if name in ROUTED_NAMES else name

    @property
    def parallel_pass(self) -> bool:
        """Whether MindSpore's semi-auto/auto-parallel pass is in force now: read when ``Model`` builds its train cell
        (``AutoParallel`` sets the mode only then and while the graph compiles)."""
        return parallel_pass_in_force()

    def _check_explicit_weights(self, found: Surroundings) -> None:
        """Refuses `weights` that leave out a weight of the network the wrapping optimizer updates (a zero gradient)."""
        optimizer = found.optimizer
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

    def construct(self, *inputs):
        run_compile_checks(self.compile_checks)
        if self.bound_parallel_pass:
            return self.parallel_pass_part(*inputs)
        scale, (split, shared, constants, layout), unit = self.batch_prologue(inputs)
        result = self.engine(split, shared, constants, layout, scale, unit, self.targets_key)
        value = self.contract(split, (shared, constants, layout), field(result, "first_two_value"),
                              field(result, "first_two_count"), unit, field(result, "value"))
        if self.engine.combines_statistics:   # the batch's BatchNorm statistics, once (core.batch_norm)
            value = self.engine.statistics.apply(value)
        count = field(result, "count")
        factor = 1.0
        if self.data_parallel:
            value, count, factor = self.token_totals(value, count)
        loss, divisor = self.kind.normalise(scale, value, count, factor, split[0].shape[0], unit)
        # The hand-over reads the buffers after the loop (this data dependency), behind stop_gradient, or autodiff
        # fails on networks with BatchNorm ("Operator 'k_hole' is invalid").
        loss = ops.stop_gradient(loss)
        divisor = ops.stop_gradient(ops.depend(divisor, loss))
        # Adds zero; its backward hands each weight its buffer, divided and times the sens (one HyperMap, as
        # core.buffers).
        zeros = self.hyper_map(ops.partial(_hand_over, self.gradient_of, divisor), self.engine.weights,
                               self.engine.buffers)
        loss = loss + ops.stack(zeros).sum()
        return ops.reshape(loss, field(result, "loss_like").shape)   # the network's loss shape: () or (1,)


_hand_over = ops.MultitypeFuncGraph("_hand_over")


@_hand_over.register("Function", "Tensor", "Tensor", "Tensor")
def _hand_over_weight(gradient_of, divisor, weight, buffer):
    return gradient_of(weight, buffer, divisor)


class GradientOf(PrecisionNeutral):
    """Zero in the forward pass; in the backward pass, hands ``buffer * dout / divisor`` to `weight` as its gradient:
    how an unmodified ``nn.TrainOneStepCell`` (and so ``Model``) receives exactly ``mean_gradient * sens``. The buffer
    is scaled in place and returned, so no gradient-sized tensor is created after the loop."""

    def construct(self, weight, buffer, divisor):
        # Depends on `weight`, or autodiff prunes this cell and `weight` gets no gradient from it.
        return ops.depend(ops.zeros((), mstype.float32), weight)

    def bprop(self, weight, buffer, divisor, out, dout):
        # In place where MindSpore does that (graph mode); an ops.assign(buffer, buffer * f) would keep a product per
        # weight alive at once (docs/measurements.md).
        product = _buffers.multiply_in_place(buffer, dout, divisor)
        return ops.cast(product, weight.dtype), ZEROS_LIKE(buffer), ZEROS_LIKE(divisor)
