"""Parameter-shaped accumulation buffers and scalar window state that live across training steps.

They are ``Parameter``s (``requires_grad=False``) so that checkpoints carry them: a checkpoint taken in the
middle of an accumulation window resumes exactly. Names carry stable prefixes because they end up in
checkpoints: ``accu_grads.<weight name>`` for gradient sums, ``accu_state.<name>`` for counters.
"""
from typing import Sequence

import numpy as np
from mindspore import ops, Parameter, ParameterTuple, Tensor
from mindspore.common import dtype as mstype

GRAD_PREFIX = "accu_grads"
STATE_PREFIX = "accu_state"
_LOW_PRECISION = (mstype.float16, mstype.bfloat16)

_clear = ops.MultitypeFuncGraph("_clear")
_divide = ops.MultitypeFuncGraph("_divide")
_cast_like = ops.MultitypeFuncGraph("_cast_like")


@_clear.register("Tensor", "Tensor")
def _clear_tensor(after, buffer):
    # The data dependency on `after` (the optimizer's result) orders the reset after the gradient is used.
    return ops.assign(buffer, ops.depend(ops.zeros_like(buffer), after))


@_divide.register("Tensor", "Tensor")
def _divide_tensor(divisor, tensor):
    return tensor / ops.cast(divisor, tensor.dtype)


@_cast_like.register("Tensor", "Tensor")
def _cast_like_tensor(tensor, like):
    return ops.cast(tensor, like.dtype)


def gradient_buffers(weights: Sequence[Parameter]) -> ParameterTuple:
    """One zero buffer per weight; float32 for float16/bfloat16 weights, so sums cannot overflow."""
    buffers = []
    for weight in weights:
        dtype = mstype.float32 if weight.dtype in _LOW_PRECISION else weight.dtype
        buffers.append(Parameter(Tensor(np.zeros(weight.shape), dtype), name=f"{GRAD_PREFIX}.{weight.name}",
                                 requires_grad=False))
    return ParameterTuple(buffers)


def state_scalar(name: str, value, dtype=mstype.int32) -> Parameter:
    """A scalar window counter or setting, saved in checkpoints as ``accu_state.<name>``."""
    return Parameter(Tensor(value, dtype), name=f"{STATE_PREFIX}.{name}", requires_grad=False)


def clear(hyper_map, buffers, after):
    """buffers = 0, in place, once ``after`` has been computed."""
    return hyper_map(ops.partial(_clear, after), buffers)


def divided(hyper_map, tensors, divisor):
    """Each tensor / divisor (a scalar Tensor), in the tensor's dtype (float32 buffers for low-precision weights)."""
    return hyper_map(ops.partial(_divide, divisor), tensors)


def cast_like(hyper_map, tensors, weights):
    """Each tensor cast to its weight's dtype, for the optimizer."""
    return hyper_map(_cast_like, tensors, weights)
