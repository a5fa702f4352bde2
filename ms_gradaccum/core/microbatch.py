"""Splitting a batch along axis 0 into micro-batches, inside the compiled graph: ``micro_size`` parts as even as
possible (sizes differ by at most one; the caller weights each by its rows; no row is dropped), checked on static
shapes when the graph compiles, with messages naming the input and its shape.
"""
import inspect
from typing import Tuple

from mindspore import ops, Tensor

from ms_gradaccum._mindspore.graph import primexpr
from ms_gradaccum._mindspore.step_graph import GATHERS

def plan(batch: int, micro_size: int) -> Tuple[Tuple[int, int], ...]:
    """``((count, rows), ...)``: micro-batches as even as possible, ``batch = sum(count * rows)``; one entry when
    ``micro_size`` divides ``batch``, else two (the larger first). A smaller batch gives micro-batches of one row."""
    k = min(micro_size, batch)
    rows, extra = divmod(batch, k)
    if extra == 0:
        return ((k, rows),)
    return ((extra, rows + 1), (k - extra, rows))


@primexpr
def planned(batch: int, micro_size: int) -> Tuple[Tuple[int, int], ...]:
    """:func:`plan` while a graph compiles: one constant, not plan's Python compiled as graph code."""
    return plan(batch, micro_size)


# The role of each input of the network, how it reaches the micro-batches (the layout: ((role, index), ...),
# decided when the graph compiles).
SPLIT, SHARED, CONSTANT = 0, 1, 2


def input_names(network) -> tuple:
    """The names of the positional parameters of ``network.construct`` (for messages); empty for ``*inputs``."""
    try:
        parameters = inspect.signature(network.construct).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _label(index: int, names: tuple) -> str:
    return f"input {index} ('{names[index]}')" if index < len(names) else f"input {index}"


def input_shapes(inputs: tuple) -> tuple:
    """Per input: its shape if it is a Tensor, else None (None, a Python number: passed to every micro-batch as is)."""
    shapes = ()
    for x in inputs:
        if isinstance(x, Tensor):
            shapes += (x.shape,)
        else:
            shapes += (None,)
    return shapes


def _axis_hint(shapes: tuple, names: tuple, first: int, index: int) -> str:
    """The fix for split inputs whose axis 0 differs: an axis 0 of 1 is an input shared by the whole batch (position
    ids of shape (1, T)); an input holding the other's batch size on another axis has its batch axis there (a
    time-major sequence (T, B, ...))."""
    for one in (index, first):
        if shapes[one][0] == 1:
            return (f" If {_label(one, names)} is shared by the whole batch rather than one row per sample (e.g. "
                    f"position ids of shape (1, T)), declare it: shared_inputs=({one},).")
    for one, other in ((first, index), (index, first)):
        if shapes[other][0] in shapes[one][1:]:
            axis = shapes[one][1:].index(shapes[other][0]) + 1
            return (f" If the batch axis of {_label(one, names)} is axis {axis} (a time-major sequence of shape (T, B, "
                    f"...)), give it batch-major: the cell splits every input along axis 0 (e.g. x.swapaxes(0, "
                    f"{axis}), with the network reading it so).")
    return (" Every split input must hold one row per sample along axis 0; an input shared by the whole batch is "
            "declared in shared_inputs.")


