"""The input shape of a BatchNorm cell while a graph compiles (core.batch_norm counts a micro-batch's elements per
channel from it).

Every ``nn.BatchNorm1d``/``BatchNorm2d``/``SyncBatchNorm`` (``_BatchNorm``) checks its input in ``construct`` through
its static ``_check_input_dim(shape, cls_name)``, a ``_primexpr``: called with the input's static shape when a graph
holding the cell compiles (inside ``nn.SequentialCell`` too, where forward hooks are not run in graph mode) and on
every PyNative call. :func:`watch` gives one cell an instance attribute of that name which calls the class's check and
then `seen(shape, training, use_batch_statistics)`; the function it returns removes it (the class's is used again).
Checked 2.7.0-2.10.0.
"""
import weakref

from mindspore.ops.primitive import _primexpr as primexpr

_NAME = "_check_input_dim"


def watch(cell, seen):
    """Calls ``seen(shape, training, use_batch_statistics)`` whenever `cell` checks its input (see the module
    docstring); returns the undo."""
    original = type(cell).__dict__[_NAME].__func__ if isinstance(type(cell).__dict__.get(_NAME), staticmethod) \
        else getattr(type(cell), _NAME)
    owner = weakref.ref(cell)

    @primexpr
    def check_input_dim(shape, cls_name):
        result = original(shape, cls_name)
        found = owner()
        if found is not None:
            seen(tuple(shape), bool(found.training), found.use_batch_statistics)
        return result

    object.__setattr__(cell, _NAME, check_input_dim)

    def undo():
        found = owner()
        if found is not None and found.__dict__.get(_NAME) is check_input_dim:
            del found.__dict__[_NAME]
    return undo
