"""Loss kinds: what one micro-batch's loss adds to its batch or window, and how the sums become the loss and the mean
gradient. A kind is one object (as optax's microbatching ``Accumulator``); no other module branches on its type, only
on what it declares (``returns_count``, ``checks_counts``, ``counts_in_network``, ``in_parallel_pass``,
``skips_empty``, ``graph_readable``, ``ignores_labels``, ``cells``, :meth:`LossKind.counted_input`,
:meth:`LossKind.declaration`).

Per micro-batch (in the graph, and eagerly for the value comparison) :meth:`LossKind.tally` returns ``(weight, value,
count)``: the backward pass runs on ``loss * scale * weight``, so the buffers hold ``scale * sum(weight * gradient)``;
``value`` and ``count`` are summed over the batch or window (and over devices where :attr:`sums_across_ranks`), and
:meth:`LossKind.normalise` turns the sums into the loss and the buffers' divisor (``core.buffers.normalise``).

Built in (``per_token_loss``, ``reduction`` and ``min_count`` select one): :class:`RowMean`, :class:`RowSum`,
:class:`TokenMean`; ``core.tokens.CountedMean`` where the network holds a loss the cells recognise. A kind of one's own
subclasses :class:`LossKind` (decorated with ``mindspore.jit_class``) and is passed as ``kind=``
(``tests/test_kinds.py`` writes one). :class:`LossSpec` is what a cell is told about its loss, validated once into one
frozen object: the kind and how the batch is split.
"""
import dataclasses
from typing import Optional

import mindspore as ms
from mindspore import ops, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum.core import buffers as _buffers
from ms_gradaccum.core.validation import (argument_error, check_bool, check_input_indices, check_min_count,
                                          check_positive_int, check_reduction)


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
        counts_in_network (bool): The count is what the network's recognised loss cells counted during its forward
            pass (core.tokens), not an output.
        min_count (float): The floor of the total count a batch or window divides by.
        skips_empty (bool): A micro-batch whose count is 0 adds nothing: its loss and gradients (0/0 where the
            network divides by that count) are left out of the sums, as the full batch leaves its rows out.
        graph_readable (bool): The loss network's graph can show this kind (diagnostics.graph_contract), so a
            declaration of it is checked against the graph; a kind of one's own is taken as declared.
        ignores_labels (bool): A mean over the labels of one input that are not an ignore value.
        cells (tuple[str]): The recognised loss cells that count (core.tokens.CountedMean), by name.
        description (str): What the cell was told the loss is, for messages.
        setting (str): The argument that selects it, for messages.
    """
    returns_count = False
    sums_across_ranks = False
    in_parallel_pass = False
    checks_counts = False
    counts_in_network = False
    skips_empty = False
    graph_readable = False
    ignores_labels = False
    cells = ()
    min_count = 0.0
    description = "a loss of its own kind"
    setting = "kind=..."

    def counted_input(self):
        """The network's input the count is taken from (a mean over a count of the inputs), else None."""
        return None

    def declaration(self) -> str:
        """What declares it to a package cell, for the stop where the graph shows it only after compiling for another
        kind (a train cell of one's own, sink mode)."""
        return f"pass kind={self!r}"

    def tally(self, loss, count, rows, count_unit, inputs):
        """``(weight, value, count)`` of one micro-batch of `rows` rows (an int) whose network returned the float32
        scalars `loss` and `count`; `count_unit` is the rows of the largest micro-batch (a float32 scalar), the unit in
        which a row mean counts its rows (evenly split micro-batches count 1 each); `inputs` are the micro-batch's
        inputs."""
        raise NotImplementedError

    def rows_factor(self, count, count_unit, rows):
        """What the normalised value is multiplied by: 1 for a mean (the default)."""
        return Tensor(1.0, mstype.float32)

    def normalise(self, scale, value, count, devices_factor, rows, count_unit):
        """``(loss, divisor)`` from a batch's or window's sums (``core.buffers.normalise``); `rows` are its rows (an int
        or a float32 scalar); `devices_factor` is what ``parallel.data_parallel.TokenTotals`` gives under data parallel
        (1 elsewhere)."""
        return _buffers.normalise(scale, value, count, devices_factor, self.min_count,
                                  self.rows_factor(count, count_unit, rows))

    def empty(self, count):
        """Whether a window with this total count has nothing to learn from (its step is skipped)."""
        return ops.maximum(count, self.min_count) <= 0

    def compared(self, value, count, rows, count_unit):
        """What the value comparison compares between the network's loss on two micro-batches together and the
        combination of their own (the first is the one the message quotes)."""
        return (self.normalise(Tensor(1.0, mstype.float32), value, count, 1.0, rows, count_unit)[0],)

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
    graph_readable = True
    description = "a mean over the rows it is given (the default)"
    setting = "reduction='mean'"

    def declaration(self) -> str:
        return "leave per_token_loss, reduction and kind unset"

    def tally(self, loss, count, rows, count_unit, inputs):
        weight = rows / count_unit
        return weight, loss * weight, weight


