"""Losses the package recognises as means over valid labels, made exact whatever the labels hold.

``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` with ``reduction='mean'`` divide by the labels that are not ``ignore_index``
(times their class weights), MindFormers' ``CrossEntropyLoss`` by the tokens its ``input_mask`` keeps. Over
micro-batches holding different such counts a mean of means is not the batch's mean (transformers' bug, fixed in 4.46
with ``num_items_in_batch``). Where a cell that splits or sums batches is told nothing about its loss (no `kind`,
`per_token_loss` or `reduction`) and its network holds such a cell, :func:`recognised` gives the spec the kind
:class:`CountedMean`, and the engine runs :func:`counting_view` of the network: a copy in which that cell is a
:class:`CountingLoss`, its ``(loss_sum, count)`` form (``token_sum_loss``) returning ``loss_sum / count`` as the mean
does, and adding its count to a :class:`TokenCounter` that the engine reads after each micro-batch. Each micro-batch
then weighs its count: the batch's loss and gradient are its sum over its count, on every step, with any labels. The
user's network is not changed.
"""
import dataclasses

import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.surroundings import parallel_pass_in_force, with_child_replaced
from ms_gradaccum._mindspore.step_graph import GUARD
from ms_gradaccum.core.kinds import LossKind, LossSpec
from ms_gradaccum.core.token_sum import is_token_mean, token_sum_loss


def token_mean_cells(network: nn.Cell) -> list:
    """``[name, ...]``: the cells of `network` whose loss is a mean over valid labels or tokens (see the module
    docstring), by their names in ``network.cells_and_names()`` (``''`` for the network itself)."""
    return [name for name, cell in network.cells_and_names() if is_token_mean(cell)]


@ms.jit_class
class CountedMean(LossKind):
    """A mean over what the network's recognised loss cells count (valid labels, unmasked tokens): each micro-batch
    weighs its count (in count units); a micro-batch whose network did not call them weighs its rows, as a row mean.

    Attributes:
        cells (tuple[str]): The recognised cells, by name.
    """
    counts_in_network = True
    sums_across_ranks = True   # the whole batch's count, all devices': as one process on the global batch
    in_parallel_pass = True   # MindSpore's pass averages micro-batch means, as it did before they were recognised
    description = "a mean over the labels its loss cells count"
    setting = "(a recognised token-mean loss)"

    def __init__(self, cells: tuple):
        self.cells = tuple(cells)

    def tally(self, loss, count, rows, count_unit, inputs):
        weight = count / count_unit
        return weight, loss * weight, weight


def recognised(spec: LossSpec, network: nn.Cell, accumulates: bool) -> LossSpec:
    """`spec` with the kind :class:`CountedMean` where `network` holds recognised token-mean cells, the cell splits or
    sums batches (`accumulates`), nothing was declared about the loss and MindSpore's semi-auto/auto-parallel pass
    does not accumulate (it averages micro-batch means); else `spec` itself."""
    if spec.declared or not accumulates or spec.kind.counts_in_network or parallel_pass_in_force():
        return spec
    cells = token_mean_cells(network)
    if not cells:
        return spec
    return dataclasses.replace(spec, kind=CountedMean(tuple(name or "network" for name in cells)))


class TokenCounter:
    """What the recognised cells counted during one forward pass, and how many times they were called: two float32
    Parameters held outside every cell tree (``accu_state.*``, not in checkpoints), plain attributes of the cells that
    read them in graphs."""

    def __init__(self):
        self.count = Parameter(Tensor(0.0, mstype.float32), name="accu_state.token_count", requires_grad=False)
        self.calls = Parameter(Tensor(0.0, mstype.float32), name="accu_state.token_count_calls",
                               requires_grad=False)


class CountingLoss(nn.Cell):
    """In the engine's copy of the network, a recognised cell: its mean, computed as ``loss_sum / count`` from its
    ``(loss_sum, count)`` form (0 where nothing counts, where the mean itself is 0/0), with the count added to the
    counter. A plain Cell, so that precision flags (``to_float``) reach it as they reach the cell it stands for."""

    def __init__(self, cell: nn.Cell, counter: TokenCounter):
        super().__init__(auto_prefix=False)
        self.summed = token_sum_loss(cell)
        object.__setattr__(self, "counted", counter.count)   # plain attributes: the counter is held outside the tree
        object.__setattr__(self, "calls", counter.calls)

    def construct(self, *args):
        loss_sum, count = self.summed(*args)
        count = ops.stop_gradient(count)
        # The quotient in the count's shape and the loss's dtype, as the cell's own mean (MindFormers': shape (1,)).
        loss = loss_sum / ops.cast(GUARD(count > 0, count, ops.ones_like(count)), loss_sum.dtype)
        loss = ops.depend(loss, ops.assign_add(self.counted, ops.cast(count, mstype.float32).sum()))
        return ops.depend(loss, ops.assign_add(self.calls, Tensor(1.0, mstype.float32)))


def counting_view(network: nn.Cell, kind: CountedMean, counter: TokenCounter) -> nn.Cell:
    """A copy of `network` in which each cell named in ``kind.cells`` counts into `counter` (:class:`CountingLoss`);
    only the cells on the way to them are copied, so weights and every other cell are `network`'s own."""
    cells = dict(network.cells_and_names())
    view = network
    for name in kind.cells:
        path = "" if name == "network" else name
        counting = CountingLoss(cells[path], counter)
        view = with_child_replaced(view, path, counting) if path else counting
    return view
