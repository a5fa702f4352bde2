"""The loss contract read from the loss network's own graph: what the batch-axis analysis (``diagnostics.batch_table``)
shows the loss to be, as a typed record (:class:`GraphReading`), and what that decides for the cell's kind
(:func:`decide`). ``diagnostics.contract`` calls it on the first call, once per input layout, before any eager pass.
"""
import dataclasses
from typing import Optional

from mindspore import nn, Tensor

from ms_gradaccum._mindspore.frontend import forward_graph
from ms_gradaccum.core.input_count import InputCountMean
from ms_gradaccum.core.kinds import IgnoredLabelMean, LossKind, RowMean, RowSum, TokenMean
from ms_gradaccum.diagnostics.batch_axis import COUNT_UNREAD, NORMALISER, Coupled, Fixed, Many, Reduced, Unknown
from ms_gradaccum.diagnostics.batch_table import analyse



@dataclasses.dataclass(frozen=True)
class GraphReading:
    """What the loss network's graph showed.

    Attributes:
        kind (Optional[LossKind]): The kind the loss is (None: not read, or coupled).
        coupled (Optional[Coupled]): The primitive that couples the rows (its op, the cells it runs in, why).
        unread (str): Why the contract could not be read from the graph ("" where it was).
        stop (str): Why the loss, read whole, is no one kind the cell can count ("" where it is).
        normalised (bool): The stop is a normaliser over the batch the cell cannot count from the inputs.
        outputs (int): The network's outputs (1: a single Tensor; 2 for ``(loss_sum, count)``).
        count_input (Optional[int]): The input a count over the rows is taken from, where the loss is such a mean.
        random (tuple): The random primitives the graph draws with.
        nodes (int): The graph's primitives applied.
    """
    kind: Optional[LossKind] = None
    coupled: Optional[Coupled] = None
    unread: str = ""
    stop: str = ""
    normalised: bool = False
    outputs: int = 1
    count_input: Optional[int] = None
    random: tuple = ()
    nodes: int = 0


def place(scope: str) -> str:
    """Where a primitive runs in the user's code, from its scope (``"Default/head-Dense/MatMul-op0"``: ``"the cell
    'head' (Dense)"``)."""
    cells = [part for part in scope.split("/")[1:-1] if "-" in part]
    if not cells:
        return "the network's own construct"
    names = [part.rsplit("-", 1) for part in cells]
    return f"the cell '{'.'.join(name for name, _ in names)}' ({names[-1][1]})"


def _count_kind(chain: tuple) -> LossKind:
    """The kind counting `chain` (``(position, steps)``, a floor last where the network puts one on the count): a
    mean over labels other than one value is the public ``IgnoredLabelMean``."""
    position, steps = chain[0], chain[1]
    floor = 0.0
    rest = tuple(step for step in chain[2:])
    for step in rest:
        if step[0] == "floor":
            floor = step[1]
    core = tuple(step for step in steps if step[0] not in ("reshape", "cast"))
    if not floor:
        if len(core) == 1 and core[0][:2] == ("compare", "ne") and isinstance(core[0][2], int):
            return IgnoredLabelMean(position, core[0][2])
        if len(core) == 2 and core[0][:2] == ("compare", "eq") and isinstance(core[0][2], int) and \
                core[1] in (("fill", 1.0, 0.0), ("fill", 1, 0), ("not",)):
            return IgnoredLabelMean(position, core[0][2])
    return InputCountMean(position, steps, floor)


def _kind_of(state) -> tuple:
    """``(kind, why)``: the kind a :class:`Reduced` output is; None and why it is none of them."""
    fixed = "fixed" in state.terms
    terms = set(state.terms) - {"fixed"}
    counts = {term for term in terms if isinstance(term, tuple)}
    if terms == {"mean"}:
        return RowMean(), ""
    if terms == {"sum"}:
        if fixed:
            return None, "a sum over the rows plus a term that does not depend on them"
        return RowSum(), ""
    if len(counts) == 1 and terms == counts:
        return _count_kind(next(iter(counts))[1]), ""
    if len(counts) > 1 and terms == counts:
        return None, "means over different counts added together"
    return None, "a mean over the rows and a sum over them, or a count, added together"


def _divisions(state) -> tuple:
    items = state.items if isinstance(state, Many) else (state,)
    return sum((item.divisions for item in items if isinstance(item, Reduced)), ())


def _with_rows(divisor: float, other: float, rows: int, other_rows: int) -> bool:
    """Whether a divisor changed with the rows: as them (a sum over them, a mean), or as their inverse (a mean times
    them, a sum)."""
    scale = max(abs(divisor), abs(other)) * max(rows, other_rows) * 1e-6
    return abs(other * rows - divisor * other_rows) <= scale or abs(other * other_rows - divisor * rows) <= scale


def _forward(network: nn.Cell, args: tuple, split_positions: tuple) -> tuple:
    """``(graph, split)`` of `network`'s frontend graph on `args` (`split`: the graph's split inputs' names -> their
    positions), or ``(None, why)`` where the graph cannot be read."""
    graph = forward_graph(network, args)
    if graph is None:
        return None, "MindSpore gave no graph"
    tensors = [position for position, x in enumerate(args) if isinstance(x, Tensor)]
    if len(tensors) != len(graph.inputs):
        return None, "the graph's inputs are not the network's Tensor arguments one for one"
    return graph, {name: position for name, position in zip(graph.inputs, tensors) if position in split_positions}


