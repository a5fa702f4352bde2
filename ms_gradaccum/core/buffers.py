"""The accumulation buffers, every write into them, and every divisor (design.md, "Data flow").

Buffers are ``Parameter``s (``requires_grad=False``) named ``accu_grads.<weight name>``: gradients are added into them
in place as they are produced, memory accounting that counts Parameters sees them, and checkpoints carry them. Every
write into them is an operation of this module (the adds, the mean of a batch or window, the clearing) but one: under
data parallel, their sum across devices in place (``parallel.data_parallel.InPlaceAllReduce``).
:func:`normalise` turns the tallies into the loss, ``rows * value / max(count, floor)``, and the buffers' divisor,
``scale * max(count, floor) / (devices factor * rows)``.
"""
from typing import Sequence

import numpy as np
from mindspore import nn, ops, Parameter, ParameterTuple, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.graph import primexpr
from ms_gradaccum._mindspore.patches import ZEROS_LIKE
from ms_gradaccum._mindspore.surroundings import own_parameters
from ms_gradaccum._mindspore.version import AUGMENTED_ASSIGNMENT_IN_PLACE
from ms_gradaccum.core.microbatch import plan

GRAD_PREFIX = "accu_grads"
_LOW_PRECISION = (mstype.float16, mstype.bfloat16)


# --- pure functions (unit-tested exactly) -------------------------------------------------------------------------

def count_unit(batch: int, micro_size: int) -> int:
    """The rows of the largest micro-batch when `batch` rows are split into `micro_size`: the unit in which a mean
    loss counts its rows, so that evenly split micro-batches count exactly 1."""
    return plan(batch, micro_size)[0][1]


@primexpr
def unit_of(batch: int, micro_size: int) -> float:
    """:func:`count_unit` while a graph compiles (static shapes), as a float."""
    return float(count_unit(batch, micro_size))


# --- the buffers ----------------------------------------------------------------------------------------------------

def buffer_dtype(weight: Parameter):
    """float32 for float16/bfloat16 weights, so that sums of many micro-batches cannot overflow; else the weight's."""
    return mstype.float32 if weight.dtype in _LOW_PRECISION else weight.dtype


def dtypes_match(weights, buffers) -> bool:
    """Whether every buffer holds its weight's dtype (float32 sums of float16 weights do not)."""
    return all(buffer.dtype == weight.dtype for weight, buffer in zip(weights, buffers))


class GradientBuffers(nn.Cell):
    """The ``<prefix>.<weight>`` buffers of a cell: :meth:`for_weights` returns those of exactly the weights given,
    creating missing ones and dropping the others (a frozen weight costs no memory and is not in checkpoints)."""

    def __init__(self, prefix: str = GRAD_PREFIX):
        super().__init__(auto_prefix=False)
        self.prefix = prefix

    def for_weights(self, weights: Sequence[Parameter]) -> ParameterTuple:
        keys = [f"{self.prefix}.{weight.name}" for weight in weights]
        params = own_parameters(self)
        for key, weight in zip(keys, weights):
            buffer = params.get(key)
            if buffer is None or buffer.shape != weight.shape or buffer.dtype != buffer_dtype(weight):
                self.insert_param_to_cell(key, Parameter(Tensor(np.zeros(weight.shape), buffer_dtype(weight)),
                                                         name=key, requires_grad=False), check_name_contain_dot=False)
        for key in [key for key in params if key not in keys]:
            del params[key]
        return ParameterTuple([params[key] for key in keys])


# --- in-place operations (graph mode: no gradient-sized temporary per weight) ----------------------------------------
# Every write into the buffers is here (the in-place all-reduce across devices aside: parallel.data_parallel): the
# adds of the micro-batches, the mean of a window or a batch, the clearing.
# Each is one HyperMap over the buffers (a Python loop over the weights compiles slower, docs/measurements.md); the
# calls run in the tuple's order, so temporaries exist one at a time.

_HYPER_MAP = ops.HyperMap()

# Primitives, not the ops.cast / ops.assign / ops.assign_add functions: one node per weight, not a subgraph each.
_CAST, _ASSIGN, _ASSIGN_ADD = ops.Cast(), ops.Assign(), ops.AssignAdd()

_add_into = ops.MultitypeFuncGraph("_add_into")
_add_cast_into = ops.MultitypeFuncGraph("_add_cast_into")
_zero = ops.MultitypeFuncGraph("_zero")
_divide = ops.MultitypeFuncGraph("_divide")
_cast_like = ops.MultitypeFuncGraph("_cast_like")
_kept = ops.MultitypeFuncGraph("_kept")
_MASKED_FILL = ops.MaskedFill()


@_add_into.register("Tensor", "Tensor")
def _add_into_buffer(buffer, grad):
    return _ASSIGN_ADD(buffer, grad)


