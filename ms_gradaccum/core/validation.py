"""Argument checking with one message format for the whole package.

Every message reads like MindSpore's own:
``For 'GradAccumulationCell', the argument 'micro_size' must be a positive int, but got True (bool).``
"""
import numbers
import warnings
from typing import Any, Optional

import numpy as np
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype


def describe(value: Any) -> str:
    """Render a value and its type for an error message: ``True (bool)``."""
    return f"{value!r} ({type(value).__name__})"


def argument_error(cls_name: str, arg_name: str, expected: str, value: Any, hint: str = "") -> str:
    """Build the message for an argument that is not what ``expected`` says."""
    message = f"For '{cls_name}', the argument '{arg_name}' must be {expected}, but got {describe(value)}."
    return f"{message} {hint}" if hint else message


# Powers of ten up to 10**10, all exact in float32.
_POWERS_OF_TEN = Tensor(np.array([10.0 ** k for k in range(11)], np.float32))


def readable(value: Tensor, digits: int = 4) -> Tensor:
    """`value` (a float Tensor, in a graph or not) rounded to `digits` significant digits, so messages print the same
    text on every processor (``2.0``, not ``1.9999999``); zero, inf, nan and magnitudes beyond 10**±10 as they are."""
    value = ops.cast(value, mstype.float32)
    size = ops.abs(value)
    usable = ops.logical_and(ops.isfinite(value), size > 0)
    safe = ops.select(usable, size, ops.ones_like(size))
    exponent = ops.cast(ops.floor(ops.log(safe) / float(np.log(10.0))), mstype.int32)
    shift = digits - 1 - exponent
    usable = ops.logical_and(usable, ops.abs(shift) <= 10)   # beyond 10**±10 (rare in a loss): printed in full
    shift = ops.clip(shift, -10, 10)
    power = ops.gather(_POWERS_OF_TEN, ops.abs(shift), 0)
    # Division and multiplication by an exact power of ten are correctly rounded: the shortest text of the result is
    # the rounded decimal.
    up = ops.round(value * power) / power
    down = ops.round(value / power) * power
    rounded = ops.select(shift >= 0, up, down)
    return ops.select(usable, rounded, value)


def check_int(value: Any, minimum: int, subject: str, expected: str, cls_name: str) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum`` (numpy integers too; bool is not an int)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"For '{cls_name}', {subject} must be {expected}, but got {describe(value)}.")
    if value < minimum:
        raise ValueError(f"For '{cls_name}', {subject} must be {expected}, but got {describe(value)}.")
    return int(value)


def check_positive_int(value: Any, arg_name: str, cls_name: str) -> int:
    """Return ``value`` as an int if it is an integer >= 1."""
    return check_int(value, 1, f"the argument '{arg_name}'", "a positive int", cls_name)


def check_input_indices(value: Any, arg_name: str, cls_name: str) -> tuple:
    """Return ``value`` as a sorted tuple of distinct input indices (ints >= 0; a single int is one index)."""
    expected = "a tuple of input indices (ints >= 0), e.g. (1,) for the network's second input"
    items = (value,) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if not isinstance(items, (tuple, list)):
        raise TypeError(argument_error(cls_name, arg_name, expected, value))
    indices = tuple(check_int(item, 0, f"every index in '{arg_name}'", "an int >= 0", cls_name) for item in items)
    if len(set(indices)) != len(indices):
        raise ValueError(argument_error(cls_name, arg_name, expected + ", each once", value))
    return tuple(sorted(indices))


def check_cell(value: Any, arg_name: str, cls_name: str) -> nn.Cell:
    """Return ``value`` if it is a ``mindspore.nn.Cell``."""
    if not isinstance(value, nn.Cell):
        raise TypeError(argument_error(cls_name, arg_name, "a mindspore.nn.Cell returning a single-element loss",
                                       value))
    return value


