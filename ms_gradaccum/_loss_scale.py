"""Loss scaling: the scale every micro-batch backward runs with, where it comes from, overflow and clipping.

A loss scale only protects low-precision gradients if it is applied to the backward pass that computes them.
``GradAccumulationCell`` runs its micro-batch backward passes inside its own forward, before the wrapping
train cell applies its ``sens``; so the scale has to be known when the forward runs. It comes from, in order:
the live ``scale_sense`` of an :class:`AccumulatingTrainOneStepCell` (passed in at run time), an explicit
``loss_scale`` argument, or the fixed scale of the MindSpore train cell that wraps the cell, read when the
graph is compiled (:func:`wrapper_loss_scale`).
"""
import inspect
import numbers
import weakref
from typing import Any, Optional, Union

import numpy as np
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype
from mindspore.nn.wrap.cell_wrapper import _TrainGradAccuStepCell
from mindspore.ops.primitive import _primexpr

from ms_gradaccum._validation import argument_error, describe

_SCALE_MANAGERS = (nn.DynamicLossScaleUpdateCell, nn.FixedLossScaleUpdateCell)
# GradAccumulationCell instances by key, so the compile-time lookup (which only gets constants) finds its cell.
_CELLS = weakref.WeakValueDictionary()


def register(cell: nn.Cell) -> str:
    """A constant key under which :func:`wrapper_loss_scale` finds ``cell`` while its graph compiles."""
    key = f"ms_gradaccum.{id(cell)}"
    _CELLS[key] = cell
    return key


_SCALE_EXPECTED = {"scale_sense": "a positive finite float, a scalar Tensor, nn.DynamicLossScaleUpdateCell or "
                                   "nn.FixedLossScaleUpdateCell",
                   "loss_scale": "None, a positive finite float, or a scalar Tensor or Parameter"}


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


def scale_parameter(scale_sense: Any, cls_name: str) -> tuple:
    """``(Parameter 'scale_sense', update cell or None)`` from what ``nn.TrainOneStepWithLossScaleCell`` takes."""
    if isinstance(scale_sense, nn.Cell):
        if not isinstance(scale_sense, _SCALE_MANAGERS):
            raise TypeError(argument_error(cls_name, "scale_sense", _SCALE_EXPECTED["scale_sense"], scale_sense))
        value = check_scale_value(scale_sense.get_loss_scale(), "scale_sense", cls_name)
        manager = scale_sense
    else:
        value = check_scale_value(scale_sense, "scale_sense", cls_name)
        manager = None
    return Parameter(Tensor(value, mstype.float32), name="scale_sense", requires_grad=False), manager


