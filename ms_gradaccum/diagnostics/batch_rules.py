"""The rules of the batch-axis analysis (``diagnostics.batch_axis`` states their contract), one per primitive, in
:data:`RULES`; :func:`analyse` walks a frontend graph (``_mindspore.frontend``) with them."""
from typing import Optional

import numpy as np

from ms_gradaccum.diagnostics.batch_axis import (COMPARE, DEAD, SWAPPED, Context, Fixed, Many, Reduced, Rows,
                                                 Unknown, _first_dead, _rank, _scalar, _weights, elementwise)


# --- the steps a count is replayed from (core.input_count.InputCountMean) --------------------------------------------

def _compare_step(ctx: Context, index: int, others: list):
    value = _scalar(others[0]) if others else None
    if value is None:
        return None
    test = COMPARE[ctx.node.op]
    return ("compare", test if index == 0 else SWAPPED[test], value)


def _cast_step(ctx: Context, index: int, others: list):
    return ("cast",) if index == 0 else None


def _not_step(ctx: Context, index: int, others: list):
    return ("not",)


def _fill_step(ctx: Context, index: int, others: list):
    """``MaskedFill(base, mask, value)`` of a uniform constant base (ops.cross_entropy's label weights)."""
    if index != 1 or len(ctx.constants) < 3:
        return None
    base, value = ctx.constants[0], _scalar(ctx.constants[2])
    if not isinstance(base, np.ndarray) or not base.size or value is None or not np.all(base == base.flat[0]):
        return None
    return ("fill", base.flat[0].item(), value)


def _scale_step(ctx: Context, index: int, others: list):
    value = _scalar(others[0]) if others else None
    return None if value is None else ("scale", float(value))


