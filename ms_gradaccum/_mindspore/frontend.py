"""The loss network's frontend graph, read from Python: what the loss contract's batch-axis analysis
(``diagnostics.batch_axis``) reads instead of running the network.

``mindspore.common.api._cell_graph_executor.compile(net, *inputs, phase="export.<name>", do_convert=False)`` runs
MindSpore's frontend only (parse, type inference, the frontend passes; no kernels, nothing runs) and
``_get_func_graph_proto(net, phase, "mind_ir")`` serialises the result: the graph's inputs and weights with their
shapes, its nodes in order (the primitive, the input names, the output shapes, the cell scope), and its constants with
their values (a tensor constant's raw data too, where ``"anf_ir"`` leaves it out). Checked 2.7.0-2.10.0
(``../shared/FACTS.md``, 2026-12-01). What the compile sets on the network (its phase, argument key and compile cache)
is put back and the graph's resources are freed; so is the random state its random ops take their seeds from. IR dumps
asked for in the context (``save_graphs``) leave it out; ``MS_DEV_SAVE_GRAPHS``, which MindSpore reads once, dumps it
beside the step's.
"""
import dataclasses
from typing import Optional

import numpy as np

import mindspore as ms
from mindspore import nn

try:
    from mindspore.graph.api import _cell_graph_executor as _EXECUTOR
except ImportError:   # before 2.9
    from mindspore.common.api import _cell_graph_executor as _EXECUTOR
from mindspore.train import mind_ir_pb2

from ms_gradaccum._mindspore.randomness import random_state_kept

_PHASE = "export.ms_gradaccum_loss_contract"
_A = mind_ir_pb2.AttributeProto
_T = mind_ir_pb2.TensorProto
_NUMPY = {_T.BOOL: np.bool_, _T.INT8: np.int8, _T.INT16: np.int16, _T.INT32: np.int32, _T.INT64: np.int64,
          _T.UINT8: np.uint8, _T.FLOAT16: np.float16, _T.FLOAT: np.float32, _T.DOUBLE: np.float64}
_FLOATS = (_T.FLOAT16, _T.FLOAT, _T.DOUBLE, _T.BFLOAT16)
# What the compile sets on the cell it compiles (``mindspore.graph.api._CellGraphExecutor.compile``).
_SET_BY_COMPILE = ("arguments_key", "current_phase", "compile_phase", "__parse_method__")
NOT_A_VALUE = object()   # a constant the graph holds that is not a number, a tuple or an array (a monad, a type)
CALL = "<call>"   # the op of a node that calls a graph the graph computes (control flow)


@dataclasses.dataclass(frozen=True)
class Value:
    """A tensor of the graph: its shape (None: not a tensor; a tuple of these for a tuple) and whether it is float."""
    shape: object
    floating: bool = True


@dataclasses.dataclass(frozen=True)
class Node:
    """One application of a primitive: `op` (``"MatMul"``), the names of its inputs, its output (a :class:`Value`)
    and `scope`, the cells it runs in (``"Default/fc-Dense/MatMul-op0"``)."""
    name: str
    op: str
    inputs: tuple
    out: Value
    scope: str


@dataclasses.dataclass(frozen=True)
class Graph:
    """The frontend graph of a network on some inputs: `inputs` (names, in the order of the network's Tensor
    arguments) and their values, `weights` (names), `nodes` in order, `constants` (name -> Python value), `output`."""
    inputs: tuple
    values: dict
    weights: frozenset
    nodes: tuple
    constants: dict
    output: str


def _tensor_value(tensor) -> Value:
    return Value(tuple(int(d) for d in tensor.dims), tensor.data_type in _FLOATS)


