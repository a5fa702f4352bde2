"""The weights of a ``mindspore.grad`` / ``value_and_grad`` call (functional style, no train cell), from the grad call
:func:`.surroundings.read_stack` found.

MindSpore's ``_Grad.__call__`` and ``GradOperation.__call__`` (mindspore/ops/composite/base.py) return a closure
``after_grad`` over ``fn`` and ``weights``. In PyNative mode its frame is on the stack while ``fn`` runs (``weights``
among its locals). In graph mode it is a jit function being compiled: the ``func`` of the jit wrapper's
``staging_specialize`` frame, ``weights`` in its closure. Called inside the user's own jit function (MindSpore's
functional recipe, ``@ms.jit def train_step``), the grad function is inlined by the parser and leaves no frame: the
grad functions are then looked up among the names that jit function uses (its globals and closure) and those of the
functions it calls, two levels down, and the union of their weights is taken. A grad function reached otherwise (an
object's attribute) is not found; then the ``requires_grad=True`` weights are accumulated. Checked 2.7.0 to 2.10.0.
Imported only where no optimizer is found around the cell.
"""
from typing import Optional

import mindspore as ms
from mindspore import nn

from ms_gradaccum._mindspore.surroundings import Stack, distinct, is_after_grad_code, read_stack


def _is_after_grad(function) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and is_after_grad_code(code) and bool(function.__closure__)


def closure(function) -> dict:
    """The names a function's closure binds (its free variables), with their values."""
    return {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ())
            if name != "__class__"}


def _unwrap_jit(function):
    """The function a ``mindspore.jit`` wrapper compiles (the `func` in its closure), or `function` itself."""
    if getattr(function, "__wrapped_by_jit__", False) and getattr(function, "__closure__", None):
        return closure(function).get("func", function)
    return function


def _weights_of(variables: dict) -> Optional[list]:
    weights = variables.get("weights")
    if weights is None:
        return None
    weights = [weights] if isinstance(weights, ms.Parameter) else list(weights)
    return weights if all(isinstance(weight, ms.Parameter) for weight in weights) else None


def _grad_functions_used_by(function, depth: int = 2) -> list:
    """The grad functions (after_grad closures) a user's jit function refers to by name (its globals and closure),
    and those of the plain functions it refers to, `depth` levels down."""
    code = getattr(function, "__code__", None)
    if code is None:
        return []
    used = [getattr(function, "__globals__", {}).get(name) for name in code.co_names]
    used += list(closure(function).values())
    found = []
    for candidate in map(_unwrap_jit, used):
        if _is_after_grad(candidate):
            found.append(candidate)
        elif depth > 0 and callable(candidate) and not isinstance(candidate, (type, nn.Cell)):
            found += _grad_functions_used_by(candidate, depth - 1)
    return distinct(found)


def differentiated(grad_call: Optional[tuple]) -> Optional[list]:
    """The ``weights`` of the innermost ``mindspore.grad``/``value_and_grad`` call running or being compiled, as the
    user passed them (``requires_grad=False`` ones included); ``None`` when there is none, when it has no weights,
    or when it cannot be found (see above)."""
    if grad_call is None:
        return None
    kind, found = grad_call
    if kind == "locals":
        return _weights_of(found)
    if _is_after_grad(found):
        return _weights_of(closure(found))
    # All the weights of every grad function it uses: accumulating more weights than one of them differentiates
    # costs buffers, never exactness.
    weights = [_weights_of(closure(grad)) for grad in _grad_functions_used_by(found)]
    return distinct(weight for each in weights if each for weight in each) or None


def differentiated_weights(stack: Optional[Stack] = None) -> Optional[list]:
    """The weights of the innermost grad call on `stack` (the caller's when not given): :func:`differentiated`."""
    return differentiated((stack or read_stack()).grad_call)
