"""The loss scale: one object per cell, from one source, applied in one place and removed in one place.

A loss scale protects float16 gradients only if it multiplies the loss of the backward pass that computes them, and both
cells run their micro-batch backward passes themselves. The source is chosen when the cell is built
(:func:`for_grad_accumulation_cell`, :func:`scale_of`): a number; a live Parameter (``loss_scale=`` one,
or ``scale_sense``); the fixed ``sens`` of the train cell around a ``GradAccumulationCell`` (``Model`` with a
``FixedLossScaleManager``), read when the cell is bound (``cells.binding``); or none (1.0, warned about for float16
networks). Calling the object gives the float32 scale: ``core.engine.ScaledLoss`` applies it, ``core.buffers.divisor``
removes it.
"""
import numbers
import warnings
import weakref
from typing import Any, Optional

import numpy as np
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.surroundings import applied_sens
from ms_gradaccum.core.base import PrecisionNeutral
from ms_gradaccum.core.validation import argument_error, computes_in_float16

SCALE_EXPECTED = {"scale_sense": "a positive finite float, a scalar Tensor, nn.DynamicLossScaleUpdateCell or "
                                   "nn.FixedLossScaleUpdateCell",
                   "loss_scale": "None, a positive finite float, or a scalar Tensor or Parameter"}


def check_scale_value(value: Any, arg_name: str, cls_name: str) -> float:
    """A loss scale given as a number or a scalar Tensor: finite and > 0 (bool is not a number)."""
    expected = SCALE_EXPECTED[arg_name]
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


class LossScale(PrecisionNeutral):
    """Calling it gives the float32 loss scale of the micro-batch backward passes (see the module docstring).
    :attr:`skips_non_finite`: whether a step whose gradient is not finite is skipped where this scale is used (an
    overflow check follows it), so that the engine leaves a micro-batch with a non-finite loss to it."""
    skips_non_finite = False

    def __init__(self, cls_name: str, network: nn.Cell, fix: str):
        super().__init__(auto_prefix=False)
        # Plain attributes, not cells: the network belongs to the owning cell's tree, not to this one.
        object.__setattr__(self, "_cls_name", cls_name)
        object.__setattr__(self, "_network", weakref.ref(network))
        object.__setattr__(self, "_fix", fix)
        object.__setattr__(self, "_warned", False)

    def bind(self, train_cell: Optional[nn.Cell]) -> None:
        """Takes what it needs of the train cell around the owner (None: none, or not known), when the owner is bound
        (``cells.binding``)."""

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
    """A Parameter read at every step (the user's scaler, or ``scale_sense``), whose steps are checked for overflow."""
    skips_non_finite = True

    def __init__(self, parameter: Parameter, cls_name: str, network: nn.Cell, fix: str):
        super().__init__(cls_name, network, fix)
        self.parameter = parameter

    def construct(self):
        return ops.cast(self.parameter, mstype.float32).reshape(())


class WrapperScale(LossScale):
    """The fixed ``sens`` of the train cell around the owner, taken when the owner is bound (1.0 without one, and in
    PyNative mode, where nothing around it is known)."""

    def __init__(self, cls_name: str, network: nn.Cell, fix: str):
        super().__init__(cls_name, network, fix)
        self.bind(None)

    def bind(self, train_cell: Optional[nn.Cell]) -> None:
        applied = 1.0 if train_cell is None else applied_sens(train_cell)
        object.__setattr__(self, "_wrapper", None if train_cell is None else weakref.ref(train_cell))
        object.__setattr__(self, "_applied", applied)   # None: it changes while training (refused by check())
        object.__setattr__(self, "value", 1.0 if applied is None else applied)
        object.__setattr__(self, "skips_non_finite", isinstance(train_cell, nn.TrainOneStepWithLossScaleCell))

    def check(self) -> None:
        if self._applied is None:
            wrapper = self._wrapper()
            raise ValueError(
                f"For '{self._cls_name}', the train cell that wraps it changes its loss scale while training "
                f"({type(wrapper).__name__} with a DynamicLossScaleUpdateCell, which Model builds for a "
                f"DynamicLossScaleManager), but {self._cls_name} runs its micro-batch backward passes inside its "
                f"forward and cannot follow that scale. Either train with Model(AccumulatingTrainOneStepCell("
                f"loss_net, optimizer, 1, micro_size=micro_size, scale_sense=manager.get_update_cell())), which "
                f"scales every micro-batch and skips overflowing steps, or use a FixedLossScaleManager.")
        if self._applied == 1.0:
            self.warn_if_float16()

    def construct(self):
        return Tensor(self.value, mstype.float32)


