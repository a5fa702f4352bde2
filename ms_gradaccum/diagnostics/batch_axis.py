"""The batch axis through the loss network's frontend graph (``_mindspore.frontend``): one rule per primitive, as JAX's
``vmap`` decides a function's batching from each primitive's rule, never from the values.

Each value of the graph gets one of these states, from its inputs' states and the primitive's rule in :data:`RULES`:

- :class:`Fixed`: the same for every row (weights, constants, inputs given whole, random draws of a fixed shape).
- :class:`Rows`: axis `axis` carries the rows, each row's slice computed from that row alone (row-wise ops keep rows
  independent; a reshape that merges the rows with the next axis, ``(B, T, V) -> (B*T, V)``, is followed). `chain`:
  where it is a function of one input alone, the steps that compute it (a count is replayed from them per micro-batch).
- :class:`Reduced`: a linear combination of reductions over the rows: each term a sum, a mean (a sum over a constant
  proportional to the rows) or a sum over a count computed from one input (labels other than an ignore value, a float
  mask's sum, ``labels >= 0``), plus terms that do not depend on the rows.
- :class:`Coupled`: rows mixed before the final reduction (a matmul or a softmax over the rows, sort, top-k or max over
  them, a nonlinear function of a reduction over them, statistics over the batch used on each row): no split of the
  rows reproduces the full batch.
- :class:`Unknown`: a primitive without a rule (control flow, a call the graph keeps opaque).

Random draws change no structure; unused weights and the data's values play no part. Primitives with a rule:
``RULES``' keys (listed in docs/design.md, "The loss contract").
"""
import dataclasses
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class Fixed:
    weights: bool = False


@dataclasses.dataclass(frozen=True)
class Rows:
    axis: int
    weights: bool = False
    chain: Optional[tuple] = None   # (input position, steps), where it is a function of that input alone
    outer: int = 1   # the rows axis holds `outer` blocks of all rows ((T, B, E) -> (T*B, E): T); whole rows are 1

    def at(self, axis: int, weights: Optional[bool] = None, chain=None) -> "Rows":
        """The same rows on `axis` of an op's output (no chain unless given)."""
        return Rows(axis, self.weights if weights is None else weights, chain, self.outer)


@dataclasses.dataclass(frozen=True)
class Reduced:
    terms: frozenset                 # "sum", "mean", ("count", chain, floor), "fixed"
    weights: bool = False
    elements: Optional[int] = None   # a single sum's summed elements (a division by them is a mean)
    chain: Optional[tuple] = None    # a single sum of a function of one input: a count
    divisions: tuple = ()            # (node, divisor): divisions taken for a mean, shape-dependence to confirm


@dataclasses.dataclass(frozen=True)
class Coupled:
    op: str
    scope: str
    why: str


@dataclasses.dataclass(frozen=True)
class Unknown:
    op: str
    scope: str
    why: str = "a primitive the table has no rule for"


@dataclasses.dataclass(frozen=True)
class Many:
    items: tuple


DEAD = (Coupled, Unknown)
COUNT_UNREAD = "a count over the rows the package cannot take per micro-batch"
NORMALISER = "it divides by a sum over the batch computed from the network's output"
COMPARE = {"Equal": "eq", "NotEqual": "ne", "Greater": "gt", "GreaterEqual": "ge", "Less": "lt", "LessEqual": "le"}
SWAPPED = {"gt": "lt", "ge": "le", "lt": "gt", "le": "ge", "eq": "eq", "ne": "ne"}