def attribute_value(attribute):
    """A constant's Python value: a number, a bool, None, a tuple of these, or a NumPy array (a tensor constant)."""
    kind = attribute.type
    if kind in (_A.INT8, _A.INT16, _A.INT32, _A.INT64, _A.UINT8, _A.UINT16, _A.UINT32, _A.UINT64, _A.BOOL):
        # A tuple's items hold their value in the repeated field (`ints`), a constant in the single one (`i`).
        value = attribute.ints[0] if len(attribute.ints) else attribute.i
        return bool(value) if kind == _A.BOOL else int(value)
    if kind in (_A.FLOAT, _A.DOUBLE):
        if kind == _A.FLOAT:
            return float(attribute.floats[0] if len(attribute.floats) else attribute.f)
        return float(attribute.doubles[0] if len(attribute.doubles) else attribute.d)
    if kind == _A.NONE:
        return None
    if kind in (_A.TUPLE, _A.LIST):
        return tuple(attribute_value(item) for item in attribute.values)
    if kind == _A.TENSORS and len(attribute.tensors) == 1:
        tensor = attribute.tensors[0]
        dtype = _NUMPY.get(tensor.data_type)
        if dtype is None or not tensor.raw_data:
            return NOT_A_VALUE
        return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(tuple(tensor.dims))
    return NOT_A_VALUE


def output_value(node) -> Value:
    for attribute in node.attribute:
        if attribute.name == "shape":
            return _shape_value(attribute)
    return Value(None)


def _shape_value(attribute):
    if attribute.type == _A.TENSORS and attribute.tensors:
        return _tensor_value(attribute.tensors[0])
    if attribute.type == _A.TUPLE:
        return Value(tuple(_shape_value(item) for item in attribute.values))
    return Value(None)


def _parse(proto) -> Graph:
    graph = proto.graph
    primitives = {primitive.name for primitive in proto.primitives}
    constants, nodes = {}, []
    for node in graph.node:
        if node.op_type == "Constant":
            constants[node.output[0]] = attribute_value(node.attribute[0]) if node.attribute else NOT_A_VALUE
            continue
        # "REF::MatMul:5": a reference to the primitive "MatMul:5" of the model's table; anything else applies a
        # value the graph computes (a branch chosen by Switch, a subgraph): CALL.
        target = node.op_type[5:] if node.op_type.startswith("REF::") else None
        op = target.rsplit(":", 1)[0] if target in primitives else CALL
        # A call's first input is what it calls (a Switch's output: the branch taken).
        called = (target,) if op == CALL and target else ()
        nodes.append(Node(node.output[0], op, called + tuple(node.input), output_value(node), node.domain))
    values = {item.name: _tensor_value(item.tensor[0]) for item in graph.input if item.tensor}
    return Graph(tuple(item.name for item in graph.input), values,
                 frozenset(item.name for item in graph.parameter), tuple(nodes), constants,
                 graph.output[0].name if graph.output else "")


def forward_graph(network: nn.Cell, inputs: tuple) -> Optional[Graph]:
    """The frontend graph of `network` on `inputs` (Tensors of the shapes and dtypes it will run on; their values are
    not read), or None where MindSpore gives none. Errors of the compile (the network's own) propagate."""
    kept = {name: network.__dict__[name] for name in _SET_BY_COMPILE if name in network.__dict__}
    caches = {name: set(getattr(network, name)) for name in ("compile_cache",) if hasattr(network, name)}
    phases = dict(network.phase_cache) if hasattr(network, "phase_cache") else None
    phase = None
    saves = ms.get_context("save_graphs")
    try:
        with random_state_kept():
            if saves:   # the user's IR dumps are of their graphs: this one is not written there
                ms.set_context(save_graphs=False)
            phase, _ = _EXECUTOR.compile(network, *inputs, phase=_PHASE, do_convert=False)
        proto = _EXECUTOR._get_func_graph_proto(network, phase, "mind_ir")   # pylint: disable=protected-access
        if not proto:
            return None
        model = mind_ir_pb2.ModelProto()
        model.ParseFromString(proto)
        return _parse(model)
    finally:
        if saves:
            ms.set_context(save_graphs=saves)
        for name in _SET_BY_COMPILE:
            if name in kept:
                network.__dict__[name] = kept[name]
            else:
                network.__dict__.pop(name, None)
        for name, cache in caches.items():
            getattr(network, name).intersection_update(cache)
        if phases is not None:
            network.phase_cache.clear()
            network.phase_cache.update(phases)
        if phase is not None:
            _EXECUTOR.del_net_res(network, {phase})
