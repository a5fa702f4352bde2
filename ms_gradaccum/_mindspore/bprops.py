"""Which cells' own ``bprop`` calls ``mindspore.ops.zeros_like``: named in the error where the patch that separates
autodiff's zeros_like from it (.patches.AUTODIFF_ZEROS_LIKE) cannot be applied. Imported only then."""
import ast
import inspect
import textwrap
from typing import Optional

import mindspore as ms
from mindspore import nn

from ms_gradaccum._mindspore.patches import ZEROS_LIKE_FUNCTION


def closure(function) -> dict:
    """The names a function's closure binds (its free variables), with their values."""
    return {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ())
            if name != "__class__"}


def _resolves_to_zeros_like(node, namespace: dict) -> bool:
    """Whether a call's function expression (`zeros_like`, `ops.zeros_like`, `F.zeros_like`) is that function."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id) is ZEROS_LIKE_FUNCTION
    if isinstance(node, ast.Attribute) and node.attr == "zeros_like":
        base = node.value
        owner = namespace.get(base.id) if isinstance(base, ast.Name) else None
        return getattr(owner, "zeros_like", None) is ZEROS_LIKE_FUNCTION
    return False


def _folded(test, cell) -> Optional[bool]:
    """The value of an `if` test MindSpore folds when it compiles (a constant, `self.<attribute>`, `not` of those);
    None when it depends on the inputs."""
    if isinstance(test, ast.Constant):
        return bool(test.value)
    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and test.value.id == "self" and \
            not isinstance(getattr(cell, test.attr, None), (ms.Tensor, nn.Cell)):
        return bool(getattr(cell, test.attr, None))
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _folded(test.operand, cell)
        return None if inner is None else not inner
    return None


def _calls_zeros_like(function, cell) -> bool:
    """Whether `function` (a bprop) calls mindspore.ops.zeros_like outside the branches MindSpore folds away."""
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    namespace = dict(getattr(function, "__globals__", {}))
    namespace.update(closure(function) if getattr(function, "__closure__", None) else {})
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):   # no source: judge by the names the code uses
        return any(_resolves_to_zeros_like(ast.Name(id=name), namespace) or
                   getattr(namespace.get(name), "zeros_like", None) is ZEROS_LIKE_FUNCTION for name in code.co_names)

    def visit(node) -> bool:
        if isinstance(node, ast.If):
            taken = _folded(node.test, cell)
            branches = [node.body, node.orelse] if taken is None else [node.body if taken else node.orelse]
            return visit(node.test) or any(visit(child) for branch in branches for child in branch)
        if isinstance(node, ast.Call) and _resolves_to_zeros_like(node.func, namespace):
            return True
        return any(visit(child) for child in ast.iter_child_nodes(node))
    return visit(tree)


def bprops_calling_zeros_like(network: nn.Cell) -> list:
    """``["name (Class)", ...]``: the cells of `network` whose own ``bprop`` calls ``mindspore.ops.zeros_like``."""
    return [f"{name or 'network'} ({type(cell).__name__})" for name, cell in network.cells_and_names()
            if _calls_zeros_like(getattr(type(cell), "bprop", None), cell)]
