"""The one place the package runs the user's network outside a graph: the loss contract's value comparison and the
tries behind the error context (diagnostics.failures) both call :func:`run_eagerly`, which puts the network back as it
found it.
"""
import contextlib
from typing import Optional

import numpy as np

from mindspore import nn, ops, Tensor

from ms_gradaccum._mindspore.graph import eager_mode
from ms_gradaccum._mindspore.surroundings import call_state_kept
from ms_gradaccum.core.microbatch import SPLIT, assemble, micro_batch_rows, split_as_compiled
from ms_gradaccum.core.validation import is_batch_statistic


@contextlib.contextmanager
def _switched_off(cells: list, flag: str, set_flag: str):
    """Each of `cells` with its boolean `flag` set False through its method `set_flag` for the duration, put back."""
    kept = [(cell, getattr(cell, flag)) for cell in cells]
    try:
        for cell, _ in kept:
            getattr(cell, set_flag)(False)
        yield
    finally:
        for cell, value in kept:
            getattr(cell, set_flag)(value)


def training_off(cells: list):
    """`cells` in eval mode (``set_train(False)``) for the duration, each put back as it was: batch normalisation then
    normalises with its moving statistics, row by row, as the comparison's passes need."""
    return _switched_off(cells, "training", "set_train")


def own_gradients_off(network: nn.Cell):
    """The cells of `network` not gradient cells of their own (``set_grad(False)``) for the duration, each put back:
    a train cell marks its network so (``nn.TrainOneStepCell``, ``AccumulatingTrainOneStepCell``), and PyNative mode
    then records that network's calls as a gradient of their own inside the comparison's, whose weights' gradients
    come out wrong (measured: an LM's row mean did not add up over two rows)."""
    return _switched_off([cell for _, cell in network.cells_and_names()], "requires_grad", "set_grad")


@contextlib.contextmanager
def moving_statistics_kept(network: nn.Cell):
    """Puts BatchNorm's moving statistics back as they were: the comparison's pass is not a training step."""
    kept = [(param, Tensor(param.asnumpy())) for name, param in network.parameters_and_names()
            if is_batch_statistic(name)]
    try:
        yield
    finally:
        for param, value in kept:
            ops.assign(param, value)


class BatchRows:
    """The owner's `inputs` as `engine`'s graph splits them, for the passes that run the network on some of the batch's
    rows (the loss contract's check, the error context's tries): the one place they are split."""

    def __init__(self, engine: nn.Cell, inputs: tuple):
        self.split, self.shared, self.constants, self.layout = split_as_compiled(engine, inputs)
        self.batch = self.split[0].shape[0]
        self.micro_rows = micro_batch_rows(self.batch, engine.micro_size)   # each micro-batch's rows, in order

    def rows(self, start: int, stop: int, whole: Optional[int] = None) -> tuple:
        """The network's inputs for the batch's rows ``[start, stop)``; the split input `whole` (its index among the
        split ones), if given, whole."""
        micro = tuple(x if index == whole else x[start:stop] for index, x in enumerate(self.split))
        return assemble(micro, self.shared, self.constants, self.layout)

    @property
    def positions(self) -> list:
        """The network's input position of each split input, in the split inputs' order."""
        return [position for position, (role, _) in sorted(enumerate(self.layout), key=lambda item: item[1][1])
                if role == SPLIT]

    def arrays(self, spans: list) -> list:
        """The split inputs' rows in `spans` (``[(start, stop), ...]``), one after the other, as NumPy arrays (to be
        changed and given back to :meth:`inputs_of`)."""
        return [np.concatenate([x[start:stop].asnumpy() for start, stop in spans]) for x in self.split]

    def inputs_of(self, arrays: list) -> tuple:
        """The network's inputs with the split ones from `arrays` (:meth:`arrays`), each a Tensor of its own: MindSpore
        2.7's PyNative gradient of a pass given a slice of a Tensor (a view) is not the slice's."""
        return assemble(tuple(Tensor(a) for a in arrays), self.shared, self.constants, self.layout)

    def spans(self, spans: list) -> tuple:
        """The network's inputs for the batch's rows in `spans`, one after the other (:meth:`arrays`)."""
        return self.inputs_of(self.arrays(spans))


def runs_on(network: nn.Cell, args: tuple) -> bool:
    """Whether `network` runs eagerly on `args` (:func:`run_eagerly`) without raising."""
    try:
        run_eagerly(network, [args])
    except Exception:  # pylint: disable=broad-except
        return False
    return True


def run_eagerly(network: nn.Cell, calls: list, before_each=None) -> list:
    """The one place the package runs the user's network outside a graph (the loss contract's check, and the error
    decoration's tries): its forward pass on each argument tuple of `calls`, eagerly (PyNative mode, no gradient
    unless `network` takes one itself), each output read at once (PyNative runs
    asynchronously: an error surfaces when a result is read). BatchNorm's moving statistics and what cells' own
    ``__call__`` set are put back after, so the passes leave the network as they found it. `before_each`, if given, is
    called before each call (``HeldDraws.repeat``)."""
    outputs = []
    with eager_mode(), moving_statistics_kept(network), call_state_kept(network):
        for args in calls:
            if before_each is not None:
                before_each()
            out = network(*args)
            for item in out if isinstance(out, (tuple, list)) else (out,):
                if hasattr(item, "asnumpy"):
                    item.asnumpy()
            outputs.append(out)
    return outputs