@ms.jit_class
class RowSum(LossKind):
    """A sum over the rows (or a mean times their number): counted in rows like a mean, but its value and gradient
    taken per count unit, and the result multiplied by the rows (``count * count_unit``)."""
    graph_readable = True
    description = "a sum over the rows (reduction='sum')"
    setting = "reduction='sum'"

    def declaration(self) -> str:
        return "pass reduction='sum'"

    def tally(self, loss, count, rows, count_unit, inputs):
        per_unit = 1.0 / count_unit
        return per_unit, loss * per_unit, rows / count_unit

    def rows_factor(self, count, count_unit, rows):
        return count * count_unit


@ms.jit_class
class TokenMean(LossKind):
    """``(loss_sum, count)``: the batch's (or window's, all devices') sum divided by its total count, floored at
    `min_count`; with `times_rows`, multiplied by the rows as well (``reduction='sum'``)."""
    returns_count = True
    sums_across_ranks = True
    checks_counts = True
    graph_readable = True
    description = "(loss_sum, count) with per_token_loss=True"
    setting = "per_token_loss=True"

    def declaration(self) -> str:
        return ("return (loss_sum, count) from the network and pass per_token_loss=True (min_count=1.0 for a "
                "max(count, 1) floor)")

    def __init__(self, min_count: float = 0.0, times_rows: bool = False):
        self.min_count = float(min_count)
        self.times_rows = times_rows

    def tally(self, loss, count, rows, count_unit, inputs):
        return Tensor(1.0, mstype.float32), loss, count

    def rows_factor(self, count, count_unit, rows):
        if not self.times_rows:
            return Tensor(1.0, mstype.float32)
        if isinstance(rows, int):
            return Tensor(rows, mstype.float32)
        # A Tensor (a Parameter: AccumulatingTrainOneStepCell's window rows): read, not wrapped in a new Tensor, which
        # MindSpore 2.7.0 ran into an Assign without a device address ("input_data does not have a valid ptr").
        return ops.cast(rows, mstype.float32) * 1.0

    def compared(self, value, count, rows, count_unit):
        return _buffers.mean_loss(value, count), value, count


# The default ignore_index of ops.cross_entropy, ops.nll_loss and nn.CrossEntropyLoss.
IGNORE_INDEX = -100


@ms.jit_class
class IgnoredLabelMean(LossKind):
    """A mean over the labels of input `position` that are not `ignore_index`: each micro-batch weighs the labels it
    holds (in count units), so the batch's loss is its sum over its valid labels on every step, whatever labels a later
    batch holds. Chosen by the loss contract (diagnostics.contract) for a loss of one's own that it finds to be
    such a mean (``ops.cross_entropy``, ``ops.nll_loss`` inside a loss cell), where nothing was declared.

    Attributes:
        position (int): The network's input holding the labels.
        ignore_index (int): The label left out. Default: ``-100``.
    """
    sums_across_ranks = True   # the whole batch's count, all devices': as one process on the global batch
    skips_empty = True   # a micro-batch without a valid label: 0/0 in the network, nothing in the full batch
    graph_readable = True
    ignores_labels = True
    setting = "(a mean over valid labels, read from the loss network's graph)"

    def __init__(self, position: int, ignore_index: int = IGNORE_INDEX):
        self.position = int(position)
        self.ignore_index = int(ignore_index)
        self.description = f"a mean over the labels of input {self.position} that are not {self.ignore_index}"

    def counted_input(self):
        return self.position

    def declaration(self) -> str:
        return f"pass kind=ms_gradaccum.IgnoredLabelMean({self.position}, ignore_index={self.ignore_index})"

    def tally(self, loss, count, rows, count_unit, inputs):
        valid = ops.cast(inputs[self.position] != self.ignore_index, mstype.float32).sum()
        weight = valid / count_unit
        return weight, loss * weight, weight


def kind_of_arguments(per_token_loss: bool, reduction: str, min_count: float) -> LossKind:
    """The built-in kind the public arguments select (checked before: LossSpec.of)."""
    if per_token_loss:
        return TokenMean(min_count, reduction == "sum")
    return RowSum() if reduction == "sum" else RowMean()