def check_max_grad_norm(value: Any, cls_name: str) -> Optional[float]:
    """``None`` (no clipping) or a positive finite float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(argument_error(cls_name, "max_grad_norm", "None or a positive float", value))
    if not np.isfinite(value) or value <= 0:
        raise ValueError(argument_error(cls_name, "max_grad_norm", "None or a positive float", value))
    return float(value)


def explicit_loss_scale(loss_scale: Union[None, float, Tensor], cls_name: str) -> Union[None, float, Parameter]:
    """``None`` (find the wrapper's), a float, or a Parameter kept as is so its updates are seen live."""
    if loss_scale is None or isinstance(loss_scale, Parameter):
        if isinstance(loss_scale, Parameter):
            check_scale_value(loss_scale, "loss_scale", cls_name)
        return loss_scale
    return check_scale_value(loss_scale, "loss_scale", cls_name)


def _enclosing_train_cells(cell: nn.Cell) -> list:
    """Train cells (``nn.TrainOneStepCell`` and subclasses) around ``cell``, innermost first.

    Searched from the cells whose Python frames are on the stack: in graph mode that is the top cell being
    compiled; in PyNative mode every cell being called.
    """
    roots, found = [], []
    for frame_info in inspect.stack(0):
        owner = frame_info.frame.f_locals.get("self")
        if isinstance(owner, nn.Cell) and all(owner is not root for root in roots):
            roots.append(owner)
    for root in roots:
        for _, candidate in root.cells_and_names():
            if isinstance(candidate, nn.TrainOneStepCell) and all(candidate is not f for f in found):
                if any(sub is cell for _, sub in candidate.cells_and_names()):
                    found.append(candidate)
    return sorted(found, key=lambda c: len(list(c.cells_and_names())))


def _applied_scale(train_cell: nn.Cell) -> float:
    """The loss scale ``train_cell`` applies as the ``sens`` of its backward pass, when that scale is fixed."""
    manager = getattr(train_cell, "loss_scaling_manager", None)
    if isinstance(manager, nn.DynamicLossScaleUpdateCell):
        raise ValueError(
            "For 'GradAccumulationCell', the train cell that wraps it changes its loss scale while training "
            f"({type(train_cell).__name__} with a DynamicLossScaleUpdateCell, which Model builds for a "
            "DynamicLossScaleManager), but GradAccumulationCell runs its micro-batch backward passes inside its "
            "forward and cannot follow that scale. Either train with Model(AccumulatingTrainOneStepCell("
            "GradAccumulationCell(loss_net, micro_size), optimizer, 1, scale_sense=manager.get_update_cell())), "
            "which scales every micro-batch and skips overflowing steps, or use a FixedLossScaleManager.")
    if isinstance(train_cell, nn.TrainOneStepWithLossScaleCell):
        return float(train_cell.scale_sense.asnumpy().reshape(()))
    sens = getattr(train_cell, "sens", None)
    if getattr(train_cell, "sense_flag", False) and isinstance(sens, numbers.Real) and not isinstance(sens, bool):
        return float(sens)
    return 1.0


def _innermost_wrapper(key: str) -> Optional[nn.Cell]:
    cell = _CELLS.get(key)
    if cell is None:
        return None
    wrappers = _enclosing_train_cells(cell)
    return wrappers[0] if wrappers else None


@_primexpr
def wrapper_loss_scale(key: str) -> float:
    """The fixed loss scale (``sens``) of the innermost train cell wrapping cell ``key``; 1.0 without one.

    Runs in Python while the graph compiles (it is a ``_primexpr``), so the value is a constant of the graph:
    ``nn.TrainOneStepCell(..., sens=S)`` (which ``Model`` builds for ``FixedLossScaleManager(S,
    drop_overflow_update=False)``) gives S, as does ``nn.TrainOneStepWithLossScaleCell`` with a fixed scale.
    """
    wrapper = _innermost_wrapper(key)
    return 1.0 if wrapper is None else _applied_scale(wrapper)


@_primexpr
def missing_loss_scale(key: str) -> float:
    """The loss scale that the optimizer divides out but the wrapping train cell never applies.

    Only MindSpore's ``_TrainGradAccuStepCell`` (what ``Model`` builds in semi-auto/auto parallel for a
    ``FixedLossScaleManager(S, drop_overflow_update=False)``) leaves one: the optimizer's ``loss_scale`` S.
    Every other wrapper applies its own scale (1.0 here, so nothing is scaled twice).
    """
    wrapper = _innermost_wrapper(key)
    if isinstance(wrapper, _TrainGradAccuStepCell) and not wrapper.sense_flag:
        return float(getattr(wrapper.optimizer, "loss_scale", 1.0))
    return 1.0


_all_finite = ops.MultitypeFuncGraph("_all_finite")


@_all_finite.register("Tensor")
def _all_finite_tensor(grad):
    return ops.isfinite(grad).all()


def all_finite(hyper_map, grads) -> Tensor:
    """True when every gradient is finite: a portable overflow check (CPU too), on the fp32 sums."""
    flags = hyper_map(_all_finite, grads)
    return ops.stack(flags).all()