@_add_cast_into.register("Tensor", "Tensor")
def _add_cast_into_buffer(buffer, grad):
    return _ASSIGN_ADD(buffer, _CAST(grad, buffer.dtype))


@_zero.register("Tensor", "Tensor")
def _zero_buffer(after, buffer):
    # The data dependency on `after` orders the write after whatever `after` stands for (e.g. the optimizer).
    return _ASSIGN(buffer, ops.depend(ZEROS_LIKE(buffer), after))


@_divide.register("Tensor", "Tensor")
def _divide_buffer(divisor, buffer):
    return _in_place(buffer, _CAST(divisor, buffer.dtype), divide=True)


@_cast_like.register("Tensor", "Tensor")
def _cast_like_tensor(tensor, like):
    return _CAST(tensor, like.dtype)


def _in_place(buffer, operand, divide: bool):
    """``buffer / operand`` (or ``*``), `operand` already in the buffer's dtype, written into the buffer and returned.
    In graph mode ``/=`` and ``*=`` on a Parameter run in place (InplaceDiv/InplaceMul: no gradient-sized temporary)
    from MindSpore 2.8 on; before (2.7, _mindspore.version), the result is assigned to the buffer."""
    if AUGMENTED_ASSIGNMENT_IN_PLACE:
        if divide:
            buffer /= operand
        else:
            buffer *= operand
        return buffer
    return _ASSIGN(buffer, buffer / operand if divide else buffer * operand)


def add_gradients(buffers, grads, after, cast: bool):
    """``buffers += grads``, in place, in the order given (the engine gives the last weight first), each gradient cast
    to its buffer's dtype when `cast` (a compile-time constant). Returns `after` made to depend on the writes."""
    if cast:
        return ops.depend(after, _HYPER_MAP(_add_cast_into, buffers, grads))
    return ops.depend(after, _HYPER_MAP(_add_into, buffers, grads))


@_kept.register("Tensor", "Tensor")
def _kept_gradient(dropped, grad):
    return _MASKED_FILL(grad, dropped, _CAST(0.0, grad.dtype))


def kept_gradients(grads, keep):
    """`grads` where `keep` (a bool scalar Tensor), else zeros: a micro-batch that adds nothing (its count is 0, its
    loss 0/0) leaves its NaN gradients out. Not a product: NaN times 0 is NaN."""
    return _HYPER_MAP(ops.partial(_kept, ops.logical_not(keep)), grads)


def multiply_in_place(buffer, numerator, denominator):
    """``buffer * (numerator / denominator)``, the factor taken in the buffer's dtype, written into the buffer and
    returned (GradientOf's backward: the product is the weight's gradient)."""
    return _in_place(buffer, _CAST(numerator, buffer.dtype) / _CAST(denominator, buffer.dtype), divide=False)


def divide_in_place(buffers, divisor):
    """Each buffer / `divisor` (a scalar Tensor), written into the buffer; returns the buffers (a window's mean).
    MindSpore drops the divisions when nothing reads the quotients: make what follows depend on them."""
    return _HYPER_MAP(ops.partial(_divide, divisor), buffers)


def zero_buffers(buffers, after):
    """buffers = 0, in place, in program order, once `after` has been computed; returns `after` made to depend on the
    writes."""
    return ops.depend(after, _HYPER_MAP(ops.partial(_zero, after), buffers))


def cast_like(tensors, weights):
    """Each tensor cast to its weight's dtype, for the optimizer."""
    return _HYPER_MAP(_cast_like, tensors, weights)


# --- divisors -------------------------------------------------------------------------------------------------------

def divisor(scale, count, factor):
    """What the buffers are divided by for the mean gradient: ``scale * count / factor``, or infinity when the count
    is 0 (nothing to learn from: the mean gradient is then exactly 0, not 0/0)."""
    value = scale * count / factor
    return ops.select(count > 0, value, ops.fill(mstype.float32, (), float("inf")))


def normalise(scale, value, count, factor, floor, rows):
    """``(loss, divisor)`` of a batch or window from what its micro-batches tallied, for every kind of loss:
    ``loss = rows * value / max(count, floor)`` and the buffers' divisor ``scale * max(count, floor) / (factor * rows)``
    (0 and infinity when that count is 0). `rows` is 1 for a mean or a token mean; the rows themselves for a loss that
    scales with them (``reduction='sum'``: ``count * unit`` for a row loss, the batch's or window's rows for a token
    loss); `floor` is ``min_count`` (0 unless set)."""
    total = ops.maximum(count, floor)
    return rows * mean_loss(value, total), divisor(scale, total, factor * rows)


def mean_loss(value, count):
    """``value / count``, or 0 when the count is 0 (a batch without a single valid token)."""
    return ops.select(count > 0, value / ops.select(count > 0, count, ops.ones_like(count)), ZEROS_LIKE(value))
