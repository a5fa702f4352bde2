"""Splitting a batch along axis 0 into micro-batches, inside the compiled graph.

The checks run at graph-compile time on static shapes (``_primexpr``), so a bad batch fails before any
computation, with a message naming the input, its shape and ``micro_size``. Rows are never dropped.
"""
from typing import Tuple

from mindspore import ops
from mindspore.ops.primitive import _primexpr

_CLS_NAME = "GradAccumulationCell"


def _divisors(n: int) -> list:
    return [d for d in range(2, n + 1) if n % d == 0]


@_primexpr
def check_input_shape(index: int, shape: tuple, first_shape: tuple, micro_size: int) -> None:
    """Reject inputs that cannot be split exactly into ``micro_size`` micro-batches along axis 0."""
    if not shape:
        raise ValueError(
            f"For '{_CLS_NAME}', input {index} has shape () but every input must have a batch axis 0 "
            f"to be split into micro_size={micro_size} micro-batches.")
    if shape[0] < 0:
        raise ValueError(
            f"For '{_CLS_NAME}', input {index} has a dynamic batch size (shape {shape}); the batch size must be "
            f"static to be split into micro_size={micro_size} micro-batches.")
    if shape[0] != first_shape[0]:
        raise ValueError(
            f"For '{_CLS_NAME}', all inputs must have the same batch size (axis 0) to be split together, "
            f"but input 0 has shape {first_shape} and input {index} has shape {shape}.")
    batch = shape[0]
    if batch % micro_size != 0:
        choices = ", ".join(str(d) for d in _divisors(batch)[:6]) or "none above 1"
        raise ValueError(
            f"For '{_CLS_NAME}', the batch size of input {index} (shape {shape}) must be divisible by "
            f"micro_size={micro_size}, but {batch} % {micro_size} = {batch % micro_size}. Rows are never dropped: "
            f"either batch the dataset with drop_remainder=True and a batch size divisible by {micro_size}, "
            f"or choose a micro_size that divides {batch} (divisors: {choices}).")


@_primexpr
def check_loss_shape(shape: tuple) -> None:
    """The wrapped network must return one scalar per micro-batch."""
    if shape:
        raise ValueError(
            f"For '{_CLS_NAME}', the argument 'network' must return a scalar loss (shape ()), but it returned "
            f"shape {shape}. Reduce the loss inside the network, e.g. with reduction='mean' in the loss function.")


def split_batch(inputs: tuple, micro_size: int) -> Tuple:
    """Reshape every input from ``(B, ...)`` to ``(micro_size, B // micro_size, ...)``; no copy of rows is lost."""
    first_shape = inputs[0].shape
    split = ()
    for index, x in enumerate(inputs):
        check_input_shape(index, x.shape, first_shape, micro_size)
        split += (x.reshape((micro_size, x.shape[0] // micro_size) + x.shape[1:]),)
    return split


def micro_batch(split: tuple, i) -> Tuple:
    """Micro-batch ``i`` (a Tensor counter, so the loop over micro-batches is not unrolled) of every input."""
    micro = ()
    for x in split:
        micro += (ops.gather(x, i, 0),)
    return micro