class Context:
    """What a rule reads beyond its inputs' states: the node, the constants, the values' shapes, the rows."""

    def __init__(self, node, states: list, shapes: list, constants: list, rows: int, out_shape=None,
                 node_index: int = -1, literals: frozenset = frozenset()):
        self.node, self.states, self.shapes, self.constants, self.rows = node, states, shapes, constants, rows
        self._out_shape = out_shape
        self.node_index, self.literals = node_index, literals

    @property
    def out_shape(self):
        """The output's shape (a tuple of ints; for an op returning several, a tuple of ``frontend.Value``)."""
        return self.node.out.shape if self._out_shape is None else self._out_shape

    def first_output(self) -> "Context":
        """The same, with the shape of the first of several outputs as the output's."""
        shape = self.out_shape
        first = shape[0].shape if isinstance(shape, tuple) and shape and not isinstance(shape[0], int) else shape
        return Context(self.node, self.states, self.shapes, self.constants, self.rows, first, self.node_index,
                       self.literals)

    @property
    def several(self) -> int:
        """How many outputs the op returns (0: one tensor)."""
        shape = self.out_shape
        return len(shape) if isinstance(shape, tuple) and shape and not isinstance(shape[0], int) else 0

    def coupled(self, why: str) -> Coupled:
        return Coupled(self.node.op, self.node.scope, why)

    def axes(self, index: int, rank: int) -> Optional[tuple]:
        """The axes a reduction's constant input `index` names, normalised; every axis for None or ()."""
        value = self.constants[index] if index < len(self.constants) else None
        if value is None or value == ():
            return tuple(range(rank))
        if isinstance(value, (int, np.integer)):
            value = (int(value),)
        if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
            return tuple(sorted(v % max(rank, 1) for v in value))
        return None


def _rank(shape) -> int:
    return len(shape) if isinstance(shape, tuple) else 0


def _weights(states) -> bool:
    return any(getattr(s, "weights", False) for s in states)


def _first_dead(states):
    dead = [s for s in states if isinstance(s, DEAD)]
    coupled = [s for s in dead if isinstance(s, Coupled)]
    return (coupled or dead or [None])[0]


def _scalar(value):
    """A constant's value as a Python number (a 0-d or one-element array too), else None."""
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return value.item() if hasattr(value, "item") else value
    if isinstance(value, np.ndarray) and value.size == 1:
        return value.reshape(()).item()
    return None


def elementwise(ctx: Context, step=None):
    """Row-wise, broadcasting: the rows stay on the axis they are on (every row-carrying input on the same one)."""
    dead = _first_dead(ctx.states)
    if dead is not None:
        return dead
    rank = _rank(ctx.out_shape)
    rows = [(i, s) for i, s in enumerate(ctx.states) if isinstance(s, Rows)]
    reduced = [s for s in ctx.states if isinstance(s, Reduced)]
    if reduced:
        return _on_reduced(ctx, reduced, bool(rows))
    if not rows:
        return Fixed(_weights(ctx.states))
    axes = {(rank - _rank(ctx.shapes[i]) + s.axis, s.outer) for i, s in rows}
    if len(axes) > 1:
        return ctx.coupled("rows on different axes meet (a transposed batch)")
    axis, outer = axes.pop()
    if axis < 0:
        return Unknown(ctx.node.op, ctx.node.scope, "an op whose output has fewer axes than its inputs")
    chain = None
    if len(rows) == 1 and step is not None:
        index, state = rows[0]
        others = [c for i, c in enumerate(ctx.constants) if i != index and i < len(ctx.states)]
        made = step(ctx, index, others)
        if made is not None and state.chain is not None and not _weights(ctx.states):
            chain = (state.chain[0], state.chain[1] + (made,))
    return Rows(axis, _weights(ctx.states), chain, outer)


# A constant this small added to a sum over the rows is an epsilon against 0/0: the sum's kind is kept (exact to
# EPSILON over the count).
EPSILON = 1e-5
LINEAR = {"Add", "Sub", "AddExt", "SubExt", "Neg", "Mul", "Muls", "Div", "Divs", "RealDiv", "DivMod", "Maximum", "Cast",
          "Depend", "Identity", "StopGradient", "Reshape", "ExpandDims", "Squeeze", "Flatten", "Adds", "Subs"}


