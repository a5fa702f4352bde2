"""Splitting a batch along axis 0 into micro-batches, inside the compiled graph.

A batch of any size is split into ``micro_size`` micro-batches as even as possible (sizes differing by at most
one); the caller weights each by its true number of rows. The checks run at graph-compile time on static shapes
(:func:`~ms_gradaccum._internals.primexpr`), so a bad batch fails before any computation, with a message naming the input and its shape.
Rows are never dropped.
"""
from typing import Tuple

from mindspore import ops

from ms_gradaccum._internals import primexpr


def plan(batch: int, micro_size: int) -> Tuple[Tuple[int, int], ...]:
    """``((count, rows), ...)``: micro-batches as even as possible, sizes differing by at most one.

    ``batch = sum(count * rows)``; one entry when ``micro_size`` divides ``batch``, else two (the larger
    micro-batches first). A batch smaller than ``micro_size`` gives ``batch`` micro-batches of one row.
    """
    k = min(micro_size, batch)
    rows, extra = divmod(batch, k)
    if extra == 0:
        return ((k, rows),)
    return ((extra, rows + 1), (k - extra, rows))


@primexpr
def check_input_shape(cls_name: str, index: int, shape: tuple, first_shape: tuple, micro_size: int) -> None:
    """Reject inputs that cannot be split along axis 0 together with the first input."""
    if not shape:
        raise ValueError(
            f"For '{cls_name}', input {index} has shape () but every input must have a batch axis 0 "
            f"to be split into micro_size={micro_size} micro-batches.")
    if shape[0] < 0:
        raise ValueError(
            f"For '{cls_name}', input {index} has a dynamic batch size (shape {shape}); the batch size must be "
            f"static to be split into micro_size={micro_size} micro-batches.")
    if shape[0] == 0:
        raise ValueError(
            f"For '{cls_name}', input {index} has an empty batch (shape {shape}); there is nothing to train on.")
    if shape[0] != first_shape[0]:
        raise ValueError(
            f"For '{cls_name}', all inputs must have the same batch size (axis 0) to be split together, "
            f"but input 0 has shape {first_shape} and input {index} has shape {shape}.")


@primexpr
def check_loss_output(cls_name: str, per_token_loss: bool, is_tuple: bool, shapes: tuple) -> None:
    """The network's output must be what `per_token_loss` says: a scalar loss, or a tuple (loss_sum, count) of two
    scalars. `shapes` holds the shape of each output (one for a single Tensor)."""
    returned = (f"a tuple of {len(shapes)} element(s) with shapes {shapes}" if is_tuple
                else f"a single Tensor of shape {shapes[0]}")
    if per_token_loss:
        if not is_tuple or len(shapes) != 2 or any(shape for shape in shapes):
            raise ValueError(
                f"For '{cls_name}', with per_token_loss=True the argument 'network' must return a tuple (loss_sum, "
                f"count) of two scalars (e.g. the sum of a masked token loss and the number of valid tokens), but "
                f"it returned {returned}. Return (loss_sum, count), or set per_token_loss=False for a mean loss.")
    elif is_tuple:
        raise ValueError(
            f"For '{cls_name}', the argument 'network' must return a scalar loss, but it returned {returned}. "
            f"Auxiliary outputs (logits, metrics) are not carried through the accumulation: return only the loss. "
            f"If the tuple is (loss_sum, count), e.g. a masked token loss and the number of valid tokens, pass "
            f"per_token_loss=True.")
    elif shapes[0]:
        raise ValueError(
            f"For '{cls_name}', the argument 'network' must return a scalar loss (shape ()), but it returned "
            f"shape {shapes[0]}. Reduce the loss inside the network, e.g. with reduction='mean' in the loss function, "
            f"or return (loss_sum, count) with per_token_loss=True for a loss normalised by a count such as the "
            f"number of tokens.")


def split_batch(inputs: tuple, micro_size: int, cls_name: str) -> Tuple:
    """Every input split along axis 0 following :func:`plan`: ``((split inputs, count, rows), ...)``.

    Each part's inputs are reshaped from ``(count * rows, ...)`` to ``(count, rows, ...)``; no row is dropped.
    """
    first_shape = inputs[0].shape
    for index, x in enumerate(inputs):
        check_input_shape(cls_name, index, x.shape, first_shape, micro_size)
    parts = ()
    start = 0
    for count, rows in plan(first_shape[0], micro_size):
        split = ()
        for x in inputs:
            part = x[start:start + count * rows] if count * rows != first_shape[0] else x
            split += (part.reshape((count, rows) + x.shape[1:]),)
        parts += ((split, count, rows),)
        start += count * rows
    return parts


def micro_batch(split: tuple, i) -> Tuple:
    """Micro-batch ``i`` (a Tensor counter, so the loop over micro-batches is not unrolled) of every input."""
    micro = ()
    for x in split:
        micro += (ops.gather(x, i, 0),)
    return micro