def check_bool(value: Any, arg_name: str, cls_name: str) -> bool:
    """Return ``value`` if it is a bool (numpy's too); 0, 1 or None are not."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(argument_error(cls_name, arg_name, "a bool", value))
    return bool(value)


def check_positive_float(value: Any, arg_name: str, cls_name: str, expected: str = "a positive float") -> float:
    """Return ``value`` as a float if it is a real number, finite and > 0 (bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(argument_error(cls_name, arg_name, expected, value))
    if not 0 < value < float("inf"):
        raise ValueError(argument_error(cls_name, arg_name, expected, value))
    return float(value)


REDUCTIONS = ("mean", "sum")


def check_reduction(value: Any, cls_name: str) -> str:
    """``'mean'`` or ``'sum'``: how the network's loss reduces over the rows it is given."""
    expected = "'mean' (a mean over the rows it is given) or 'sum' (a sum over them, or a mean times their number)"
    if not isinstance(value, str):
        raise TypeError(argument_error(cls_name, "reduction", expected, value))
    if value not in REDUCTIONS:
        raise ValueError(argument_error(cls_name, "reduction", expected, value))
    return value


def check_min_count(value: Any, per_token_loss: bool, cls_name: str) -> float:
    """A finite float >= 0, and > 0 only with ``per_token_loss=True`` (it floors the total count)."""
    expected = "a finite float >= 0 (the floor of the total count, e.g. 1.0 for max(count, 1))"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(argument_error(cls_name, "min_count", expected, value))
    if not np.isfinite(value) or value < 0:
        raise ValueError(argument_error(cls_name, "min_count", expected, value))
    if value > 0 and not per_token_loss:
        raise ValueError(argument_error(cls_name, "min_count", expected + " with per_token_loss=True", value,
                                        "It floors the count a (loss_sum, count) network returns; a mean has none."))
    return float(value)


def check_weights(value: Any, network: nn.Cell, cls_name: str) -> Optional[tuple]:
    """``None``, or `value` as a tuple of distinct Parameters that `network` holds (a list, tuple or ParameterTuple)."""
    if value is None:
        return None
    expected = "None or a list/tuple of the network's Parameters, e.g. optimizer.parameters"
    if isinstance(value, Parameter) or not isinstance(value, (list, tuple)):
        raise TypeError(argument_error(cls_name, "weights", expected, value))
    weights = tuple(value)
    if not weights:
        raise ValueError(argument_error(cls_name, "weights", expected + ", at least one", value,
                                        "With no weight there is nothing to accumulate."))
    owned = {id(param) for param in network.get_parameters()}
    seen = set()
    for index, weight in enumerate(weights):
        if not isinstance(weight, Parameter):
            raise TypeError(f"For '{cls_name}', every item of the argument 'weights' must be a Parameter of the "
                            f"network, but item {index} is {describe(weight)}.")
        if id(weight) not in owned:
            raise ValueError(f"For '{cls_name}', every item of the argument 'weights' must be a Parameter of the "
                             f"network, but item {index}, {weight.name!r}, is not one of {type(network).__name__}'s "
                             f"parameters. Pass weights of the network this cell wraps (e.g. net.trainable_params() "
                             f"or the optimizer's parameters).")
        if id(weight) in seen:
            raise ValueError(f"For '{cls_name}', the argument 'weights' must name each Parameter once, but "
                             f"{weight.name!r} (item {index}) appears twice.")
        seen.add(id(weight))
    return weights


def check_has_parameters(network: nn.Cell, arg_name: str, cls_name: str) -> None:
    """A network without any parameter can never train (which of them train is read when the graph compiles)."""
    if not list(network.get_parameters()):
        raise ValueError(
            f"For '{cls_name}', the argument '{arg_name}' must have parameters to train, but {type(network).__name__} "
            f"has none. Accumulating gradients of nothing would silently train nothing.")


def foreign_optimizer_error(cls_name: str, network: nn.Cell, optimizer) -> Optional[ValueError]:
    """The error for an optimizer none of whose parameters is the network's (it would train nothing), else None."""
    params = list(getattr(optimizer, "parameters", None) or ())
    owned = {id(param) for param in network.get_parameters()}
    if not params or any(id(param) in owned for param in params):
        return None
    return ValueError(
        f"For '{cls_name}', the optimizer must update the network's parameters, but none of the {len(params)} "
        f"parameter(s) of {type(optimizer).__name__} ({params[0].name!r}, ...) is one of {type(network).__name__}'s. "
        f"It would train nothing. Build the optimizer over this network's parameters, e.g. "
        f"nn.SGD(net.trainable_params(), learning_rate) with the net inside the loss network.")


def no_trained_weights_error(cls_name: str, network: nn.Cell) -> ValueError:
    """The error for a graph compiled when none of the network's parameters is trained."""
    return ValueError(
        f"For '{cls_name}', the network must have parameters to train when the graph compiles, but none of "
        f"{type(network).__name__}'s parameters has requires_grad=True or is updated by the wrapping optimizer. "
        f"Accumulating gradients of nothing would silently train nothing.")


def weights_required_error(cls_name: str, network: nn.Cell, frozen: list) -> ValueError:
    """The error for a graph compiled with no optimizer around the cell, no `weights`, and `frozen` parameters."""
    shown = ", ".join(frozen[:5]) + (", ..." if len(frozen) > 5 else "")
    return ValueError(
        f"For '{cls_name}', the argument 'weights' is required where no optimizer is around the cell (a functional "
        f"loop with mindspore.value_and_grad or mindspore.grad) and the network has parameters with "
        f"requires_grad=False ({shown}; {len(frozen)} in all), but it is None: value_and_grad differentiates such a "
        f"parameter when it is among its weights, and only you can say whether it is. Pass the weights you give "
        f"value_and_grad: {cls_name}({type(network).__name__}(...), micro_size, weights=optimizer.parameters).")


def computes_in_float16(network: nn.Cell) -> bool:
    """Whether `network` computes in float16: ``to_float(float16)`` anywhere in it (what ``amp_level`` O2/O3 and
    ``Cell.to_float`` set), an amp strategy in float16 (``amp_level="auto"``), or float16 weights. Not bfloat16,
    whose range is float32's, so its gradients do not underflow."""
    for _, cell in network.cells_and_names():
        if cell.get_flags().get("fp16"):
            return True
        strategy = getattr(cell, "amp_strategy", None)
        if strategy is not None and getattr(strategy, "get_amp_dtype", lambda: None)() == mstype.float16:
            return True
    return any(param.dtype == mstype.float16 for param in network.get_parameters())


def is_batch_statistic(name: str) -> bool:
    """Whether the parameter named `name` holds a batch-normalisation cell's moving statistics (``moving_mean``,
    ``moving_variance``): state the forward pass updates, not a weight (no grad call differentiates it)."""
    return name.split(".")[-1] in ("moving_mean", "moving_variance")


def batch_norm_cells(network: nn.Cell, cells: bool = False) -> list:
    """Names (and types) of the cells of ``network`` that normalise with batch statistics in training (BatchNorm,
    SyncBatchNorm, any cell with ``moving_mean``/``moving_variance``), unless ``use_batch_statistics=False``; with
    `cells`, the cells themselves."""
    found = []
    for name, cell in network.cells_and_names():
        if getattr(cell, "use_batch_statistics", None) is False:
            continue
        own = [param.name for param in cell.get_parameters(expand=False)]
        if isinstance(cell, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)) or any(
                is_batch_statistic(param) for param in own):
            found.append(cell if cells else f"{name or '<network>'} ({type(cell).__name__})")
    return found


def warn_batch_norm(network: nn.Cell, cls_name: str, split: str) -> None:
    """One UserWarning naming the batch-normalisation cells, what each ``batch_norm`` choice makes exact, and how to
    choose (given only where the user chose nothing: core.engine.warn_where_inexact)."""
    cells = batch_norm_cells(network)
    if cells:
        warnings.warn(
            f"{cls_name}: the network has batch normalisation ({', '.join(cells)}), which with {split} trains exactly "
            f"like the full batch only with batch_norm='frozen' (normalised with the moving statistics, none updated); "
            f"with the default batch_norm='per_step' each part is normalised by its own statistics and the moving "
            f"statistics move once per optimizer step, from all parts combined (the first BatchNorm layer's as the "
            f"full batch's), and with batch_norm='micro' once per part. Pass batch_norm= to choose (which silences "
            f"this), or use GroupNorm or LayerNorm; or silence it with warnings.filterwarnings('ignore', "
            f"message='{cls_name}: the network has batch normalisation').", UserWarning, stacklevel=3)
