"""The package's changes to MindSpore's process-wide state: each an object with ``install()`` (idempotent) and
``uninstall()`` (MindSpore's originals back), installed lazily by the cells that need them; :func:`remove_patches`
(public as ``ms_gradaccum.remove_patches``) undoes them all.

- :data:`AUTODIFF_ZEROS_LIKE`: autodiff's zero gradients get a ``zeros_like`` of their own, so that custom bprops
  calling ``mindspore.ops.zeros_like`` (MindFormers' loss cells) compile inside GradAccumulationCell's nested
  gradient; installed when such a cell compiles, for no other network.
- :data:`GRAPH_COMPILE`: the graph executor's ``compile`` is wrapped, to run hooks around each compile (the loss
  contract read from the compiled step, and the compile once more where it shows another kind) and to let the package
  add context to an error it recognises as its own; :data:`JIT_COMPILE` does the same for ``jit`` functions.

Checked 2.7.0 and 2.10.0.
"""
import contextlib
import sys
import types
from typing import Callable, Optional

from mindspore import ops as _ops
from mindspore.ops.composite.multitype_ops import zeros_like_impl


try:
    from mindspore.graph import api as _api
except ImportError:   # before 2.9
    from mindspore.common import api as _api
CELL_GRAPH_EXECUTOR = _api._cell_graph_executor   # pylint: disable=protected-access

# The package's own graphs make zeros through the primitive, never through the function the patch below separates.
ZEROS_LIKE = _ops.ZerosLike()
ZEROS_LIKE_FUNCTION = _ops.zeros_like
_AUTODIFF_FUNCTIONAL = "ms_gradaccum._autodiff_functional"


class Patch:
    """One change to MindSpore's process-wide state, with its undo."""

    def install(self) -> bool:
        """Applies the change once; True when it is in place."""
        raise NotImplementedError

    def uninstall(self) -> None:
        """Puts MindSpore's originals back (nothing when not installed)."""
        raise NotImplementedError

    @property
    def installed(self) -> bool:
        raise NotImplementedError


# GradAccumulationCell differentiates the network inside a graph that the wrapping train cell differentiates again.
# MindSpore parses the function mindspore.ops.zeros_like into one cached graph per function object, and autodiff makes
# its zero gradients through it (zeros_like_impl.py::_zeros_like_tensor returns `F.zeros_like(x)`, F being
# ops.functional). Reached also from a custom bprop in the network, the graph parsed from it is used by the inner
# gradient and found empty by the outer ("The func graph is empty, func graph: ...zeros_like"). The way around:
# zeros_like_impl's `F` becomes a module of its own in sys.modules (the parser resolves a function's globals through
# the module its namespace names, parser.py::get_module_namespace), holding all ops.functional holds but a copy of
# zeros_like. Both compute exactly what they did (a plain train cell trains bit-identically before and after). Where
# MindSpore is laid out otherwise it is not applied, and the cells name the bprops that call the function (.bprops).
class AutodiffZerosLike(Patch):
    """Autodiff's zeros_like, separated from ``mindspore.ops.zeros_like`` (see above)."""

    def __init__(self):
        self._original = None

    @property
    def installed(self) -> bool:
        functional = getattr(zeros_like_impl, "F", None)
        return isinstance(functional, types.ModuleType) and functional.__name__ == _AUTODIFF_FUNCTIONAL

    def install(self) -> bool:
        if self.installed:
            return True
        functional = getattr(zeros_like_impl, "F", None)
        if not (isinstance(functional, types.ModuleType) and getattr(functional, "zeros_like", None) is
                ZEROS_LIKE_FUNCTION and isinstance(ZEROS_LIKE_FUNCTION, types.FunctionType)):
            return False
        module = types.ModuleType(_AUTODIFF_FUNCTIONAL, functional.__doc__)
        module.__dict__.update({key: value for key, value in functional.__dict__.items()
                                if key not in ("__name__", "__spec__")})
        module.zeros_like = _function_copy(ZEROS_LIKE_FUNCTION)
        self._original = functional
        sys.modules[_AUTODIFF_FUNCTIONAL] = module
        zeros_like_impl.F = module
        return True

    def uninstall(self) -> None:
        if not self.installed:
            return
        zeros_like_impl.F = self._original
        sys.modules.pop(_AUTODIFF_FUNCTIONAL, None)
        self._original = None


