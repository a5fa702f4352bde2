"""What a package cell trains with, bound once and outside any compile: its surroundings (the train cell, the optimizer
and a loss wrapper around it, found by walking down the root MindSpore compiles: ``_mindspore.surroundings.around``)
and, from them, the weights, their buffers, the loss scale's source and the parts a parallel mode needs.

When (nothing else adds, removes or inserts a package cell's Parameters or cells):

- at construction, from its arguments (nothing is around it yet);
- before each compile the package watches (``cells.compile_hook``): the first after construction, the first after a
  train cell is built around it (its ``set_grad``, which ``nn.TrainOneStepCell`` and ``Model`` call) and the first after
  :meth:`BoundCell.rebind`; from the root of that compile;
- in PyNative mode, where nothing compiles and nothing hands over a root, on a call whose network trains other weights
  than those bound (staged fine-tuning): from its arguments.

A graph that compiles otherwise (a ``jit`` function around the cell) uses what was bound last; the compile checks
(``check_at_compile``) compare what is in force with it and stop with the fix, :meth:`BoundCell.rebind`.
"""
from typing import Optional

import mindspore as ms
from mindspore import nn

from ms_gradaccum._mindspore.surroundings import Surroundings, around, child
from ms_gradaccum.cells.compile_hook import compiled_in_jit, done_waiting, expect_compile
from ms_gradaccum.diagnostics.calls import (before_step_compile, compile_error_context, read_after_compile,
                                            read_after_jit_compile, read_first_call)

NOTHING_AROUND = Surroundings()


class BoundCell:
    """Mixed into the package cells (before ``nn.Cell``): :meth:`bind` and when it runs. A cell provides
    ``_bind(found)`` (what it binds from its `found` surroundings) and may provide ``trainable_now()`` (the weights
    whose change it follows)."""

    #: The surroundings last bound (nothing around before the first compile, and in PyNative mode).
    surroundings = NOTHING_AROUND
    #: True during a PyNative call of the cell (:meth:`__call__`): the compile checks run inside it know that no root
    #: was handed over.
    calling_eagerly = False
    #: ``trainable_now()`` when last bound.
    bound_trainable = frozenset()
    #: True from :meth:`before_compile` to the end of that compile (``cells.compile_hook``).
    compiling_from_root = False

    def _bind(self, found: Surroundings) -> None:
        raise NotImplementedError

    def trainable_now(self) -> frozenset:
        """The ids of the weights whose ``requires_grad`` the cell follows (none by default)."""
        return frozenset()

    def bind(self, root: Optional[nn.Cell] = None) -> bool:
        """Binds the cell from what surrounds it in `root`'s tree (`root` None: from its arguments alone); False, and
        nothing bound, where that tree does not hold it. Never while a graph compiles."""
        found = NOTHING_AROUND if root is None else around(self, root)
        if found is None:
            return False
        self._bind(found)
        object.__setattr__(self, "surroundings", found)
        object.__setattr__(self, "bound_trainable", self.trainable_now())
        return True

    def rebind(self) -> None:
        """Binds the cell again: now from its arguments, and from the root of its next compile. Call it after changing
        which weights train (``requires_grad``) or the parallel mode between two trainings of the same cell, where no
        new train cell or ``Model`` is built around it (those rebind it by themselves, as PyNative mode does); the
        compile checks name the change where it is missing."""
        self.bind(None)
        expect_compile(self)

    def set_grad(self, requires_grad=True):
        """``nn.Cell.set_grad``; a train cell built around this one calls it (``nn.TrainOneStepCell``, ``Model``): the
        next compile binds the cell from its root."""
        result = super().set_grad(requires_grad)
        if requires_grad and child(self, "engine") is not None:   # built: not during __init__
            expect_compile(self)
        return result

    def before_compile(self, root: nn.Cell, args: tuple) -> None:
        """Before a compile of `root` on `args` (``cells.compile_hook``): binds from `root`, and prepares the loss
        contract's reading (diagnostics.calls.before_step_compile)."""
        self.bind(root)
        object.__setattr__(self, "compiling_from_root", True)
        before_step_compile(self, root, args)

    def compiled(self, root: nn.Cell, args: tuple) -> bool:
        """After a compile :meth:`before_compile` prepared succeeded, before its graph runs: the loss contract read from
        the compiled step's graph (diagnostics.calls.read_after_compile); raises where it stops. Returns whether the
        step must compile again (a kind other than the compiled one)."""
        return read_after_compile(self, root, args)

    def after_compile(self, failed: bool = False) -> None:
        """After the compile :meth:`before_compile` prepared (``cells.compile_hook``), whether it succeeded or not
        (`failed`: then nothing will read its graph, and a graph compiled elsewhere compares values itself)."""
        object.__setattr__(self, "compiling_from_root", False)
        contract = child(self, "contract")
        if failed and contract is not None:
            contract.reads_step = False

    def expect_jit_compile(self) -> bool:
        """Before a ``jit`` function compiles while this cell waits: the loss contract will be read from its graph if
        it holds this cell (``cells.compile_hook.around_jit_compile``); True where it will."""
        contract = child(self, "contract")
        return contract is not None and contract.expect_step()

    def compiled_in(self, executor, phase: str) -> bool:
        """After a ``jit`` function holding this cell compiled, before it runs: the loss contract read from its graph
        (diagnostics.calls.read_after_jit_compile). Returns whether the function must compile again."""
        return read_after_jit_compile(self, executor, phase)

    def compiled_elsewhere(self) -> None:
        """Called by the compile checks: a graph compiling the cell that the compile hook did not prepare (a ``jit``
        function, which that executor never compiles) means no compile of the hook's will come for it: it stops
        waiting (the hook is undone once none waits). Not in PyNative calls."""
        if not self.calling_eagerly and not self.compiling_from_root:
            compiled_in_jit(self)
            done_waiting(self)

    def __call__(self, *args, **kwargs):
        """In PyNative mode, where nothing compiles: binds the cell where the trained weights changed (from its
        arguments: nothing hands over a root), reads the loss contract where it has not run on inputs of that
        layout (its first call, mostly), and the cell stops waiting for a compile; then the call, with
        :attr:`calling_eagerly` set. Graph mode: ``nn.Cell.__call__`` alone."""
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            return super().__call__(*args, **kwargs)
        if self.surroundings is not NOTHING_AROUND or self.trainable_now() != self.bound_trainable:
            self.bind(None)
        read_first_call(self, args)
        done_waiting(self)
        object.__setattr__(self, "calling_eagerly", True)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            object.__setattr__(self, "calling_eagerly", False)

    def compile_error_context(self, error: Exception, root: nn.Cell, args: tuple):
        return compile_error_context(self, error, root, args)
