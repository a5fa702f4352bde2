"""Random draws held fixed across passes (the value comparison, diagnostics.contract): two passes of a network on
inputs of one shape draw the same values, whatever random ops it holds, and the process's random state is as it was
after.

What MindSpore draws from (mindspore/common/seed.py, generator.py; checked 2.7.0-2.10.0):
- functional ops (``ops.uniform``, ``ops.randn``, ``ops.dropout``, ...) take their seeds from the global seed and a
  per-kernel counter (``_GLOBAL_SEED``, ``_KERNEL_SEED``), or from the default generator;
- a random primitive held by a cell (``nn.Dropout``'s ``ops.Dropout``, marked ``side_effect_hidden``) keeps its own
  state from its first launch on: only a fresh primitive with fixed seeds draws the same values twice (measured:
  ``ms.set_seed`` before each pass does not repeat ``nn.Dropout``'s mask).
:class:`HeldDraws` sets the first two to fixed values before each pass and gives each such primitive a fresh copy with
fixed seeds for the pass; on exit, the primitives, the global seed, the kernel counters and the default generator's
state are put back (``ms.set_seed`` would also reseed NumPy and the dataset pipeline: it is not called).
"""
import contextlib
import importlib

from mindspore import nn, ops

# By module path: ``mindspore.common.seed`` and ``.generator`` are also names of functions in ``mindspore.common``.
_seed = importlib.import_module("mindspore.common.seed")
_generator = importlib.import_module("mindspore.common.generator")

_HELD_SEED = 20261129   # any fixed value: the passes only need the same draws as each other
_SEED_NAMES = ("Seed0", "Seed1", "seed", "seed2")


def random_primitives(network: nn.Cell) -> list:
    """``[(cell, attribute, primitive), ...]``: the random primitives the cells of `network` hold as attributes (those
    MindSpore marks ``side_effect_hidden``: dropout, uniform, normal, ...), found by what they are, not by names."""
    found = []
    for _, cell in network.cells_and_names():
        for attribute, value in list(vars(cell).items()):
            if isinstance(value, ops.Primitive) and value.attrs.get("side_effect_hidden"):
                found.append((cell, attribute, value))
    return found


def _fresh(primitive: ops.Primitive) -> ops.Primitive:
    """A new primitive of `primitive`'s class and arguments, with fixed seeds."""
    arguments = {name: (_HELD_SEED if name in _SEED_NAMES else value)
                 for name, value in primitive.init_attrs.items()}
    return type(primitive)(**arguments)


class HeldDraws(contextlib.AbstractContextManager):
    """Inside ``with HeldDraws(network) as held:``, ``held.repeat()`` before each pass makes the pass draw what the
    previous one drew on inputs of the same shape (see the module docstring). ``held.complete`` is False where a random
    primitive could not be copied (its draws then differ between passes)."""

    def __init__(self, network: nn.Cell):
        self._held = random_primitives(network)
        self.complete = True

    def __enter__(self):
        self._global_seed = _seed._GLOBAL_SEED   # pylint: disable=protected-access
        self._kernel_seeds = dict(_seed._KERNEL_SEED)   # pylint: disable=protected-access
        self._state = _generator.get_rng_state()
        return self

    def repeat(self) -> None:
        """Draws from here on repeat those after the previous call (before the first pass: the first pass's)."""
        _seed._GLOBAL_SEED = _HELD_SEED   # pylint: disable=protected-access
        _seed._KERNEL_SEED.clear()   # pylint: disable=protected-access
        _generator.default_generator.manual_seed(_HELD_SEED)
        for cell, attribute, primitive in self._held:
            try:
                setattr(cell, attribute, _fresh(primitive))
            except Exception:  # pylint: disable=broad-except
                self.complete = False

    def __exit__(self, *exc):
        for cell, attribute, primitive in self._held:
            setattr(cell, attribute, primitive)
        _seed._GLOBAL_SEED = self._global_seed   # pylint: disable=protected-access
        _seed._KERNEL_SEED.clear()   # pylint: disable=protected-access
        _seed._KERNEL_SEED.update(self._kernel_seeds)   # pylint: disable=protected-access
        _generator.set_rng_state(self._state)
        return False


@contextlib.contextmanager
def random_state_kept():
    """The global seed, the per-kernel seed counters and the default generator's state put back after the block: a
    compile of the network that is not a step (the loss contract's graph, ``_mindspore.frontend``) takes its random ops'
    seeds from these counters, and would shift the draws of every graph compiled after it."""
    global_seed = _seed._GLOBAL_SEED   # pylint: disable=protected-access
    kernel_seeds = dict(_seed._KERNEL_SEED)   # pylint: disable=protected-access
    state = _generator.get_rng_state()
    try:
        yield
    finally:
        _seed._GLOBAL_SEED = global_seed   # pylint: disable=protected-access
        _seed._KERNEL_SEED.clear()   # pylint: disable=protected-access
        _seed._KERNEL_SEED.update(kernel_seeds)   # pylint: disable=protected-access
        _generator.set_rng_state(state)
