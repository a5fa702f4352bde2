"""BatchNorm under accumulation: which choice a cell was given (``batch_norm=``), and the moving statistics once per
optimizer step (docs/design.md, "BatchNorm").

- ``"per_step"`` (the default): each micro-batch is normalised by its own statistics (the kernel's), but the moving
  mean and variance move once per optimizer step, from every micro-batch of the step (of every batch of a window)
  combined exactly: :class:`MovingStatistics`.
- ``"frozen"``: every BatchNorm cell normalises with its moving statistics (``use_batch_statistics=False``, set on the
  cells by :func:`freeze`); the rows are then independent and accumulation is exact.
- ``"micro"``: the kernel's own update on every micro-batch (what MindSpore's and the other libraries' accumulation do).

How :class:`MovingStatistics` reads a micro-batch's statistic without a second pass over its activations: the BatchNorm
kernel updates ``moving = (1 - p) * moving + p * s`` in place (``p`` is the primitive's momentum, ``1 - momentum`` of
the cell), so from the moving value before and after a micro-batch ``s = before + (after - before) / p``, the
micro-batch's mean and variance as the backend's kernel computes them (unbiased on CPU, measured). The moving value is
then put back, so that every micro-batch starts from the step's; the statistics are combined with their counts (the
elements per channel of the cell's input, read from its shape while the graph compiles: ``_mindspore.batch_norm``) as
Chan's parallel variance does, in two C-sized buffers and a count per layer (``accu_state.batch_norm.*``, in
checkpoints: a resume inside a window is exact); when the optimizer steps, ``moving = (1 - p) * moving + p *
combined``, with the combined variance unbiased as the kernel's. The error of ``s`` is divided by ``p`` and multiplied
by ``p`` again in that update: the moving statistics keep float32's precision.
"""
import weakref
from typing import Optional

from mindspore import nn, ops, Parameter, ParameterTuple, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.batch_norm import watch
from ms_gradaccum._mindspore.graph import primexpr
from ms_gradaccum.core.validation import argument_error, batch_norm_cells, is_batch_statistic

MODES = ("per_step", "frozen", "micro")
DEFAULT = "per_step"
STATE_PREFIX = "accu_state.batch_norm"
# The cells whose update rule the package reads (their training primitive's momentum): MindSpore's own.
KNOWN_CELLS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.SyncBatchNorm)


def check_batch_norm(value, cls_name: str) -> Optional[str]:
    """`value` if it is None or one of :data:`MODES`; else the error naming the argument, the value and the choices."""
    if value is None or (isinstance(value, str) and value in MODES):
        return value
    expected = "None or one of 'per_step', 'frozen', 'micro'"
    raise (ValueError if isinstance(value, str) else TypeError)(argument_error(cls_name, "batch_norm", expected,
                                                                               value))


def statistics_cells(network: nn.Cell) -> list:
    """``[(path, cell)]``: the cells of `network` that own moving statistics (``moving_mean`` and ``moving_variance``,
    as ``core.validation.is_batch_statistic`` names them) and normalise with batch statistics in training
    (``use_batch_statistics`` not False)."""
    found = []
    for name, cell in network.cells_and_names():
        own = [param.name for param in cell.get_parameters(expand=False) if is_batch_statistic(param.name)]
        batch_statistics = getattr(cell, "use_batch_statistics", None) is not False
        if (len(own) >= 2 or isinstance(cell, KNOWN_CELLS)) and batch_statistics:
            found.append((name or "network", cell))
    return found


def momentum_of(cell: nn.Cell) -> Optional[float]:
    """The momentum ``p`` of `cell`'s training primitive (``moving = (1 - p) * moving + p * s``), or None where the
    package cannot read how the cell updates its moving statistics (a cell of one's own)."""
    if not isinstance(cell, KNOWN_CELLS):
        return None
    return float(cell.bn_train.momentum)


def freeze(network: nn.Cell, cls_name: str) -> list:
    """``batch_norm='frozen'``: every cell of `network` that normalises with batch statistics gets
    ``use_batch_statistics=False`` (MindSpore's switch: normalise with the moving statistics and update none, in
    training too; None puts MindSpore's default back). Returns the paths set. A cell without that switch is refused."""
    cells = batch_norm_cells(network, cells=True)
    names = {id(cell): name or "network" for name, cell in network.cells_and_names()}
    unknown = [names[id(cell)] for cell in cells if not hasattr(cell, "use_batch_statistics")]
    if unknown:
        raise ValueError(
            f"For '{cls_name}', the argument 'batch_norm' is 'frozen', but the network's cells {', '.join(unknown)} "
            f"hold moving statistics without MindSpore's use_batch_statistics switch, so the cell cannot make them "
            f"normalise with their moving statistics. Give those cells that switch (or build them from "
            f"mindspore.nn.BatchNorm1d/BatchNorm2d), or pass batch_norm='per_step' or 'micro'.")
    for cell in cells:
        cell.use_batch_statistics = False
    return [names[id(cell)] for cell in cells]