def _on_reduced(ctx: Context, reduced: list, rows: bool):
    """An elementwise op on reductions over the rows: linear ones keep a linear combination; anything else, or a
    reduction used on each row, couples the rows."""
    op = ctx.node.op
    if rows:
        return ctx.coupled("a reduction over the rows (statistics over the batch) is used on each row")
    if op not in LINEAR:
        return ctx.coupled(f"{op} of a reduction over the rows is not a combination of per-row terms")
    states = ctx.states
    if op in ("Mul",) and len(reduced) == 2:
        return ctx.coupled("a product of two reductions over the rows")
    if op in ("Div", "RealDiv") and isinstance(states[1], Reduced):
        return _divided(ctx, states[0], states[1])
    if op in ("Div", "RealDiv", "Divs") and isinstance(states[0], Reduced) and len(reduced) == 1:
        return _scaled(ctx, states[0], _scalar(ctx.constants[1]) if len(ctx.constants) > 1 else None)
    if op in ("Mul", "Muls") and len(reduced) == 1 and len(states) == 2:
        index = 0 if isinstance(states[0], Reduced) else 1
        factor = _scalar(ctx.constants[1 - index])
        return _scaled(ctx, states[index], 1.0 / factor if factor else None)
    if op in ("Add", "AddExt", "Adds") and len(reduced) == 1 and len(states) == 2 and reduced[0].terms == {"sum"}:
        index = 0 if isinstance(states[0], Reduced) else 1
        epsilon = _scalar(ctx.constants[1 - index])
        if epsilon is not None and abs(epsilon) <= EPSILON:
            return reduced[0]   # a count plus an epsilon against 0/0 (MindFormers' CrossEntropyLoss): the count
    if op == "Maximum" and len(reduced) == 1 and isinstance(states[0], Reduced) and states[0].chain is not None:
        floor = _scalar(ctx.constants[1]) if len(ctx.constants) > 1 else None
        if floor is not None:
            return dataclasses.replace(states[0], chain=states[0].chain + (("floor", float(floor)),))
    if op == "Maximum" and len(reduced) == 1 and isinstance(states[0], Reduced):
        return dataclasses.replace(states[0], elements=None)   # a floor on a normaliser the package cannot replay
    if op == "Maximum":
        return ctx.coupled("a maximum of reductions over the rows")
    terms = frozenset().union(*(s.terms for s in reduced))
    if any(isinstance(s, Fixed) for s in states) and op in ("Add", "Sub", "AddExt", "SubExt", "Adds", "Subs"):
        terms |= {"fixed"}
    single = reduced[0] if len(reduced) == 1 and op not in ("Add", "Sub", "AddExt", "SubExt") else None
    return Reduced(terms, _weights(states), single.elements if single else None, single.chain if single else None,
                   sum((s.divisions for s in reduced), ()))


def _scaled(ctx: Context, state: Reduced, divisor):
    """A reduction times or over a constant. A sum over a constant proportional to the rows is a mean, a mean times
    one is a sum: proportional, not equal by chance, where the constant changes with the rows (``divisions``: the
    graph compiled at another row count confirms it; `ctx.literals` holds those it did not)."""
    plain = dataclasses.replace(state, elements=None, chain=None if divisor not in (1, 1.0) else state.chain)
    if not divisor or ctx.node_index in ctx.literals:
        return plain
    divisor = float(divisor)
    if state.terms == {"sum"} and divisor >= ctx.rows and divisor % ctx.rows == 0:
        changed = "mean"
    elif state.terms == {"mean"} and 1.0 / divisor >= ctx.rows and round(1.0 / divisor) % ctx.rows == 0:
        changed = "sum"
    else:
        return plain
    return Reduced(frozenset({changed}), state.weights, None, None,
                   state.divisions + ((ctx.node_index, divisor),))


def _divided(ctx: Context, numerator, denominator: Reduced):
    """A reduction over the rows divided by another: a mean over a count taken from inputs, where the count is a sum of
    a function of the inputs alone; a normaliser that depends on the weights (Dice) couples the rows."""
    if denominator.weights:
        # Forward graphs hold no stop_gradient: a detector's normaliser without gradient and a Dice loss's with one
        # look the same here (the message gives the route of each).
        return Unknown(ctx.node.op, ctx.node.scope, NORMALISER)
    if not isinstance(numerator, Reduced) or not numerator.terms <= {"sum"}:
        return ctx.coupled("a mean divided by a count over the rows")
    if denominator.terms != {"sum"}:
        return ctx.coupled("a reduction over the rows divided by a mean or a combination of them")
    if denominator.chain is None:
        return Unknown(ctx.node.op, ctx.node.scope, COUNT_UNREAD)
    return Reduced(frozenset({("count", denominator.chain)}), numerator.weights, None, None,
                   numerator.divisions + denominator.divisions)