@primexpr
def plan_inputs(cls_name: str, shapes: tuple, shared_inputs: tuple, names: tuple, micro_size: int) -> tuple:
    """``((role, index), ...)`` per input: SPLIT along axis 0 (the index among the split inputs), SHARED (a Tensor every
    micro-batch receives whole: declared in `shared_inputs`, or 0-d) or CONSTANT (None, a Python number). Refuses,
    when the graph compiles, a declaration out of range, no input to split, and split inputs whose axis 0 differs
    or is missing, empty or dynamic, naming the input."""
    for index in shared_inputs:
        if index >= len(shapes):
            raise ValueError(
                f"For '{cls_name}', the argument 'shared_inputs' names input {index}, but the network was called with "
                f"{len(shapes)} input(s) (indices 0 to {len(shapes) - 1}).")
    layout, counts, first = (), [0, 0, 0], None
    for index, shape in enumerate(shapes):
        if shape is None:
            role = CONSTANT
        elif index in shared_inputs or not shape:
            role = SHARED
        else:
            role = SPLIT
            if shape[0] < 0:
                raise ValueError(
                    f"For '{cls_name}', {_label(index, names)} has a dynamic batch size (shape {shape}); the batch "
                    f"size must be static to be split into micro_size={micro_size} micro-batches.")
            if shape[0] == 0:
                raise ValueError(f"For '{cls_name}', {_label(index, names)} has an empty batch (shape {shape}); there "
                                 f"is nothing to train on.")
            if first is None:
                first = index
            elif shape[0] != shapes[first][0]:
                raise ValueError(
                    f"For '{cls_name}', all inputs split into micro-batches must have the same batch size (axis 0), "
                    f"but {_label(first, names)} has shape {shapes[first]} and {_label(index, names)} has shape "
                    f"{shape}.{_axis_hint(shapes, names, first, index)}")
        layout += ((role, counts[role]),)
        counts[role] += 1
    if first is None:
        raise ValueError(
            f"For '{cls_name}', no input can be split into micro_size={micro_size} micro-batches: every input is a "
            f"0-d Tensor, None, a number or declared in shared_inputs={shared_inputs}. At least one input needs a "
            f"batch axis 0.")
    return layout


@primexpr
def all_split(layout: tuple) -> bool:
    """Whether every input is split (the common case: the inputs pass as they are, no tuple building in the graph)."""
    return all(role == SPLIT for role, _ in layout)


def partition(inputs: tuple, layout: tuple) -> Tuple[tuple, tuple, tuple]:
    """``(split, shared, constants)``: the inputs by their role in `layout`, each in order."""
    if all_split(layout):
        return inputs, (), ()
    split, shared, constants = (), (), ()
    for position in range(len(layout)):
        role = layout[position][0]
        if role == SPLIT:
            split += (inputs[position],)
        elif role == SHARED:
            shared += (inputs[position],)
        else:
            constants += (inputs[position],)
    return split, shared, constants


def assemble(micro: tuple, shared: tuple, constants: tuple, layout: tuple) -> tuple:
    """The network's inputs for one micro-batch, in their original order: `micro` holds the split ones."""
    if all_split(layout):
        return micro
    args = ()
    for role, index in layout:
        if role == SPLIT:
            args += (micro[index],)
        elif role == SHARED:
            args += (shared[index],)
        else:
            args += (constants[index],)
    return args


def single_element(shape: tuple) -> bool:
    """Whether a static shape holds exactly one element: ``()``, ``(1,)``, ``(1, 1)``..."""
    return all(dim == 1 for dim in shape)


@primexpr
def check_loss_output(cls_name: str, returns_count: bool, is_tuple: bool, shapes: tuple) -> None:
    """The network's output must be what its loss kind says: a single-element loss (shape ``()`` or ``(1,)``), or with
    `returns_count` a tuple (loss_sum, count) of two such. `shapes`: the shape of each output."""
    returned = (f"a tuple of {len(shapes)} element(s) with shapes {shapes}" if is_tuple
                else f"a single Tensor of shape {shapes[0]}")
    if returns_count:
        if not is_tuple or len(shapes) != 2 or not all(single_element(shape) for shape in shapes):
            raise ValueError(
                f"For '{cls_name}', with per_token_loss=True the argument 'network' must return a tuple (loss_sum, "
                f"count) of two single-element Tensors (e.g. the sum of a masked token loss and the number of valid "
                f"tokens), but it returned {returned}. Return (loss_sum, count), or set per_token_loss=False for a "
                f"mean loss.")
    elif is_tuple:
        raise ValueError(
            f"For '{cls_name}', the argument 'network' must return a scalar loss, but it returned {returned}. "
            f"Auxiliary outputs (logits, metrics) are not carried through the accumulation: return only the loss. "
            f"If the tuple is (loss_sum, count), e.g. a masked token loss and the number of valid tokens, pass "
            f"per_token_loss=True.")
    elif not single_element(shapes[0]):
        raise ValueError(
            f"For '{cls_name}', the argument 'network' must return a single-element loss (shape () or (1,)), but it "
            f"returned shape {shapes[0]}. Reduce the loss inside the network, e.g. with reduction='mean' in the loss "
            f"function, or return (loss_sum, count) with per_token_loss=True for a loss normalised by a count such as "
            f"the number of tokens. Where the cell is the backbone of a cell that computes the loss of its output "
            f"(Model(cell, loss_fn=...) builds one), it gets the data without its labels: put the loss inside, "
            f"Model({cls_name}(nn.WithLossCell(network, loss_fn), micro_size), optimizer=...).")