def _function_copy(function):
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__dict__.update(function.__dict__)
    copy.__qualname__, copy.__module__, copy.__doc__ = function.__qualname__, function.__module__, function.__doc__
    return copy


# Cell.compile compiles through the graph executor's `compile`, an attribute of one module-level object; Cell's
# compile_and_run calls it on every call, with the call's inputs, before it runs the graph it finds cached.
class GraphCompile(Patch):
    """The graph executor's compile, wrapped: the registered hooks are entered around each compile of a cell on its
    inputs, and an error gets what the registered decorators add to it (their first non-None answer)."""

    def __init__(self):
        self._original = None
        self._own_attribute = False   # the executor held `compile` in its own __dict__ before the install
        self.hooks = []
        self.decorators = []

    @property
    def installed(self) -> bool:
        return self._original is not None and CELL_GRAPH_EXECUTOR.compile is not self._original

    def install(self) -> bool:
        if self.installed:
            return True
        original = CELL_GRAPH_EXECUTOR.compile
        hooks, decorators = self.hooks, self.decorators

        def compile_with_hooks(*args, **kwargs):
            try:
                for _ in range(_COMPILES):
                    with contextlib.ExitStack() as around:
                        answers = [around.enter_context(hook(args[0], args[1:])) for hook in (hooks if args else ())]
                        result = original(*args, **kwargs)
                    if not any(getattr(answer, "again", False) for answer in answers):
                        break
                    forget_compile(args[0], result[0])
                return result
            except Exception as error:
                for decorate in (() if getattr(error, "ms_gradaccum_context", False) else decorators):
                    context = decorate(error, args)
                    if context is not None and error.args and isinstance(error.args[0], str):
                        with_context(error, context)
                        break
                raise

        self._original = original
        self._own_attribute = "compile" in vars(CELL_GRAPH_EXECUTOR)
        CELL_GRAPH_EXECUTOR.compile = compile_with_hooks
        return True

    def uninstall(self) -> None:
        """The executor as it was: its own attribute put back, or the one the install added deleted (its class's
        method is then what ``compile`` finds, as before)."""
        if self.installed:
            if self._own_attribute:
                CELL_GRAPH_EXECUTOR.compile = self._original
            else:
                del CELL_GRAPH_EXECUTOR.compile
        self._original = None

    def around(self, hook: Callable) -> None:
        """Enters ``hook(cell, args)`` (a context manager) around each compile; registered once. Where what it yields
        has ``again`` set once it exits, the graph just compiled is dropped and the cell compiled once more (the hook
        entered again)."""
        if hook not in self.hooks:
            self.hooks.append(hook)

    def decorate_errors(self, decorator: Callable[[Exception, tuple], Optional[str]]) -> None:
        """``decorator(error, args)`` returns what to add to a compile error, or None; registered once."""
        if decorator not in self.decorators:
            self.decorators.append(decorator)


# A compile, and one more where a hook asks for it (the loss contract found a kind other than the compiled one).
_COMPILES = 2


