"""The loss scale: one object per cell, from one source, applied in one place and removed in one place.

A loss scale protects float16 gradients only if it multiplies the loss of the backward pass that computes them, and
both cells run their micro-batch backward passes themselves. The source is chosen when the cell is built
(:func:`for_grad_accumulation_cell`, :func:`for_train_cell`): a number; a live Parameter (``loss_scale=`` one, or
``scale_sense``); the fixed ``sens`` of the train cell around a ``GradAccumulationCell`` (``Model`` with a
``FixedLossScaleManager``), read when the graph compiles; or none (1.0, warned about for float16 networks). Calling the
object gives the float32 scale: ``_engine.ScaledLoss`` applies it, ``_buffers.divisor`` removes it.
"""
import numbers
import warnings
import weakref
from typing import Any, Optional, Tuple

import numpy as np
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.graph import compile_time
from ms_gradaccum._mindspore.surroundings import PRECISION_FLAGS, applied_sens, discover
from ms_gradaccum._validation import argument_error, check_positive_float, computes_in_float16

SCALE_MANAGERS = (nn.DynamicLossScaleUpdateCell, nn.FixedLossScaleUpdateCell)
_SCALE_EXPECTED = {"scale_sense": "a positive finite float, a scalar Tensor, nn.DynamicLossScaleUpdateCell or "
                                   "nn.FixedLossScaleUpdateCell",
                   "loss_scale": "None, a positive finite float, or a scalar Tensor or Parameter"}


class PrecisionNeutral(nn.Cell):
    """A cell of this package's machinery that ``to_float`` / amp levels pass through to the user's network.

    ``Cell.to_float`` (what ``Model``'s ``amp_level="O2"/"O3"`` calls) flags every cell in the tree, and a
    flagged cell casts every float tensor it handles, including the float32 sums and the loss scale, which breaks
    the micro-batch loop ("Type Join Failed: Float32, Float16"). The network inside keeps its flags.
    """

    def add_flags_recursive(self, **flags):
        self.add_flags(**{key: value for key, value in flags.items() if key not in PRECISION_FLAGS})
        for cell in self.cells():
            cell.add_flags_recursive(**flags)
        return self


def check_scale_value(value: Any, arg_name: str, cls_name: str) -> float:
    """A loss scale given as a number or a scalar Tensor: finite and > 0 (bool is not a number)."""
    expected = _SCALE_EXPECTED[arg_name]
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)):
        raise TypeError(argument_error(cls_name, arg_name, expected, value))
    if isinstance(value, Tensor):
        if value.shape not in ((), (1,)):
            raise ValueError(f"For '{cls_name}', the argument '{arg_name}' must be a scalar Tensor (shape () or (1,)), "
                             f"but got a Tensor of shape {value.shape}.")
        if value.dtype == mstype.bool_:
            raise TypeError(argument_error(cls_name, arg_name, expected, value))
        number = float(value.asnumpy().reshape(()))
    else:
        number = float(value)
    if not np.isfinite(number) or number <= 0:
        raise ValueError(argument_error(cls_name, arg_name, expected, value))
    return number


def check_max_grad_norm(value: Any, cls_name: str) -> Optional[float]:
    """``None`` (no clipping) or a positive finite float."""
    if value is None:
        return None
    return check_positive_float(value, "max_grad_norm", cls_name, "None or a positive float")


class LossScale(PrecisionNeutral):
    """Calling it gives the float32 loss scale of the micro-batch backward passes (see the module docstring)."""

    def __init__(self, cls_name: str, network: nn.Cell, fix: str):
        super().__init__(auto_prefix=False)
        # Plain attributes, not cells: the network belongs to the owning cell's tree, not to this one.
        object.__setattr__(self, "_cls_name", cls_name)
        object.__setattr__(self, "_network", weakref.ref(network))
        object.__setattr__(self, "_fix", fix)
        object.__setattr__(self, "_warned", False)

    def check(self) -> None:
        """Raises what is wrong with the scale, and warns, when the owner's graph compiles (see
        _mindspore.graph.CompileChecks)."""

    def warn_if_float16(self) -> None:
        """One UserWarning per cell when its network computes in float16 and no scale reaches its backward passes."""
        network = self._network()
        if self._warned or network is None or not computes_in_float16(network):
            return
        object.__setattr__(self, "_warned", True)
        warnings.warn(
            f"{self._cls_name}: the network computes in float16, but no loss scale reaches its micro-batch backward "
            f"passes, so small gradients underflow to zero (a full batch whose loss is scaled outside the cell would "
            f"keep them). {self._fix}", UserWarning, stacklevel=2)


class FixedScale(LossScale):
    """A number given by the user."""

    def __init__(self, value: float, cls_name: str, network: nn.Cell, fix: str):
        super().__init__(cls_name, network, fix)
        self.value = float(value)

    def construct(self):
        return Tensor(self.value, mstype.float32)