def public_arguments(kind: LossKind) -> dict:
    """The public arguments that select a built-in `kind` (for messages and the cells' attributes); a kind of one's own
    has ``per_token_loss`` as it returns a count, a ``'mean'`` reduction and its ``min_count``."""
    reduction = "sum" if isinstance(kind, RowSum) or getattr(kind, "times_rows", False) else "mean"
    return dict(per_token_loss=kind.returns_count, reduction=reduction, min_count=kind.min_count)


def declares_kind(per_token_loss: Optional[bool] = None, reduction: Optional[str] = None,
                  kind: Optional[LossKind] = None, **_) -> bool:
    """Whether arguments given say what the loss is (`kind`, `per_token_loss`, or a `reduction` other than the
    default): then no loss is recognised in the network, and no token-mean warning is given (core.tokens)."""
    return kind is not None or per_token_loss is not None or reduction not in (None, "mean")


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """How a loss network is split and what its loss is; `declared`: the kind was given (`kind`, `per_token_loss` or
    `reduction`), so the token-mean warning is not given."""
    micro_size: int = 1
    kind: LossKind = dataclasses.field(default_factory=RowMean)
    declared: bool = False
    shared_inputs: tuple = ()
    check_loss: bool = True

    def with_kind(self, kind: LossKind) -> "LossSpec":
        """The same spec with `kind` (the one the loss contract read, diagnostics.contract)."""
        return dataclasses.replace(self, kind=kind)

    # The public arguments of the kind, for messages and the cells' attributes.
    @property
    def per_token_loss(self) -> bool:
        return public_arguments(self.kind)["per_token_loss"]

    @property
    def reduction(self) -> str:
        return public_arguments(self.kind)["reduction"]

    @property
    def min_count(self) -> float:
        return self.kind.min_count

    @classmethod
    def of(cls, cls_name: str, micro_size: Optional[int] = None, per_token_loss: Optional[bool] = None,
           shared_inputs=None, reduction: Optional[str] = None, min_count: Optional[float] = None,
           check_loss: Optional[bool] = None, kind: Optional[LossKind] = None) -> "LossSpec":
        """The spec of the arguments given (None: the default), each checked, errors naming `cls_name`."""
        micro_size = 1 if micro_size is None else check_positive_int(micro_size, "micro_size", cls_name)
        shared_inputs = () if shared_inputs is None else check_input_indices(shared_inputs, "shared_inputs", cls_name)
        check_loss = True if check_loss is None else check_bool(check_loss, "check_loss", cls_name)
        if kind is not None:
            if not isinstance(kind, LossKind):
                raise TypeError(argument_error(cls_name, "kind", "None or an ms_gradaccum.LossKind", kind))
            given = [name for name, value in (("per_token_loss", per_token_loss), ("reduction", reduction),
                                              ("min_count", min_count)) if value is not None]
            if given:
                raise ValueError(
                    f"For '{cls_name}', the argument 'kind' is {kind!r}, and {', '.join(given)} is given as well: "
                    f"both say what the loss is. Give the kind alone, or these arguments without it.")
            return cls(micro_size, kind, True, shared_inputs, check_loss)
        declared = declares_kind(per_token_loss, reduction)
        per_token_loss = False if per_token_loss is None else check_bool(per_token_loss, "per_token_loss", cls_name)
        reduction = "mean" if reduction is None else check_reduction(reduction, cls_name)
        min_count = check_min_count(0.0 if min_count is None else min_count, per_token_loss, cls_name)
        return cls(micro_size, kind_of_arguments(per_token_loss, reduction, min_count), declared, shared_inputs,
                   check_loss)


class SpecFields:
    """Mixed into the cells, which hold their :class:`LossSpec` as ``self.spec`` and its fields as plain attributes of
    the same names (set together by :meth:`use_spec`, read in Python and by the graph)."""

    def use_spec(self, spec: LossSpec) -> None:
        """Holds `spec` and its fields: ``micro_size`` (micro-batches per batch), ``kind`` (the loss kind),
        ``shared_inputs`` (the inputs every micro-batch receives whole), ``per_token_loss``, ``reduction`` and
        ``min_count`` (the kind's public arguments)."""
        for name, value in (("spec", spec), ("micro_size", spec.micro_size), ("kind", spec.kind),
                            ("shared_inputs", spec.shared_inputs), ("per_token_loss", spec.per_token_loss),
                            ("reduction", spec.reduction), ("min_count", spec.min_count)):
            object.__setattr__(self, name, value)

    def use_kind(self, kind: LossKind) -> None:
        """Trains with `kind` from the next compile on: the kind the loss contract read (diagnostics.contract),
        set before the first graph compiles."""
        self.use_spec(self.spec.with_kind(kind))
        self.engine.use_kind(kind)
        self.contract.kind = kind
