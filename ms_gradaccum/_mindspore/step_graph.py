"""The loss network's forward, read back from the train step's own compiled graph: no second compile of the network.

The engine marks where the network's inputs and outputs are in its loop body with primitives it owns, which carry an
attribute MindSpore keeps through every frontend pass and ignores at run time (a primitive's attribute is part of its
identity, so no pass merges it with another): each split input's micro-batch is taken by :data:`GATHERS` ``[k]``
(attribute :data:`MICRO_BATCH` = k, the split input's index), and the network's loss, and the count where it returns
``(loss_sum, count)``, are summed by :data:`LOSS_SUM`, :data:`FIRST_SUM` and :data:`COUNT_SUM` (attribute
:data:`LOSS_OUTPUT`); a recognised loss's counting copy guards its count against 0 with :data:`GUARD`.

After a compile, :func:`step_proto` (a ``jit`` function's executor likewise) serialises the step's graph (forward,
backward, the optimizer) as MindIR. MindSpore imports protobuf's pure-Python implementation, which would take seconds
to parse a deep model's graph (its constants carry the buffers' zeros); so the model is split at the wire level and
only the primitive table and the subgraphs holding the marks are parsed. :func:`loss_graphs` returns, per loop body
(two for an uneven split), the network's forward as a ``frontend.Graph``: the nodes the marked outputs depend on, from
the marked micro-batches, weights and constants. Checked 2.7.0 and 2.10.0 (``tests/test_graph_contract.py``).
"""
import dataclasses
import gc
from typing import Optional

from mindspore import ops
from mindspore.train import mind_ir_pb2

from ms_gradaccum._mindspore.frontend import CALL, NOT_A_VALUE, Graph, Node, Value, attribute_value, output_value

try:
    from mindspore.graph.api import _cell_graph_executor as _EXECUTOR
except ImportError:   # before 2.9
    from mindspore.common.api import _cell_graph_executor as _EXECUTOR

MICRO_BATCH = "ms_gradaccum_micro_batch"
LOSS_OUTPUT = "ms_gradaccum_loss_output"
COUNT_GUARD = "ms_gradaccum_count_guard"
GUARD_OP = "GradAccumCountGuard"   # the op the reading names it (diagnostics.batch_table has its rule)
# One Gather per split input (more split inputs than this are taken unmarked: the graph is then read apart).
MARKED_INPUTS = 32
GATHERS = tuple(ops.Gather().add_prim_attr(MICRO_BATCH, k) for k in range(MARKED_INPUTS))
LOSS_SUM = ops.ReduceSum().add_prim_attr(LOSS_OUTPUT, "loss")      # a network returning one Tensor
FIRST_SUM = ops.ReduceSum().add_prim_attr(LOSS_OUTPUT, "first")    # the first of a tuple
COUNT_SUM = ops.ReduceSum().add_prim_attr(LOSS_OUTPUT, "count")    # the second of a tuple
# A recognised loss's counting copy (core.tokens.CountingLoss) divides by its count, 1 where it is 0: the count.
GUARD = ops.Select().add_prim_attr(COUNT_GUARD, True)

# Field numbers of mind_ir.proto: ModelProto.graph, .functions, .primitives; GraphProto.name.
_GRAPH, _FUNCTIONS, _PRIMITIVES, _NAME = 7, 8, 12, 2
_OUTPUTS = "ms_gradaccum.outputs"   # the node made for a network that returns a tuple


@dataclasses.dataclass(frozen=True)
class LossGraph:
    """The network's forward in one loop body of the step: `graph` (its inputs the marked micro-batches), `split`
    (each input's name -> the split input's index), `rows` (the rows of the body's micro-batches)."""
    graph: Graph
    split: dict
    rows: int


def _varint(data: bytes, at: int) -> tuple:
    value, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: bytes, start: int, end: int):
    """``(number, start, end)`` of each length-delimited field of the message in ``data[start:end]``."""
    at = start
    while at < end:
        key, at = _varint(data, at)
        wire = key & 7
        if wire == 2:
            size, at = _varint(data, at)
            yield key >> 3, at, at + size
            at += size
        elif wire == 0:
            _, at = _varint(data, at)
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"unexpected wire type {wire}")


