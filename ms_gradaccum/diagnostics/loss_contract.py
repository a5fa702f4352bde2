"""The loss contract as a public entry: :func:`check_loss_contract` reads the contract the cells read on their first
call (from the loss network's graph; the value comparison where the graph leaves it undecided), on a batch of one's
choosing, and raises as the cells would or reports what it found."""
import dataclasses
from typing import Optional

from mindspore import nn

from ms_gradaccum.core.engine import NON_FINITE_CAUSE, MicroBatchGradients
from ms_gradaccum.core.kinds import LossKind, LossSpec
from ms_gradaccum.core.microbatch import check_tensor_inputs, micro_batch_rows
from ms_gradaccum.core.tokens import recognised
from ms_gradaccum.core.validation import argument_error, check_cell
from ms_gradaccum.diagnostics.contract import LossContract

_PUBLIC = "check_loss_contract"


@dataclasses.dataclass(frozen=True)
class LossContractReport:
    """What :func:`check_loss_contract` found (it raises where the loss does not combine).

    Attributes:
        kind (LossKind): The loss kind the cells would train with for this network and these arguments (a recognised
            loss counted, ``CountedMean``; a mean over labels other than an ignore value, ``IgnoredLabelMean``; over
            another count taken from one input, ``InputCountMean``; a sum, ``RowSum``).
        rows (tuple): The rows of each micro-batch of the batch.
        separable (Optional[bool]): Whether the rows are independent, as read from the graph; None where the graph
            left it to the value comparison.
        ignore_labels (Optional[int]): The input whose ignored labels the loss leaves out, if any (then counted).
        random (bool): The network draws random values.
        rows_compared (int): The rows whose values were compared: every row of the batch, or 0 (the graph decided, a
            network with random draws, or a micro-batch whose loss is not finite).
        measured (float): The loss on the pair of micro-batches whose comparison was closest to failing.
        predicted (float): The same combined from the two micro-batches' own losses by the kind.
        read_from_graph (bool): The contract was read from the loss network's graph (no eager pass ran).
        count_input (Optional[int]): The input a count the loss divides by is taken from, where it is such a mean.
        random_primitives (tuple): The random primitives the graph draws with.
        primitives (int): The primitives applied in the loss network's graph.
    """
    kind: LossKind
    rows: tuple
    separable: Optional[bool]
    ignore_labels: Optional[int]
    random: bool
    rows_compared: int
    measured: float
    predicted: float
    read_from_graph: bool = False
    count_input: Optional[int] = None
    random_primitives: tuple = ()
    primitives: int = 0

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("nan")


def check_loss_contract(loss_net: nn.Cell, inputs, micro_size: int, kind: Optional[LossKind] = None,
                        shared_inputs=()) -> LossContractReport:
    """Whether `loss_net`'s loss combines over micro-batches as the cells combine it, read as ``GradAccumulationCell``
    and ``AccumulatingTrainOneStepCell`` read it on their first call: from the loss network's graph (its frontend
    only is compiled for a micro-batch's shapes), and where the graph leaves it undecided by comparing the values of
    a batch of one's choosing. Nothing is trained; BatchNorm's moving statistics and the random state are left as
    they were. What the graph shows holds for every batch; a value comparison covers this batch's rows
    (``docs/design.md``, "The loss contract").

    Args:
        loss_net (Cell): The loss network, as given to the cells.
        inputs (tuple): One batch, as the cells are called with it (Tensors; axis 0 is split).
        micro_size (int): Micro-batches per batch (at least 2: the contract is how micro-batches combine).
        kind (LossKind, optional): What the loss is, as the cells' `kind`; None: as the cells decide without it (a row
            mean, a recognised token mean counted, or the kind the graph shows). Default: ``None``.
        shared_inputs (Union[int, tuple[int]]): Inputs every micro-batch receives whole. Default: ``()``.

    Returns:
        LossContractReport: what the graph showed, and the values compared where it left the contract undecided.

    Raises:
        TypeError, ValueError: On bad arguments. ValueError: where the loss does not combine (the cause and the route
            that fits, in this function's arguments), or a micro-batch's loss is not finite while others' are; and
            errors the network raises on the micro-batches.
    """
    check_cell(loss_net, "loss_net", _PUBLIC)
    if not isinstance(inputs, (tuple, list)) or not inputs:
        raise TypeError(argument_error(_PUBLIC, "inputs", "a non-empty tuple of the batch's inputs", inputs))
    inputs = tuple(inputs)
    check_tensor_inputs(_PUBLIC, inputs)
    spec = LossSpec.of(_PUBLIC, micro_size, shared_inputs=shared_inputs, kind=kind)
    if spec.micro_size < 2:
        raise ValueError(f"For '{_PUBLIC}', the argument 'micro_size' must be at least 2, but got {micro_size}: the "
                         f"contract is how micro-batches combine.")
    spec = recognised(spec, loss_net, True)
    engine = MicroBatchGradients(loss_net, spec, overwrite=True, cls_name=_PUBLIC, loss_scale=None)
    engine.bind_targets((), ())
    check = LossContract.of(engine, loss_net, spec, _PUBLIC)
    found = check.read_graph(engine, inputs, public=True)
    if found is None:
        found = check.compare_values(engine, inputs, public=True)
    if found is None:
        raise ValueError(
            f"For '{_PUBLIC}', the loss contract cannot be read on these inputs: it is read stand-alone or data "
            f"parallel, on Tensors with data and static shapes, and on a batch of at least two micro-batches' rows "
            f"(micro_size={spec.micro_size}). Use check_equivalence to train both ways instead.")
    rows = micro_batch_rows(found.batch_rows, spec.micro_size)
    if found.not_finite is not None:
        first = sum(rows[:found.not_finite])
        raise ValueError(
            f"For '{_PUBLIC}', micro-batch {found.not_finite} (rows {first} to {first + rows[found.not_finite] - 1}) "
            f"returned a non-finite loss or count (nan or inf): the cells stop such a step before any weight changes. "
            f"{NON_FINITE_CAUSE}: return (loss_sum, count) from the network and pass kind=ms_gradaccum.TokenMean().")
    graph = found.graph
    if graph is None:
        return LossContractReport(found.kind, tuple(rows), found.separable, found.ignore_labels,
                                  found.random, found.rows_compared, found.measured, found.predicted)
    ignore = graph.count_input if found.kind.ignores_labels else None
    return LossContractReport(found.kind, tuple(rows), True, ignore, bool(graph.random), 0, float("nan"),
                              float("nan"), True, graph.count_input, graph.random, graph.nodes)