# The per-input work of the split is one Map over the inputs: a Python loop building a tuple compiles into subgraphs
# of its own per input and part (docs/measurements.md, "Why the code is shaped so").
_MAP = ops.Map()
_GATHER = ops.Gather()
_part_of = ops.MultitypeFuncGraph("_part_of")
_row_of = ops.MultitypeFuncGraph("_row_of")


@_part_of.register("Number", "Number", "Number", "Tensor")
def _part_of_tensor(start, count, rows, x):
    part = x if count * rows == x.shape[0] else x[start:start + count * rows]
    return part.reshape((count, rows) + x.shape[1:])


@_row_of.register("Tensor", "Number", "Tensor")
def _row_of_tensor(i, k, x):
    # Split input k's Gather carries its index: the loss contract finds the micro-batch in the compiled step's graph
    # (_mindspore.step_graph).
    return GATHERS[k](x, i, 0) if k < len(GATHERS) else _GATHER(x, i, 0)


@primexpr
def _indices(count: int) -> tuple:
    return tuple(range(count))


def split_batch(inputs: tuple, micro_size: int) -> Tuple:
    """The split inputs (:func:`plan_inputs`) along axis 0 following :func:`plan`: ``((inputs, count, rows), ...)``,
    each part's inputs reshaped from ``(count * rows, ...)`` to ``(count, rows, ...)``; no row is dropped."""
    batch = inputs[0].shape[0]
    parts = ()
    start = 0
    for count, rows in planned(batch, micro_size):
        parts += ((_MAP(ops.partial(_part_of, start, count, rows), inputs), count, rows),)
        start += count * rows
    return parts


def micro_batch(split: tuple, i) -> Tuple:
    """Micro-batch ``i`` (a Tensor counter, so the loop over micro-batches is not unrolled) of every input."""
    return _MAP(ops.partial(_row_of, i), _indices(len(split)), split)


def micro_batch_rows(batch: int, micro_size: int) -> list:
    """The rows of each micro-batch of a batch, in order (the larger first)."""
    return [rows for count, rows in plan(batch, micro_size) for _ in range(count)]


def split_as_compiled(engine, inputs: tuple) -> tuple:
    """``(split, shared, constants, layout)`` of the owner's `inputs`, laid out as `engine`'s graph lays them out."""
    layout = plan_inputs(engine.owner_name, input_shapes(inputs), engine.shared_inputs, engine.input_names,
                         engine.micro_size)
    return partition(inputs, layout) + (layout,)


def check_tensor_inputs(cls_name: str, inputs: tuple) -> None:
    """Refuses NumPy arrays among the inputs: they would reach the graph as constants, never split."""
    for index, x in enumerate(inputs):
        if type(x).__module__ == "numpy" and hasattr(x, "shape"):
            raise TypeError(
                f"For '{cls_name}', every input to split must be a mindspore.Tensor, but input {index} is a "
                f"numpy.ndarray of shape {tuple(x.shape)}. Pass mindspore.Tensor(array) (a Dataset's iterator and "
                f"Model.train give Tensors already).")


@primexpr
def check_loss_dtype(cls_name: str, dtypes: tuple) -> None:
    """The loss (the first output) must be a float Tensor: an integer has no gradient to accumulate."""
    if dtypes and "float" not in str(dtypes[0]).lower():
        raise TypeError(
            f"For '{cls_name}', the argument 'network' must return a floating-point loss (float16, bfloat16, float32 "
            f"or float64), but it returned {dtypes[0]}. An integer (a count of correct predictions, an argmax) has no "
            f"gradient: return the differentiable loss, or cast it where it is meant to train "
            f"(loss.astype(mindspore.float32)).")