_CELL_FIX = ("Pass the scale to the cell: GradAccumulationCell(loss_net, micro_size, loss_scale=scaler.scale_value) "
             "(the scaler's Parameter, read live) or loss_scale=1024.0.")


def for_grad_accumulation_cell(loss_scale: Any, network: nn.Cell, cls_name: str) -> LossScale:
    """`loss_scale` of GradAccumulationCell: None (the wrapper's), a number, a scalar Tensor or a Parameter."""
    if loss_scale is None:
        return WrapperScale(cls_name, network, _CELL_FIX)
    value = check_scale_value(loss_scale, "loss_scale", cls_name)
    if isinstance(loss_scale, Parameter):
        return LiveScale(loss_scale, cls_name, network, _CELL_FIX)
    return FixedScale(value, cls_name, network, _CELL_FIX)


# --- The loss scale as nn.TrainOneStepWithLossScaleCell takes it (`scale_sense`), and the overflow check ---------

SCALE_MANAGERS = (nn.DynamicLossScaleUpdateCell, nn.FixedLossScaleUpdateCell)   # what scale_sense may be

_SCALE_FIX = ("Pass one: AccumulatingTrainOneStepCell(..., scale_sense=nn.DynamicLossScaleUpdateCell(2**12, 2, 1000)) "
              "or scale_sense=1024.0.")


class NoScale(LossScale):
    """No loss scaling (without ``scale_sense``): 1.0, warned about for float16 networks."""

    def check(self) -> None:
        self.warn_if_float16()

    def construct(self):
        return Tensor(1.0, mstype.float32)


def scale_of(scale_sense, network: nn.Cell, managers: tuple, cls_name: str) -> tuple:
    """``(scale, update cell or None)`` of `cls_name` from what ``nn.TrainOneStepWithLossScaleCell`` takes as
    `scale_sense` (an update cell being one of `managers`); the scale lives in a Parameter named ``scale_sense``
    (checkpoints carry it)."""
    if scale_sense is None:
        return NoScale(cls_name, network, _SCALE_FIX), None
    if isinstance(scale_sense, nn.Cell):
        if not isinstance(scale_sense, managers):
            expected = SCALE_EXPECTED["scale_sense"] if managers == SCALE_MANAGERS else (
                f"a positive finite float, a scalar Tensor or one of {', '.join(m.__name__ for m in managers)}")
            raise TypeError(argument_error(cls_name, "scale_sense", expected, scale_sense))
        value = check_scale_value(scale_sense.get_loss_scale(), "scale_sense", cls_name)
        manager = scale_sense
    else:
        value = check_scale_value(scale_sense, "scale_sense", cls_name)
        manager = None
    parameter = Parameter(Tensor(value, mstype.float32), name="scale_sense", requires_grad=False)
    return LiveScale(parameter, cls_name, network, _SCALE_FIX), manager


_all_finite = ops.MultitypeFuncGraph("_all_finite")


@_all_finite.register("Tensor")
def _all_finite_tensor(grad):
    return ops.isfinite(grad).all()


def all_finite(hyper_map, grads) -> Tensor:
    """True when every gradient is finite: a portable overflow check (CPU too), on the float32 sums."""
    return ops.stack(hyper_map(_all_finite, grads)).all()
