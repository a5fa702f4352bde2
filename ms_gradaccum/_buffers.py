"""Parameter-shaped accumulation buffers and scalar window state.

They are ``Parameter``s (``requires_grad=False``): gradients are added into them in place as they are
produced, memory accounting that counts Parameters sees them, and checkpoints carry them, so a checkpoint
taken in the middle of an accumulation window resumes exactly. Names carry stable prefixes because they end up
in checkpoints: ``accu_grads.<weight name>`` for gradient sums, ``accu_state.<name>`` for counters.
"""
from typing import Sequence

import numpy as np
from mindspore import ops, Parameter, ParameterTuple, Tensor
from mindspore.common import dtype as mstype

GRAD_PREFIX = "accu_grads"
STATE_PREFIX = "accu_state"
_LOW_PRECISION = (mstype.float16, mstype.bfloat16)

_cast_like = ops.MultitypeFuncGraph("_cast_like")


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


def clear(buffers, after):
    """buffers = 0, in place, once ``after`` has been computed; one buffer after another, so that only one
    buffer-sized zero tensor exists at a time (all at once they would cost as much as the buffers)."""
    for buffer in buffers:
        # The data dependency on `after` (the optimizer's result) orders the reset after the gradient is used.
        after = ops.depend(after, ops.assign(buffer, ops.depend(ops.zeros_like(buffer), after)))
    return after


def divided_in_place(tensors, divisor):
    """Each tensor / divisor (a scalar Tensor), in the tensor's dtype (float32 buffers for low-precision weights).

    In graph mode ``/=`` divides in place (MindSpore compiles it to InplaceDiv), so the window's mean costs no
    memory; in PyNative mode it is an ordinary division, as correct.
    """
    out = ()
    for tensor in tensors:
        tensor /= ops.cast(divisor, tensor.dtype)
        out += (tensor,)
    return out


def cast_like(hyper_map, tensors, weights):
    """Each tensor cast to its weight's dtype, for the optimizer."""
    return hyper_map(_cast_like, tensors, weights)
