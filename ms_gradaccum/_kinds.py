"""Loss kinds: what one micro-batch's loss adds to its batch or window, and how the sums become the loss and the mean
gradient. A kind is one object (as optax's microbatching ``Accumulator``); no other module branches on it.

For each micro-batch (in the graph, and eagerly for the first step's check) a kind is given the network's loss, the
count it returned (1 where it returns none), the micro-batch's rows, the count unit (the rows of the largest
micro-batch of the batch, or of the window's first batch) and the micro-batch's inputs, and returns
``(weight, value, count)`` (:meth:`LossKind.tally`):

- the backward pass runs on ``loss * scale * weight`` (the weight carries no gradient), so the buffers hold
  ``scale * sum(weight * gradient)``;
- ``value`` and ``count`` are summed over the batch or window (and over devices where :attr:`sums_across_ranks`);
- :meth:`LossKind.normalise` turns the sums into ``(loss, divisor)``: the loss the cell returns, and what the buffers
  are divided by for the mean gradient (``_buffers.normalise``: the scale, the count, the devices factor).

Built in (``per_token_loss``, ``reduction`` and ``min_count`` select one, :func:`of_arguments`): :class:`RowMean`,
:class:`RowSum`, :class:`TokenMean`. A kind of one's own subclasses :class:`LossKind` (decorated with
``mindspore.jit_class``) and is passed as ``kind=``; ``tests/test_kinds.py`` writes one (a weighted row mean).
"""
import mindspore as ms
from mindspore import ops, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum import _buffers


@ms.jit_class
class LossKind:
    """What a loss is, for accumulation. Subclasses set the attributes and override :meth:`tally` (and
    :meth:`normalise`, :meth:`compared` where the default does not fit).

    Attributes:
        returns_count (bool): The network returns ``(loss, count)`` (two single-element Tensors), not a loss alone.
        sums_across_ranks (bool): Under data parallel, value and count are summed over devices before normalising
            (a count taken over the batch), instead of each device's mean being averaged by the gradient reducer.
        in_parallel_pass (bool): MindSpore's semi-auto/auto-parallel pass can accumulate it (a row mean only).
        checks_counts (bool): The counts the network returns are checked (finite, >= 0) on every step.
        min_count (float): The floor of the total count a batch or window divides by.
        description (str): What the cell was told the loss is, for messages.
        setting (str): The argument that selects it, for messages.
    """
    returns_count = False
    sums_across_ranks = False
    in_parallel_pass = False
    checks_counts = False
    min_count = 0.0
    description = "a loss of its own kind"
    setting = "kind=..."

    def tally(self, loss, count, rows, unit, inputs):
        """``(weight, value, count)`` of one micro-batch of `rows` rows (an int) whose network returned the float32
        scalars `loss` and `count`; `unit` is the count unit (a float32 scalar), `inputs` the micro-batch's inputs."""
        raise NotImplementedError

    def rows_factor(self, count, unit, rows):
        """What the normalised value is multiplied by: 1 for a mean (the default)."""
        return Tensor(1.0, mstype.float32)

    def normalise(self, scale, value, count, factor, rows, unit):
        """``(loss, divisor)`` from a batch's or window's sums (``_buffers.normalise``); `rows` are its rows (an int
        or a float32 scalar), `factor` the devices factor of ``_reduce.TokenTotals``."""
        return _buffers.normalise(scale, value, count, factor, self.min_count, self.rows_factor(count, unit, rows))

    def empty(self, count):
        """Whether a window with this total count has nothing to learn from (its step is skipped)."""
        return ops.maximum(count, self.min_count) <= 0

    def compared(self, value, count, rows, unit):
        """What the first step's check compares between the network's loss on two micro-batches together and the
        combination of their own (the first is the one the message quotes)."""
        return (self.normalise(Tensor(1.0, mstype.float32), value, count, 1.0, rows, unit)[0],)

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


@ms.jit_class
class RowMean(LossKind):
    """A mean over the rows the network is given (the default): each micro-batch weighs its rows, in count units."""
    in_parallel_pass = True
    description = "a mean over the rows it is given (the default)"
    setting = "reduction='mean'"

    def tally(self, loss, count, rows, unit, inputs):
        weight = rows / unit
        return weight, loss * weight, weight


@ms.jit_class
class RowSum(LossKind):
    """A sum over the rows (or a mean times their number): counted in rows like a mean, but its value and gradient
    taken per row unit, and the result multiplied by the rows (``count * unit``)."""
    description = "a sum over the rows (reduction='sum')"
    setting = "reduction='sum'"

    def tally(self, loss, count, rows, unit, inputs):
        per_unit = 1.0 / unit
        return per_unit, loss * per_unit, rows / unit

    def rows_factor(self, count, unit, rows):
        return count * unit


@ms.jit_class
class TokenMean(LossKind):
    """``(loss_sum, count)``: the batch's (or window's, all devices') sum divided by its total count, floored at
    `min_count`; with `times_rows`, multiplied by the rows as well (``reduction='sum'``)."""
    returns_count = True
    sums_across_ranks = True
    checks_counts = True
    description = "(loss_sum, count) with per_token_loss=True"
    setting = "per_token_loss=True"

    def __init__(self, min_count: float = 0.0, times_rows: bool = False):
        self.min_count = float(min_count)
        self.times_rows = times_rows

    def tally(self, loss, count, rows, unit, inputs):
        return Tensor(1.0, mstype.float32), loss, count

    def rows_factor(self, count, unit, rows):
        if not self.times_rows:
            return Tensor(1.0, mstype.float32)
        if isinstance(rows, int):
            return Tensor(rows, mstype.float32)
        # A Tensor (a Parameter: AccumulatingTrainOneStepCell's window rows): read, not wrapped in a new Tensor, which
        # MindSpore 2.7.0 ran into an Assign without a device address ("input_data does not have a valid ptr").
        return ops.cast(rows, mstype.float32) * 1.0

    def compared(self, value, count, rows, unit):
        return value / count, value, count


def of_arguments(per_token_loss: bool, reduction: str, min_count: float) -> LossKind:
    """The built-in kind the public arguments select (checked before: _spec)."""
    if per_token_loss:
        return TokenMean(min_count, reduction == "sum")
    return RowSum() if reduction == "sum" else RowMean()


def arguments_of(kind: LossKind) -> dict:
    """The public arguments that select a built-in `kind` (for messages and the cells' attributes); a kind of one's own
    has ``per_token_loss`` as it returns a count, a ``'mean'`` reduction and its ``min_count``."""
    reduction = "sum" if isinstance(kind, RowSum) or getattr(kind, "times_rows", False) else "mean"
    return dict(per_token_loss=kind.returns_count, reduction=reduction, min_count=kind.min_count)
