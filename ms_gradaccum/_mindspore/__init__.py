"""MindSpore's internals, behind named adapters: the only modules of the package that import a private MindSpore name,
read another object's private attributes, or write into another object's ``__dict__`` (``tests/test_mindspore.py``'s
fence checks each, and that nothing reads a frame). What they change of a user's cells they put back: a cell's plain
state after an eager pass (``surroundings.call_state_kept``), the random primitives during the value comparison
(``randomness``); nothing is written on the cell the user calls.

- :mod:`.version`: the supported versions (checked on import) and what differs between them.
- :mod:`.graph`: Python run while a graph compiles; eager execution from anywhere.
- :mod:`.surroundings`: the cells around a cell, found walking down from the root a compile is handed; how ``Model``
  routes a cell by name and the parallel mode; a Cell's own Parameter dict, precision flags and plain state.
- :mod:`.parallel`: what the parallel modes read (communication, the gradient reducer, the batch axis's split).
- :mod:`.patches`: the process-wide changes, each with ``install()`` and ``uninstall()``.
- :mod:`.randomness`: draws held the same across the value comparison's passes, the random state put back.
- :mod:`.mindformers`: MindFormers' trainer check, run after the package's (imported by the MindFormers adapter only).
- :mod:`.bprops`: the cells whose own ``bprop`` calls ``mindspore.ops.zeros_like`` (where that patch cannot apply).
"""
from ms_gradaccum._mindspore import version

version.check_mindspore_version()
