"""Argument checking with one message format for the whole package.

Every message reads like MindSpore's own:
``For 'GradAccumulationCell', the argument 'micro_size' must be a positive int, but got True (bool).``
"""
import numbers
import warnings
from typing import Any

from mindspore import nn


def describe(value: Any) -> str:
    """Render a value and its type for an error message: ``True (bool)``."""
    return f"{value!r} ({type(value).__name__})"


def argument_error(cls_name: str, arg_name: str, expected: str, value: Any, hint: str = "") -> str:
    """Build the message for an argument that is not what ``expected`` says."""
    message = f"For '{cls_name}', the argument '{arg_name}' must be {expected}, but got {describe(value)}."
    return f"{message} {hint}" if hint else message


def check_int(value: Any, minimum: int, subject: str, expected: str, cls_name: str) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum`` (numpy integers too; bool is not an int).

    The message reads ``For '<cls_name>', <subject> must be <expected>, but got <value> (<type>).``
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"For '{cls_name}', {subject} must be {expected}, but got {describe(value)}.")
    if value < minimum:
        raise ValueError(f"For '{cls_name}', {subject} must be {expected}, but got {describe(value)}.")
    return int(value)


def check_positive_int(value: Any, arg_name: str, cls_name: str) -> int:
    """Return ``value`` as an int if it is an integer >= 1."""
    return check_int(value, 1, f"the argument '{arg_name}'", "a positive int", cls_name)


def check_cell(value: Any, arg_name: str, cls_name: str) -> nn.Cell:
    """Return ``value`` if it is a ``mindspore.nn.Cell``."""
    if not isinstance(value, nn.Cell):
        raise TypeError(argument_error(cls_name, arg_name, "a mindspore.nn.Cell returning a scalar loss", value))
    return value


def check_has_trainable_params(network: nn.Cell, arg_name: str, cls_name: str) -> list:
    """Return the trainable parameters of ``network``; none at all is an error, since nothing would train."""
    params = network.trainable_params()
    if not params:
        raise ValueError(
            f"For '{cls_name}', the argument '{arg_name}' must have trainable parameters, "
            f"but {type(network).__name__} has none (all parameters have requires_grad=False, or there are none). "
            f"Accumulating gradients of nothing would silently train nothing.")
    return params


def batch_norm_cells(network: nn.Cell) -> list:
    """Names (and types) of the cells of ``network`` that keep batch statistics: BatchNorm of any dimension,
    SyncBatchNorm, or any cell with a ``moving_mean`` / ``moving_variance`` parameter."""
    found = []
    for name, cell in network.cells_and_names():
        own = [param.name for param in cell.get_parameters(expand=False)]
        if isinstance(cell, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)) or any(
                param.split(".")[-1] in ("moving_mean", "moving_variance") for param in own):
            found.append(f"{name or '<network>'} ({type(cell).__name__})")
    return found


def warn_batch_norm(network: nn.Cell, cls_name: str, split: str) -> None:
    """One UserWarning naming the batch-normalisation cells, what differs from the full batch, and what to do."""
    cells = batch_norm_cells(network)
    if cells:
        warnings.warn(
            f"{cls_name}: the network has batch normalisation ({', '.join(cells)}). With {split}, its statistics are "
            f"computed per part instead of over the full batch, and its moving averages are updated once per part, "
            f"so training is not equivalent to the full batch. Use GroupNorm or LayerNorm, or a larger part so the "
            f"statistics are close; silence this with warnings.filterwarnings('ignore', message='{cls_name}: the "
            f"network has batch normalisation').", UserWarning, stacklevel=3)