class LiveScale(LossScale):
    """A Parameter read at every step (the user's scaler, or ``scale_sense``)."""

    def __init__(self, parameter: Parameter, cls_name: str, network: nn.Cell, fix: str):
        super().__init__(cls_name, network, fix)
        self.parameter = parameter

    def construct(self):
        return ops.cast(self.parameter, mstype.float32).reshape(())


class NoScale(LossScale):
    """No loss scaling (AccumulatingTrainOneStepCell without ``scale_sense``)."""

    def check(self) -> None:
        self.warn_if_float16()

    def construct(self):
        return Tensor(1.0, mstype.float32)


class WrapperScale(LossScale):
    """The fixed ``sens`` of the train cell wrapping `owner`, read when the graph compiles (1.0 without one)."""

    def __init__(self, owner: nn.Cell, cls_name: str, network: nn.Cell, fix: str):
        super().__init__(cls_name, network, fix)
        object.__setattr__(self, "_owner", weakref.ref(owner))

    @compile_time
    def value(self) -> float:
        wrapper = discover(self._owner()).train_cell
        scale = 1.0 if wrapper is None else applied_sens(wrapper)
        return 1.0 if scale is None else scale

    def check(self) -> None:
        wrapper = discover(self._owner()).train_cell
        scale = 1.0 if wrapper is None else applied_sens(wrapper)
        if scale is None:
            raise ValueError(
                f"For '{self._cls_name}', the train cell that wraps it changes its loss scale while training "
                f"({type(wrapper).__name__} with a DynamicLossScaleUpdateCell, which Model builds for a "
                f"DynamicLossScaleManager), but {self._cls_name} runs its micro-batch backward passes inside its "
                f"forward and cannot follow that scale. Either train with Model(AccumulatingTrainOneStepCell("
                f"loss_net, optimizer, 1, micro_size=micro_size, scale_sense=manager.get_update_cell())), which "
                f"scales every micro-batch and skips overflowing steps, or use a FixedLossScaleManager.")
        if scale == 1.0:
            self.warn_if_float16()

    def construct(self):
        return Tensor(self.value, mstype.float32)


_CELL_FIX = ("Pass the scale to the cell: GradAccumulationCell(loss_net, micro_size, loss_scale=scaler.scale_value) "
             "(the scaler's Parameter, read live) or loss_scale=1024.0.")
_TRAIN_CELL_FIX = ("Pass one: AccumulatingTrainOneStepCell(..., scale_sense=nn.DynamicLossScaleUpdateCell(2**12, 2, "
                   "1000)) or scale_sense=1024.0.")


def for_grad_accumulation_cell(loss_scale: Any, owner: nn.Cell, network: nn.Cell, cls_name: str) -> LossScale:
    """`loss_scale` of GradAccumulationCell: None (the wrapper's), a number, a scalar Tensor or a Parameter."""
    if loss_scale is None:
        return WrapperScale(owner, cls_name, network, _CELL_FIX)
    value = check_scale_value(loss_scale, "loss_scale", cls_name)
    if isinstance(loss_scale, Parameter):
        return LiveScale(loss_scale, cls_name, network, _CELL_FIX)
    return FixedScale(value, cls_name, network, _CELL_FIX)


def for_train_cell(scale_sense: Any, network: nn.Cell, cls_name: str,
                   managers: tuple = SCALE_MANAGERS) -> Tuple[LossScale, Optional[nn.Cell]]:
    """``(scale, update cell or None)`` from what ``nn.TrainOneStepWithLossScaleCell`` takes as `scale_sense` (an
    update cell being one of `managers`); the scale lives in a Parameter named ``scale_sense`` (checkpoints carry
    it)."""
    if scale_sense is None:
        return NoScale(cls_name, network, _TRAIN_CELL_FIX), None
    if isinstance(scale_sense, nn.Cell):
        if not isinstance(scale_sense, managers):
            expected = _SCALE_EXPECTED["scale_sense"]
            if managers != SCALE_MANAGERS:
                expected = (f"a positive finite float, a scalar Tensor or one of "
                            f"{', '.join(manager.__name__ for manager in managers)}")
            raise TypeError(argument_error(cls_name, "scale_sense", expected, scale_sense))
        value = check_scale_value(scale_sense.get_loss_scale(), "scale_sense", cls_name)
        manager = scale_sense
    else:
        value = check_scale_value(scale_sense, "scale_sense", cls_name)
        manager = None
    parameter = Parameter(Tensor(value, mstype.float32), name="scale_sense", requires_grad=False)
    return LiveScale(parameter, cls_name, network, _TRAIN_CELL_FIX), manager


_all_finite = ops.MultitypeFuncGraph("_all_finite")


@_all_finite.register("Tensor")
def _all_finite_tensor(grad):
    return ops.isfinite(grad).all()


def all_finite(hyper_map, grads) -> Tensor:
    """True when every gradient is finite: a portable overflow check (CPU too), on the float32 sums."""
    flags = hyper_map(_all_finite, grads)
    return ops.stack(flags).all()