def _marked(primitive) -> Optional[tuple]:
    for attribute in primitive.attribute:
        if attribute.name == MICRO_BATCH:
            return MICRO_BATCH, attribute_value(attribute)
        if attribute.name == LOSS_OUTPUT:
            return LOSS_OUTPUT, attribute.s.decode()
        if attribute.name == COUNT_GUARD:
            return COUNT_GUARD, None
    return None


def step_proto(root, phase: str) -> Optional[bytes]:
    """The MindIR of `root`'s compiled `phase` (the train step), or None where MindSpore has none."""
    return _EXECUTOR._get_func_graph_proto(root, phase, "mind_ir")   # pylint: disable=protected-access


def loss_graphs(data: Optional[bytes], weights: frozenset, network: str) -> list:
    """The network's forward in each loop body of the compiled step whose MindIR is `data` (:func:`step_proto`, or a
    ``jit`` function's) that holds the marks (see the module docstring), as :class:`LossGraph`, the larger
    micro-batches first; empty where there is no graph or no body holds the marks. `weights`: the names of the
    Parameters (read as weights, not inputs); `network`: the loss network's class name (its nodes' scopes are given
    from it on, as its own graph gives them)."""
    if not data:
        return []
    # The parse allocates many small objects: the collector, run over everything a compile leaves, would cost more
    # than the parse itself (0.1 s at 2 layers of the benchmark LM); it is held off until the parse is done.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _loss_graphs(bytes(data), weights, network)
    finally:
        if collecting:
            gc.enable()


def _loss_graphs(data: bytes, weights: frozenset, network: str) -> list:
    marks, primitives, graphs = {}, set(), []
    for number, start, end in _fields(data, 0, len(data)):
        if number == _PRIMITIVES:
            primitives.add(_name(data, start, end))
            if data.find(b"ms_gradaccum_", start, end) >= 0:
                primitive = mind_ir_pb2.PrimitiveProto.FromString(data[start:end])
                mark = _marked(primitive)
                if mark is not None:
                    marks[primitive.name] = mark
        elif number in (_GRAPH, _FUNCTIONS):
            graphs.append((start, end))
    if not marks:
        return []
    needles = [("REF::" + name).encode() for name, mark in marks.items() if mark[0] == LOSS_OUTPUT]
    found = []
    for start, end in graphs:
        if any(data.find(needle, start, end) >= 0 for needle in needles):
            body = _body(data, start, end, primitives, marks, weights, network)
            if body is not None:
                found.append(body)
    # A constant is written once, in the first subgraph that uses it (another body, or a graph not parsed).
    constants = {name: value for body in found for name, value in body.graph.constants.items()}
    missing = {name for body in found for node in body.graph.nodes for name in node.inputs} - set(constants) - {
        name for body in found for name in (*body.graph.inputs, *body.graph.weights,
                                            *(node.name for node in body.graph.nodes))}
    constants.update(_constants(data, graphs, missing) if missing else {})
    return sorted((dataclasses.replace(body, graph=dataclasses.replace(body.graph, constants=constants))
                   for body in found), key=lambda body: -body.rows)


def _constants(data: bytes, graphs: list, names: set) -> dict:
    """The values of the Constant nodes named `names`, wherever they are defined. A constant's first field is its
    output's name (it has no inputs): every other node is skipped unparsed."""
    wanted = {name.encode(): name for name in names}
    values = {}
    for start, end in graphs:
        for number, begin, stop in _fields(data, start, end):
            if number != 1:   # GraphProto.node
                continue
            first = next(_fields(data, begin, stop), None)
            if first is not None and first[0] == 2 and data[first[1]:first[2]] in wanted:
                node = mind_ir_pb2.NodeProto.FromString(data[begin:stop])
                if node.op_type == "Constant" and node.attribute:
                    values[wanted[data[first[1]:first[2]]]] = attribute_value(node.attribute[0])
    return values


def _name(data: bytes, start: int, end: int) -> str:
    """A PrimitiveProto's name (its field 1), without parsing the rest."""
    for number, begin, stop in _fields(data, start, end):
        if number == 1:
            return data[begin:stop].decode("utf-8", "replace")
    return ""