def read(network: nn.Cell, rows_of, split_positions: tuple, rows: int, other_rows: int) -> GraphReading:
    """The contract of `network` from its frontend graph on ``rows_of(rows)`` (a micro-batch's inputs; those at
    `split_positions` carry the rows along axis 0). Where a constant proportional to the rows makes a sum a mean (or
    a mean a sum), the graph on ``rows_of(other_rows)`` confirms it changes with them. Errors of the network's compile
    propagate."""
    graph, split = _forward(network, rows_of(rows), split_positions)
    if graph is None:
        return GraphReading(unread=split)
    other = None
    if other_rows and other_rows != rows:
        other = lambda: _forward(network, rows_of(other_rows), split_positions) + (other_rows,)  # noqa: E731
    return _confirmed(graph, split, rows, other)


def read_step(bodies: list, positions: dict) -> Optional[GraphReading]:
    """The contract from the network's forward in the compiled step's loop bodies (``_mindspore.step_graph``; the
    larger micro-batches first), `positions` mapping a split input's index to the network's input position. None
    where a constant proportional to the rows needs the graph at another row count and the step holds only one."""
    def split_of(body):
        return {name: positions[index] for name, index in body.split.items()}
    first = bodies[0]
    reading = analyse(first.graph, split_of(first), first.rows)
    if _divisions(reading.state) and len(bodies) < 2:
        return None
    other = (lambda: (bodies[1].graph, split_of(bodies[1]), bodies[1].rows)) if len(bodies) > 1 else None
    return _confirmed(first.graph, split_of(first), first.rows, other, reading)


def _confirmed(graph, split: dict, rows: int, other, reading=None) -> GraphReading:
    """What `graph` (compiled for `rows`) shows; a division that makes a sum a mean (or a mean a sum) counts only
    where ``other()``, the same graph at another row count ``(graph, split, rows)``, shows it change with the rows."""
    reading = analyse(graph, split, rows) if reading is None else reading
    divisions = _divisions(reading.state)
    if divisions and other is not None:
        other_graph, other_split, other_rows = other()
        if other_graph is None or len(other_graph.nodes) != len(graph.nodes):
            return GraphReading(unread="the graph differs at another row count")
        seen = dict(_divisions(analyse(other_graph, other_split, other_rows).state))
        literals = frozenset(index for index, divisor in divisions
                             if not _with_rows(divisor, seen.get(index, 0.0), rows, other_rows))
        if literals:
            reading = analyse(graph, split, rows, literals)
    return _finding(reading, len(graph.nodes))


def _finding(reading, nodes: int) -> GraphReading:
    found = _found(reading, nodes)
    state = reading.state
    return dataclasses.replace(found, outputs=len(state.items)) if isinstance(state, Many) else found


def _found(reading, nodes: int) -> GraphReading:
    state = reading.state
    random = tuple(sorted(set(reading.random)))
    if isinstance(state, Many):
        return _many(state, random, nodes)
    if isinstance(state, Coupled):
        return GraphReading(coupled=state, random=random, nodes=nodes)
    if isinstance(state, Unknown) and state.why in (COUNT_UNREAD, NORMALISER):
        return GraphReading(stop=f"{state.why}, at {state.op} in {place(state.scope)}", normalised=True,
                            random=random, nodes=nodes)
    if isinstance(state, Unknown):
        return GraphReading(unread=f"{state.why}: {state.op} in {place(state.scope)}", random=random, nodes=nodes)
    if isinstance(state, Reduced):
        kind, why = _kind_of(state)
        if kind is None:
            return GraphReading(stop=why, random=random, nodes=nodes)
        return GraphReading(kind=kind, count_input=kind.counted_input(), random=random, nodes=nodes)
    if isinstance(state, Fixed):
        return GraphReading(unread="the loss does not depend on the rows", random=random, nodes=nodes)
    return GraphReading(unread="the loss is not reduced over the rows", random=random, nodes=nodes)


def _many(state: Many, random: tuple, nodes: int) -> GraphReading:
    """A network returning ``(loss_sum, count)``: both sums over the rows make a ``TokenMean``."""
    for item in state.items[:2]:
        if isinstance(item, Coupled):
            return GraphReading(coupled=item, random=random, nodes=nodes)
    if len(state.items) >= 2 and all(isinstance(item, Reduced) and item.terms == {"sum"} for item in state.items[:2]):
        return GraphReading(kind=TokenMean(), random=random, nodes=nodes)
    first = state.items[0] if state.items else None
    if isinstance(first, Reduced) and "mean" in first.terms:
        return GraphReading(stop="its first output is a mean over the rows, not a sum", random=random, nodes=nodes)
    return GraphReading(unread="its outputs are not a sum and a count over the rows", random=random, nodes=nodes)


def built_in(kind: LossKind) -> bool:
    """Whether `kind` is one of the package's (a kind of one's own is taken as declared)."""
    return kind.graph_readable


def agrees(found: LossKind, kind: LossKind) -> bool:
    """Whether the kind the graph showed is the cell's `kind` (a ``TokenMean``'s floor and sum are the user's)."""
    return (found.returns_count and kind.returns_count) or found == kind