class _Seen:
    """What one BatchNorm cell's input check saw while graphs holding it compiled (``_mindspore.batch_norm``): per
    leading dimension of its input, the input's shape and whether it normalised with batch statistics (so updated its
    moving ones). Kept per leading dimension, not as the last shape seen: a batch that splits unevenly compiles the
    network for two micro-batch sizes, and each loop body reads the shape of its own rows whatever the order in which
    MindSpore compiles and reads them."""

    def __init__(self, path: str):
        self.path = path
        self.by_rows = {}

    def __call__(self, shape: tuple, training: bool, use_batch_statistics) -> None:
        if shape:
            self.by_rows[shape[0]] = (shape, use_batch_statistics is True or
                                      (use_batch_statistics is None and training))

    def elements(self, rows: int, channels: int) -> int:
        """The elements per channel of the cell's input for a micro-batch of `rows` rows (0: the cell did not update its
        moving statistics there, or did not run): among the inputs it normalised with batch statistics (not the loss
        contract's eager passes, in inference mode), the one whose leading dimension is `rows` (a batch axis), or the
        one multiple of it (rows merged with another axis, ``(B * T, C)``); several multiples stop."""
        training = {first: shape for first, (shape, updates) in self.by_rows.items() if updates}
        shape = training.get(rows)
        if shape is None:
            multiples = [shape for first, shape in training.items() if first > rows and first % rows == 0]
            if len(multiples) > 1:
                raise ValueError(
                    f"For the BatchNorm cell {self.path}, batch_norm='per_step' cannot tell which of its inputs "
                    f"({', '.join(str(shape) for shape in multiples)}) a micro-batch of {rows} rows gives: its "
                    f"input's leading axis is not the batch axis. Pass batch_norm='micro' or 'frozen'.")
            shape = multiples[0] if multiples else None
        if shape is None:
            return 0
        size = 1
        for dim in shape:
            size *= dim
        return size // channels


@primexpr
def _elements(seen: _Seen, channels: int, rows: int, after: tuple) -> int:
    """:meth:`_Seen.elements` while the loop body of `rows`-row micro-batches compiles; `after` (the micro-batch's
    loss shape) orders this after the body's network."""
    return seen.elements(rows, channels)