def _scope(scope: str, network: str) -> str:
    """A node's scope from the network on (``Default/network-GradAccumulationCell/network-Net/head-Dense/MatMul-op0``:
    ``Default/head-Dense/MatMul-op0``)."""
    parts = scope.split("/")
    for index, part in enumerate(parts[1:-1], 1):
        if part.rsplit("-", 1)[-1] == network:
            return "/".join(parts[:1] + parts[index + 1:])
    return scope


def _records(data: bytes, start: int, end: int) -> tuple:
    """The name of the GraphProto in ``data[start:end]`` and its nodes, each ``(inputs, output, op_type, scope, begin,
    stop)``: the strings read at the wire level, the rest (attributes) left for the nodes the reading keeps."""
    name, records = "", []
    for number, begin, stop in _fields(data, start, end):
        if number == 2:   # GraphProto.name
            name = data[begin:stop].decode()
        elif number == 1:   # GraphProto.node: NodeProto.input 1, output 2, op_type 4, domain 7
            inputs, strings = [], {}
            for field, first, last in _fields(data, begin, stop):
                if field == 1:
                    inputs.append(data[first:last].decode())
                elif field in (2, 4, 7):
                    strings[field] = data[first:last].decode()
            records.append((tuple(inputs), strings.get(2, ""), strings.get(4, ""), strings.get(7, ""), begin, stop))
    return name, records


def _body(data: bytes, start: int, end: int, primitives: set, marks: dict, weights: frozenset,
          network: str) -> Optional[LossGraph]:
    """The marked forward of one subgraph, or None where its marks are not the engine's whole set."""
    name, records = _records(data, start, end)
    kinds, constants, inputs, outputs = {}, {}, {}, {}
    for record in records:
        inputs_of, output, op_type = record[:3]
        if op_type == "Constant":
            node = mind_ir_pb2.NodeProto.FromString(data[record[4]:record[5]])
            constants[output] = attribute_value(node.attribute[0]) if node.attribute else NOT_A_VALUE
            continue
        target = op_type[5:] if op_type.startswith("REF::") else None
        mark = marks.get(target)
        if mark is None or mark[0] == COUNT_GUARD:
            # "REF::MatMul:5": the primitive "MatMul:5" of the model's table; anything else calls a computed value.
            op = GUARD_OP if mark else target.rsplit(":", 1)[0] if target in primitives else CALL
            kinds[output] = (op, ((target,) if op == CALL and target else ()) + inputs_of, record)
        elif mark[0] == MICRO_BATCH:
            node = mind_ir_pb2.NodeProto.FromString(data[record[4]:record[5]])
            inputs[output] = (mark[1], output_value(node))
        else:
            outputs[mark[1]] = inputs_of[0]
    if not inputs or not outputs or ("loss" in outputs) == ("first" in outputs):
        return None
    ends = (outputs["loss"],) if "loss" in outputs else tuple(outputs[role] for role in ("first", "count")
                                                             if role in outputs)
    kept = _ancestors(ends, {output: kind[1] for output, kind in kinds.items()})
    order = []
    for output, (op, node_inputs, record) in kinds.items():   # MindIR lists a graph's nodes in order
        if output in kept:
            node = mind_ir_pb2.NodeProto.FromString(data[record[4]:record[5]])
            order.append(Node(output, op, node_inputs, output_value(node), _scope(record[3], network)))
    output = ends[0]
    if "first" in outputs:
        order.append(Node(_OUTPUTS, "MakeTuple", ends, Value(None), ""))
        output = _OUTPUTS
    prefix = name + ":"
    held = frozenset(item for item in kept if item.startswith(prefix) and item[len(prefix):] in weights)
    rows = {value.shape[0] for _, value in inputs.values() if isinstance(value.shape, tuple) and value.shape}
    if len(rows) != 1:
        return None
    graph = Graph(tuple(inputs), {item: value for item, (_, value) in inputs.items()}, held, tuple(order),
                  constants, output)
    return LossGraph(graph, {item: index for item, (index, _) in inputs.items()}, rows.pop())


def _ancestors(ends: tuple, inputs: dict) -> set:
    """The names `ends` depend on (`inputs`: each node's output -> its inputs)."""
    kept, stack = set(), list(ends)
    while stack:
        name = stack.pop()
        if name in kept:
            continue
        kept.add(name)
        stack.extend(inputs.get(name, ()))
    return kept