def _reshaped(ctx: Context):
    """A reshape-like op (Reshape, ExpandDims, Squeeze, Flatten). Every reshape keeps the elements before and after
    the rows' own index (P and S in ``P x B x S``); the rows are on the axis whose extent brackets them: merged with the
    axes after them (``(B, T, V) -> (B*T, V)``), or inside an axis that holds P blocks of them (``(T, B, E) ->
    (T*B, E)``: `outer` T). Rows spread over two axes are not followed."""
    state = ctx.states[0]
    if not isinstance(state, Rows):
        return elementwise(ctx)
    before, after = ctx.shapes[0], ctx.out_shape
    if not isinstance(before, tuple) or not isinstance(after, tuple) or not after:
        return Unknown(ctx.node.op, ctx.node.scope, "a reshape of shapes the graph does not state")
    prefix = int(np.prod(before[:state.axis])) * state.outer
    extent = 1
    for axis, size in enumerate(after):
        if prefix % extent == 0 and (extent * size) % (prefix * ctx.rows) == 0 and (size != 1 or ctx.rows == 1):
            chain = state.chain
            if chain is not None:
                target = tuple(-1 if a == axis else d for a, d in enumerate(after))
                chain = (chain[0], chain[1] + (("reshape", target),))
            return Rows(axis, state.weights, chain, prefix // extent)
        extent *= size
    return Unknown(ctx.node.op, ctx.node.scope, "a reshape that spreads the rows over two axes")


def _transposed(ctx: Context):
    state = ctx.states[0]
    perm = ctx.constants[1] if len(ctx.constants) > 1 else None
    if not isinstance(state, Rows):
        return elementwise(ctx)
    if not isinstance(perm, tuple):
        return Unknown(ctx.node.op, ctx.node.scope, "a transpose of unknown order")
    return state.at(tuple(p % len(perm) for p in perm).index(state.axis))


def _sliced(ctx: Context):
    """StridedSlice (and the other slices): every row kept (the rows' axis whole) keeps the rows; a slice of the rows
    selects some of them."""
    state = ctx.states[0]
    if not isinstance(state, Rows):
        return elementwise(ctx)
    before, after = ctx.shapes[0], ctx.out_shape
    args = ctx.constants[1:9]
    strided = ctx.node.op == "StridedSlice" and len(args) == 8 and all(isinstance(a, (tuple, int)) for a in args)
    if strided and state.axis == 0 and not (args[5] | args[6] | args[7]) & 1 and not args[5] and not args[6] and \
            isinstance(after, tuple) and after and after[0] == before[0]:
        chain = state.chain
        chain = None if chain is None else (chain[0], chain[1] + (("slice",) + tuple(args),))
        return state.at(0, chain=chain)
    if isinstance(after, tuple) and len(after) == len(before) and after[state.axis] == before[state.axis]:
        return state.at(state.axis)
    if isinstance(after, tuple) and len(after) == len(before) or state.axis == 0:
        return ctx.coupled("a slice that selects some of the rows")
    return Unknown(ctx.node.op, ctx.node.scope, "a slice whose axes the graph does not map")


def _reduction(summing: bool, averaging: bool = False, axes_at: int = 1):
    """Sum, mean or another reduction (max, min, prod, a norm) over the axes its constant input names."""
    def rule(ctx: Context):
        state = ctx.states[0]
        if isinstance(state, DEAD) or isinstance(state, Reduced):
            return state
        if not isinstance(state, Rows):
            return Fixed(state.weights if isinstance(state, Fixed) else False)
        shape = ctx.shapes[0]
        axes = ctx.axes(axes_at, _rank(shape)) if axes_at is not None else tuple(range(_rank(shape)))
        if axes is None:
            return Unknown(ctx.node.op, ctx.node.scope, "a reduction over axes the graph does not state")
        if state.axis not in axes:
            kept = _rank(ctx.out_shape) == _rank(shape)
            return state.at(state.axis if kept else state.axis - sum(a < state.axis for a in axes))
        if not summing:
            return ctx.coupled(f"{ctx.node.op} over the rows")
        elements = int(np.prod([shape[a] for a in axes]))
        chain = state.chain if not state.weights else None
        return Reduced(frozenset({"mean" if averaging else "sum"}), state.weights, None if averaging else elements,
                       None if averaging else chain)
    return rule


def _along(axis_at: int):
    """An op along one axis (softmax, cumulative sums, sort, top-k): row-wise unless that axis carries the rows."""
    def rule(ctx: Context):
        state = ctx.states[0]
        if not isinstance(state, Rows):
            return elementwise(ctx)
        axes = ctx.axes(axis_at, _rank(ctx.shapes[0])) if axis_at is not None else (_rank(ctx.shapes[0]) - 1,)
        if axes is None or state.axis in axes:
            return ctx.coupled(f"{ctx.node.op} along the rows")
        rows = state.at(state.axis)
        return Many((rows,) * ctx.several) if ctx.several else rows
    return rule


def _matmul(transposes_at: Optional[int]):
    """A matrix product: rows on a non-contracted axis of one operand (the other fixed), or on a batch axis of both,
    stay rows; rows on a contracted axis, or meeting other rows, are coupled (a similarity over the batch)."""
    def rule(ctx: Context):
        dead = _first_dead(ctx.states[:2])
        if dead is not None:
            return dead
        a, b = ctx.states[:2]
        rank_a, rank_b, rank = _rank(ctx.shapes[0]), _rank(ctx.shapes[1]), _rank(ctx.out_shape)
        flags = ctx.constants[transposes_at:transposes_at + 2] if transposes_at is not None else (False, False)
        t_a, t_b = (bool(f) if isinstance(f, (bool, int)) else False for f in (tuple(flags) + (False, False))[:2])
        where, outers = [], []
        for state, r, other, transposed in ((a, rank_a, "left", t_a), (b, rank_b, "right", t_b)):
            if not isinstance(state, Rows):
                continue
            free = (r - 1 if transposed else r - 2) if other == "left" else (r - 2 if transposed else r - 1)
            contracted = (r - 2 if transposed else r - 1) if other == "left" else (r - 1 if transposed else r - 2)
            if r == 1 or state.axis == contracted:
                return ctx.coupled("a matrix product over the rows")
            outers.append(state.outer)
            if state.axis == free:
                where.append(rank - 2 if other == "left" else rank - 1)
            else:
                where.append(rank - r + state.axis)
        if not where:
            return Fixed(_weights(ctx.states[:2]))
        if len(where) == 2 and (where[0] != where[1] or where[0] >= rank - 2 or outers[0] != outers[1]):
            return ctx.coupled("a matrix product between rows (a similarity over the batch)")
        return Rows(where[0], _weights(ctx.states[:2]), None, outers[0])
    return rule


def _gathered(ctx: Context):
    """Gather(table, indices, axis): a fixed table looked up by rows' indices (an embedding) gives rows; rows looked up
    along another axis by fixed indices stay rows."""
    table, indices = ctx.states[:2]
    dead = _first_dead(ctx.states[:2])
    if dead is not None:
        return dead
    axis = ctx.constants[2] if len(ctx.constants) > 2 and isinstance(ctx.constants[2], int) else 0
    axis %= max(_rank(ctx.shapes[0]), 1)
    if isinstance(table, Fixed) and isinstance(indices, Rows):
        return indices.at(axis + indices.axis, table.weights)
    if isinstance(table, Rows) and isinstance(indices, Fixed) and table.axis != axis:
        shift = _rank(ctx.shapes[1]) - 1 if table.axis > axis else 0
        return table.at(table.axis + shift, table.weights or indices.weights)
    if isinstance(table, Fixed) and isinstance(indices, Fixed):
        return Fixed(table.weights)
    return ctx.coupled("a gather along the rows")


def _gathered_d(ctx: Context):
    """GatherD(x, dim, index): element-wise along every axis but `dim`."""
    dim = ctx.constants[1] if len(ctx.constants) > 1 and isinstance(ctx.constants[1], int) else None
    x, index = ctx.states[0], ctx.states[2] if len(ctx.states) > 2 else Fixed()
    for state in (x, index):
        if isinstance(state, Rows) and (dim is None or state.axis == dim % _rank(ctx.shapes[0])):
            return ctx.coupled("a gather along the rows")
    inner = Context(ctx.node, [x, index], [ctx.shapes[0], ctx.shapes[2]], [None, None], ctx.rows)
    return elementwise(inner)


def _one_hot(ctx: Context):
    state = ctx.states[0]
    if not isinstance(state, Rows):
        return elementwise(ctx)
    axis = ctx.constants[-1] if isinstance(ctx.constants[-1], int) else -1
    rank = _rank(ctx.out_shape)
    return state.at(state.axis if axis % rank > state.axis else state.axis + 1)


def _joined(ctx: Context):
    """Concat and Stack of a tuple (MakeTuple's Many) along an axis that does not carry the rows."""
    items = ctx.states[0].items if isinstance(ctx.states[0], Many) else tuple(ctx.states[:1])
    dead = _first_dead(items)
    if dead is not None:
        return dead
    axis = ctx.constants[1] if len(ctx.constants) > 1 and isinstance(ctx.constants[1], int) else 0
    rows = {(s.axis, s.outer) for s in items if isinstance(s, Rows)}
    if not rows:
        return Fixed(_weights(items))
    stacked = ctx.node.op in ("Stack", "StackExt")
    rank = _rank(ctx.out_shape)
    (row_axis, outer), = rows if len(rows) == 1 else ((None, 1),)
    if row_axis is None or (not stacked and axis % rank == row_axis):
        return ctx.coupled(f"{ctx.node.op} along the rows")
    return Rows(row_axis + (1 if stacked and row_axis >= axis % rank else 0), _weights(items), None, outer)


def _split(ctx: Context):
    state = ctx.states[0]
    if not isinstance(state, Rows):
        return Many((elementwise(ctx.first_output()),) * max(ctx.several, 1))
    axis = next((c for c in ctx.constants[1:] if isinstance(c, int) and not isinstance(c, bool)), 0)
    if axis % _rank(ctx.shapes[0]) == state.axis:
        return ctx.coupled(f"{ctx.node.op} along the rows")
    count = len(ctx.out_shape) if isinstance(ctx.out_shape, tuple) else 1
    return Many((state.at(state.axis),) * count)


def _per_sample(ctx: Context):
    """Convolutions, pooling, resizing, normalisation per sample (LayerNorm over the axes after the rows, GroupNorm):
    row-wise with the rows first; BatchNorm too (its statistics over the batch are the separate, warned case)."""
    dead = _first_dead(ctx.states)
    if dead is not None:
        return dead
    state = ctx.states[0]
    weights = _weights(ctx.states)
    if not isinstance(state, Rows):
        return Many((Fixed(weights),) * ctx.several) if ctx.several else Fixed(weights)
    if state.axis != 0 or state.outer != 1:
        return Unknown(ctx.node.op, ctx.node.scope, "a per-sample op with the rows on another axis than the first")
    begin = ctx.constants[3] if ctx.node.op == "LayerNorm" and len(ctx.constants) > 3 else None
    if isinstance(begin, int) and begin % _rank(ctx.shapes[0]) == 0:
        return ctx.coupled("a LayerNorm over the rows")
    rows = Rows(0, weights)
    if ctx.several:
        return Many(tuple(rows if _rank(item.shape) and item.shape[0] == ctx.shapes[0][0] else Fixed(weights)
                          for item in ctx.out_shape))
    return rows


def _loss_primitive(reduction_at: Optional[int], mean_by_default: bool = False):
    """A loss primitive with a reduction argument ('none', 'mean', 'sum'; MindSpore's enum 0/1/2 as well)."""
    def rule(ctx: Context):
        dead = _first_dead(ctx.states)
        if dead is not None:
            return dead
        rows = [s for s in ctx.states if isinstance(s, Rows)]
        if not rows:
            return Fixed(_weights(ctx.states))
        if any(s.axis != 0 or s.outer != 1 for s in rows):
            return Unknown(ctx.node.op, ctx.node.scope, "a loss primitive with the rows on another axis")
        value = ctx.constants[reduction_at] if reduction_at is not None and reduction_at < len(ctx.constants) else None
        reduction = {0: "sum", 1: "mean", 2: "none"}.get(value, value) if not isinstance(value, bool) else None
        if reduction is None and mean_by_default:
            reduction = "mean"
        weights = _weights(ctx.states)
        if reduction == "none":
            return Rows(0, weights)
        if reduction in ("mean", "sum"):
            return Reduced(frozenset({reduction}), weights)
        return Unknown(ctx.node.op, ctx.node.scope, "a loss primitive whose reduction the graph does not state")
    return rule


def _per_row_loss(ctx: Context):
    """A loss primitive returning each row's loss (and its gradient): row-wise with the rows first."""
    dead = _first_dead(ctx.states)
    if dead is not None:
        return dead
    if any(isinstance(s, Rows) and (s.axis != 0 or s.outer != 1) for s in ctx.states):
        return Unknown(ctx.node.op, ctx.node.scope, "a loss primitive with the rows on another axis")
    if not any(isinstance(s, Rows) for s in ctx.states):
        return Many((Fixed(_weights(ctx.states)),) * max(ctx.several, 1))
    return Many((Rows(0, _weights(ctx.states)),) * max(ctx.several, 1))


def _with_mask(rule):
    """An op returning ``(out, mask)`` (Dropout): both row-wise as its input."""
    def wrapped(ctx: Context):
        out = rule(ctx.first_output())
        return Many((out,) * ctx.several) if ctx.several else out
    return wrapped


def _ctc(ctx: Context):
    """CTCLossV2(log_probs (T, N, C), targets, input_lengths, target_lengths): per sample, rows on axis 1 of the
    log-probabilities and axis 0 of the others."""
    states = ctx.states[:4]
    dead = _first_dead(states)
    if dead is not None:
        return dead
    expected = (1, 0, 0, 0)
    if any(isinstance(s, Rows) and (s.axis != e or s.outer != 1) for s, e in zip(states, expected)):
        return ctx.coupled("CTC over the rows")
    out = Rows(0, _weights(states))
    return Many((out, Rows(1, out.weights)))


def _fixed(ctx: Context):
    """A value of fixed shape made from no row's data (zeros, ones, a range, random draws, shapes)."""
    return Fixed(False)


def _first(ctx: Context):
    """The state of the first input (Depend, Load, Identity, StopGradient: the value passes through)."""
    return ctx.states[0] if ctx.states else Fixed()


def _detached(ctx: Context):
    """StopGradient: the value passes through, no gradient reaches the weights through it (a normaliser taken from
    the predictions without gradient is a count, though not one the package can take from the inputs)."""
    state = ctx.states[0] if ctx.states else Fixed()
    if isinstance(state, Rows):
        return state.at(state.axis, False)
    if isinstance(state, Reduced):
        return Reduced(state.terms, False, state.elements, None, state.divisions)
    return Fixed(False) if isinstance(state, Fixed) else state
