"""MindSpore's internals, behind named adapters: the only modules of the package that import a private MindSpore name
(``tests/test_mindspore.py``'s fence checks it). Elsewhere the package writes plain state of the user's cells in one
place, and puts it back: the loss contract's eager passes restore what cells' own ``__call__`` set
(``diagnostics.eager``); nothing is written on the cell the user calls.

- :mod:`.version`: the supported versions (checked on import) and what differs between them.
- :mod:`.graph`: Python run while a graph compiles; eager execution from anywhere.
- :mod:`.surroundings`: the cells around a cell, found on the stack; how ``Model`` routes a
  cell by name and the parallel mode; a Cell's own Parameter dict and precision flags.
- :mod:`.parallel`: what the parallel modes read (communication, the gradient reducer, the batch axis's split).
- :mod:`.patches`: the process-wide changes, each with ``install()`` and ``uninstall()``.
- :mod:`.randomness`: random draws held the same across the loss contract's probe passes, the random state put back.
- :mod:`.bprops`: the cells whose own ``bprop`` calls ``mindspore.ops.zeros_like`` (where that patch cannot apply).
"""
from ms_gradaccum._mindspore import version

version.check_mindspore_version()
