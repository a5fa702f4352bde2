"""A mean over a count the loss network computes from one of its inputs, read from its graph
(``diagnostics.graph_contract``) and counted by the package per micro-batch: :class:`InputCountMean`.

The loss network's graph showed its loss to be a sum over the rows divided by a sum, over the rows, of a function of
one input alone (labels other than an ignore value, ``labels >= 0``, a float mask, any of these after slicing the
labels as language models shift them). Each micro-batch then weighs that count, replayed from the same steps on its
own rows, so the batch's loss is its sum over its whole count, on every step, whatever the inputs hold.
"""
import mindspore as ms
from mindspore import ops
from mindspore.common import dtype as mstype

from ms_gradaccum.core.kinds import LossKind, TokenMean

# How each step reads: for messages.
_TESTS = {"eq": "==", "ne": "!=", "gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def describe(steps: tuple) -> str:
    """The steps as an expression of ``x``, the input (``"sum(x[..., 1:] != -100)"``)."""
    text = "x"
    for step in steps:
        if step[0] == "slice":
            text = f"{text}[sliced]"
        elif step[0] == "compare":
            text = f"({text} {_TESTS[step[1]]} {step[2]})"
        elif step[0] == "not":
            text = f"not {text}"
        elif step[0] == "fill":
            text = f"where({text}, {step[2]}, {step[1]})"
        elif step[0] == "scale":
            text = f"{text} * {step[1]}"
    return f"sum({text})"


@ms.jit_class
class InputCountMean(LossKind):
    """A mean over a count taken from input `position` by `steps` (read from the loss network's graph): each
    micro-batch weighs its own count (in count units), the batch's total floored at `min_count`.

    Attributes:
        position (int): The network's input the count is taken from.
        steps (tuple): What the network does to it before summing (``diagnostics.batch_rules`` records them): reshapes,
            slices, comparisons with a constant, casts, fills.
        min_count (float): The floor the network puts on the count (``max(count, 1)``). Default: ``0.0``.
    """
    sums_across_ranks = True   # the whole batch's count, all devices': as one process on the global batch
    skips_empty = True   # a micro-batch whose count is 0: 0/0 in the network, nothing in the full batch
    graph_readable = True
    setting = "(a mean over a count read from the loss network's graph)"

    def __init__(self, position: int, steps: tuple, min_count: float = 0.0):
        self.position = int(position)
        self.steps = tuple(steps)
        self.min_count = float(min_count)
        self.description = f"a mean over {describe(self.steps)} of input {self.position}"

    def counted_input(self):
        return self.position

    def declaration(self) -> str:
        return TokenMean().declaration()   # no public constructor: the count returned by the network instead

    def count(self, inputs):
        """The count of a micro-batch's `inputs`, replayed from the steps (float32)."""
        x = inputs[self.position]
        for step in self.steps:
            name = step[0]
            if name == "reshape":
                x = x.reshape(step[1])
            elif name == "slice":
                end = step[2] if step[5] % 2 else (x.shape[0],) + step[2][1:]
                x = ops.strided_slice(x, step[1], end, step[3], step[4], step[5], step[6], step[7], step[8])
            elif name == "compare":
                x = _compared(x, step[1], step[2])
            elif name == "not":
                x = ops.logical_not(x)
            elif name == "cast":
                x = ops.cast(x, mstype.float32)
            elif name == "fill":
                x = ops.cast(x, mstype.float32) * (step[2] - step[1]) + step[1]
            elif name == "scale":
                x = ops.cast(x, mstype.float32) * step[1]
        return ops.cast(x, mstype.float32).sum()

    def tally(self, loss, count, rows, count_unit, inputs):
        weight = self.count(inputs) / count_unit
        return weight, loss * weight, weight


def _compared(x, test: str, value):
    if test == "eq":
        return x == value
    if test == "ne":
        return x != value
    if test == "gt":
        return x > value
    if test == "ge":
        return x >= value
    if test == "lt":
        return x < value
    return x <= value