# A `jit` function (a functional training loop) compiles through `mindspore.graph.api._JitExecutor.compile`, which
# returns the phase it compiled (or found cached: `ms_compile_cache`), on every call of the function.
class JitCompile(Patch):
    """The ``jit`` executor's compile, wrapped: the registered hooks are entered around each compile of a ``jit``
    function, as :class:`GraphCompile`'s, each given the executor and the phase once it is known (what they yield gets
    ``phase``); where one sets ``again``, the function compiles once more."""

    def __init__(self):
        self._original = None
        self.hooks = []

    @property
    def installed(self) -> bool:
        return self._original is not None and _api._JitExecutor.compile is not self._original  # pylint: disable=W0212

    def install(self) -> bool:
        if self.installed:
            return True
        original = _api._JitExecutor.compile   # pylint: disable=protected-access
        hooks = self.hooks

        def compile_with_hooks(executor, method_name, *args, **kwargs):
            for _ in range(_COMPILES):
                phase = None
                try:
                    with contextlib.ExitStack() as around:
                        answers = [around.enter_context(hook(executor)) for hook in hooks]
                        phase = original(executor, method_name, *args, **kwargs)
                        for answer in answers:
                            answer.phase = phase
                except Exception:
                    if phase is not None:   # compiled, and a hook stopped it: compiled (and stopped) again next call
                        _forget_jit(executor, phase)
                    raise
                if not any(getattr(answer, "again", False) for answer in answers):
                    break
                _forget_jit(executor, phase)
            return phase

        self._original = original
        _api._JitExecutor.compile = compile_with_hooks   # pylint: disable=protected-access
        return True

    def uninstall(self) -> None:
        if self.installed:
            _api._JitExecutor.compile = self._original   # pylint: disable=protected-access
        self._original = None

    def around(self, hook: Callable) -> None:
        """Enters ``hook(executor)`` (a context manager) around each compile of a ``jit`` function; registered once."""
        if hook not in self.hooks:
            self.hooks.append(hook)


def _forget_jit(executor, phase: str) -> None:
    """Drops what a ``jit`` function's `executor` compiled for `phase`: its next call compiles it anew."""
    _api.ms_compile_cache.discard(phase)
    executor._graph_executor.del_net_res(None, {phase})   # pylint: disable=protected-access


def jit_graph_proto(executor, phase: str) -> bytes:
    """The MindIR of the graph a ``jit`` function's `executor` compiled for `phase`."""
    return executor._graph_executor.get_func_graph_proto(phase, "mind_ir", False)   # pylint: disable=W0212


def forget_compile(cell, phase: str) -> None:
    """Drops the graph of `cell` compiled for `phase`, so that the next compile of that phase builds it anew."""
    cell.compile_cache.discard(phase)
    CELL_GRAPH_EXECUTOR.del_net_res(cell, {phase})


def with_context(error: Exception, context: str) -> None:
    """Puts `context` into `error`'s message after its first line (MindSpore's own), ahead of the stack MindSpore
    appends, where a reader sees it."""
    if error.args and isinstance(error.args[0], str):
        error.ms_gradaccum_context = True
        head, sep, rest = error.args[0].partition("\n")
        error.args = (f"{head}\n\n{context}\n{sep}{rest}" if sep else f"{head}\n\n{context}",) + error.args[1:]


AUTODIFF_ZEROS_LIKE = AutodiffZerosLike()
GRAPH_COMPILE = GraphCompile()
JIT_COMPILE = JitCompile()
# Every process-wide change, by the name remove_patches() reports: MindSpore's here, other libraries' registered by
# the module that makes them (register), when it is imported.
PATCHES = {"autodiff zeros_like": AUTODIFF_ZEROS_LIKE, "graph compile": GRAPH_COMPILE, "jit compile": JIT_COMPILE}


def register(name: str, patch: Patch) -> Patch:
    """Makes `patch` (another library's change, made by an adapter) one that :func:`remove_patches` undoes."""
    PATCHES[name] = patch
    return patch


def remove_patches() -> list:
    """Puts back MindSpore's own objects wherever the package changed them, and returns the names of what it put back
    (``[]`` when nothing was changed). Useful where a process must leave MindSpore as it found it (a test suite).

    What can be in place: autodiff's own ``zeros_like``, installed when a ``GradAccumulationCell`` whose network has a
    ``bprop`` calling ``mindspore.ops.zeros_like`` compiles, and kept for the process after (such a cell installs it
    again at its next compile); the graph executor's and the ``jit`` executor's ``compile`` wrapped while a package
    cell waits for its first compile, and removed by themselves after it (a cell still waiting then compares the first
    two micro-batches' values in its graph instead of being read first); and what an adapter registered
    (``ms_gradaccum.mindformers``: the check run first in MindFormers' ``BaseTrainer._check_grad_accumulation_steps``,
    installed at its import)."""
    removed = [name for name, patch in PATCHES.items() if patch.installed]
    for patch in PATCHES.values():
        patch.uninstall()
    return removed