class MovingStatistics(nn.Cell):
    """The moving statistics of `network`'s BatchNorm cells, once per optimizer step (the module docstring).

    Graph side, for the engine's loop and its owner: :meth:`before` (a micro-batch is about to run), :meth:`after`
    (it ran: its statistics combined, the moving values put back), :meth:`apply` (the optimizer steps: the moving
    values updated once, the sums cleared).
    """

    def __init__(self, layers: list):
        super().__init__(auto_prefix=False)
        self.paths = [path for path, _, _ in layers]
        self.momenta = [momentum for _, _, momentum in layers]
        # The network's own Parameters, plain attributes (not registered a second time).
        object.__setattr__(self, "means", ParameterTuple([cell.moving_mean for _, cell, _ in layers]))
        object.__setattr__(self, "variances", ParameterTuple([cell.moving_variance for _, cell, _ in layers]))
        self.channels = [int(cell.moving_mean.shape[0]) for _, cell, _ in layers]
        # A synchronised BatchNorm's statistic is over every rank of its group: counted so.
        self.ranks = [int(getattr(cell, "group_device_num", 1)) if getattr(cell, "is_global", False) else 1
                      for _, cell, _ in layers]
        sums, squares, counts = [], [], []
        for path, channels in zip(self.paths, self.channels):
            sums.append(self._buffer(f"{path}.mean", (channels,)))
            squares.append(self._buffer(f"{path}.m2", (channels,)))
            counts.append(self._buffer(f"{path}.count", ()))
        self.sums, self.squares, self.counts = ParameterTuple(sums), ParameterTuple(squares), ParameterTuple(counts)
        seen = tuple(_Seen(path) for path in self.paths)
        object.__setattr__(self, "seen", seen)
        undo = [watch(cell, one) for (_, cell, _), one in zip(layers, seen)]
        # Undo: the cells' input checks are their class's again when this object goes (or on release()).
        object.__setattr__(self, "_release", weakref.finalize(self, _undo_all, undo))

    def _buffer(self, name: str, shape: tuple) -> Parameter:
        key = f"{STATE_PREFIX}.{name}"
        value = Parameter(Tensor(0.0 if not shape else [0.0] * shape[0], mstype.float32), name=key,
                          requires_grad=False)
        self.insert_param_to_cell(key, value, check_name_contain_dot=False)
        return value

    def release(self) -> None:
        """Puts the BatchNorm cells' own input checks back (``_mindspore.batch_norm``)."""
        self._release()

    def state_parameters(self) -> list:
        return list(self.sums) + list(self.squares) + list(self.counts)

    # --- graph side -----------------------------------------------------------------------------------------------

    def before(self):
        """The moving statistics before a micro-batch runs (values, not references)."""
        values = ()
        for mean, variance in zip(self.means, self.variances):
            values += ((ops.cast(mean, mstype.float32) * 1.0, ops.cast(variance, mstype.float32) * 1.0),)
        return values

    def after(self, before, rows: int, ran, loss_shape: tuple):
        """After a micro-batch of `rows` rows ran (`ran` exists then): each cell's statistic of it read from its moving
        values, combined into the sums (Chan), and its moving values put back to `before`. Returns `ran` made to depend
        on the writes."""
        for index in range(len(self.paths)):
            elements = _elements(self.seen[index], self.channels[index], rows, loss_shape)
            momentum = self.momenta[index]
            if elements > 0 and momentum > 0:
                ran = self._combine(index, before[index], float(elements * self.ranks[index]), momentum, ran)
        return ran

    def _combine(self, index: int, before, elements: float, momentum: float, ran):
        mean_param, variance_param = self.means[index], self.variances[index]
        moved_mean = ops.cast(ops.depend(mean_param, ran), mstype.float32)
        moved_variance = ops.cast(ops.depend(variance_param, ran), mstype.float32)
        mean = before[0] + (moved_mean - before[0]) / momentum
        # Chan et al.: the running (count, mean, sum of squared deviations) and this micro-batch's.
        count, total, squares = self.counts[index], self.sums[index], self.squares[index]
        together = count + elements
        delta = mean - total
        unbiased = before[1] + (moved_variance - before[1]) / momentum
        moved = squares + delta * delta * (count * elements / together)
        if elements > 1:   # one element has no deviation of its own (the kernel's unbiased variance of it is 0/0)
            moved = moved + unbiased * (elements - 1.0)
        ran = ops.depend(ran, ops.assign(squares, moved))
        ran = ops.depend(ran, ops.assign(total, total + delta * (elements / together)))
        ran = ops.depend(ran, ops.assign(count, together))
        ran = ops.depend(ran, ops.assign(mean_param, ops.cast(before[0], mean_param.dtype)))
        return ops.depend(ran, ops.assign(variance_param, ops.cast(before[1], variance_param.dtype)))

    def apply(self, done):
        """When the optimizer steps (`done` exists then): each cell's moving statistics moved once, by the statistic
        of every micro-batch since the last step combined (the variance unbiased, as the kernel's); the sums cleared.
        A cell that saw nothing (no micro-batch in training mode) keeps its values. Returns `done` made to depend on
        the writes."""
        for index in range(len(self.paths)):
            momentum = self.momenta[index]
            count, total, squares = self.counts[index], self.sums[index], self.squares[index]
            mean_param, variance_param = self.means[index], self.variances[index]
            seen = count > 0
            unbiased = squares / ops.maximum(count - 1.0, 1.0)
            new_mean = (1.0 - momentum) * ops.cast(mean_param, mstype.float32) + momentum * total
            new_variance = (1.0 - momentum) * ops.cast(variance_param, mstype.float32) + momentum * unbiased
            done = ops.depend(done, ops.assign(mean_param, ops.cast(
                ops.select(seen, new_mean, ops.cast(mean_param, mstype.float32)), mean_param.dtype)))
            done = ops.depend(done, ops.assign(variance_param, ops.cast(
                ops.select(seen, new_variance, ops.cast(variance_param, mstype.float32)), variance_param.dtype)))
            for buffer in (count, total, squares):
                done = ops.depend(done, ops.assign(buffer, ops.zeros_like(buffer)))
        return done


def _undo_all(undo: list) -> None:
    for one in undo:
        one()


def moving_statistics(network: nn.Cell, mode: Optional[str], cls_name: str, splits: bool) -> Optional[MovingStatistics]:
    """The :class:`MovingStatistics` of `network` where the moving statistics move once per step (`mode` None or
    'per_step', and the cell splits or sums batches: `splits`); None where there is nothing to combine. An explicit
    'per_step' on a cell whose update rule cannot be read is refused; by default such a cell updates per micro-batch
    (the construction warning says so)."""
    if mode not in (None, "per_step") or not splits:
        return None
    layers, unknown = [], []
    for path, cell in statistics_cells(network):
        momentum = momentum_of(cell)
        if momentum is None:
            unknown.append(path)
        else:
            layers.append((path, cell, momentum))
    if unknown and mode == "per_step":
        raise ValueError(
            f"For '{cls_name}', the argument 'batch_norm' is 'per_step', but the network's cells {', '.join(unknown)} "
            f"hold moving statistics whose update the cell cannot read (only mindspore.nn.BatchNorm1d, "
            f"BatchNorm2d, BatchNorm3d and SyncBatchNorm are read). Pass batch_norm='micro' (each micro-batch updates "
            f"them) or 'frozen' (normalise with the moving statistics: exact), or build those cells from "
            f"MindSpore's BatchNorm.")
    return MovingStatistics(layers) if layers else None
