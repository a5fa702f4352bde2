"""Losses that average over valid tokens: the exact route (token_sum_loss) and the warning where it is not taken.

A loss such as ``nn.CrossEntropyLoss(ignore_index=-100, reduction='mean')`` divides by the number of labels it does not
ignore (times their class weights), and MindFormers' ``CrossEntropyLoss`` by the number of unmasked tokens.
Micro-batches with different such counts are not weighted by their rows: only ``(loss_sum, count)`` with
``per_token_loss=True`` divides the whole batch's sum by the whole batch's count (the bug transformers fixed in 4.46
with ``num_items_in_batch``).
"""
import contextlib
import copy
import warnings

import numpy as np
from mindspore import nn, ops, Tensor

from ms_gradaccum._validation import argument_error

_NAME = "token_sum_loss"
_SUPPORTED = ("mindspore.nn.CrossEntropyLoss or mindspore.nn.NLLLoss with reduction='mean', or MindFormers' "
              "CrossEntropyLoss")


def _is_mindformers_cross_entropy(cell: nn.Cell) -> bool:
    return type(cell).__name__ == "CrossEntropyLoss" and type(cell).__module__.startswith("mindformers") and \
        hasattr(cell, "calculate_per_token_loss")


def _token_means(network: nn.Cell) -> list:
    """``[(name, cell, always), ...]``: the cells of `network` whose loss is a mean over valid tokens. `always`: the
    update differs from the full batch's whatever the labels (class weights, MindFormers' input_mask); else only
    where the labels make it so (ignored labels, several labels per row), which :class:`LabelWatch` looks at."""
    found = []
    # The adapter holds a summing copy of the loss: neither it nor what it holds averages.
    summed = {id(sub) for _, cell in network.cells_and_names() if isinstance(cell, TokenSumLoss)
              for _, sub in cell.cells_and_names()}
    for name, cell in network.cells_and_names():
        if id(cell) in summed:
            continue
        if isinstance(cell, (nn.CrossEntropyLoss, nn.NLLLoss)) and cell.reduction == "mean":
            found.append((name or "network", cell, cell.weight is not None))
        elif _is_mindformers_cross_entropy(cell) and not cell.calculate_per_token_loss:
            found.append((name or "network", cell, True))
    return found


def _describe(name: str, cell: nn.Cell) -> str:
    if _is_mindformers_cross_entropy(cell):
        return f"{name} (MindFormers CrossEntropyLoss: mean over the tokens its input_mask keeps)"
    weighted = ", weighted by class" if cell.weight is not None else ""
    return (f"{name} ({type(cell).__name__}: mean over the labels that are not "
            f"ignore_index={cell.ignore_index}{weighted})")


def token_mean_cells(network: nn.Cell) -> list:
    """``["name (Class, how it averages)", ...]``: the cells of `network` whose loss is a mean over valid tokens."""
    return [_describe(name, cell) for name, cell, _ in _token_means(network)]


def _warn(cls_name: str, cells: list, why: str) -> None:
    warnings.warn(
        f"{cls_name}: the loss averages over valid tokens: {'; '.join(cells)}. Each micro-batch is weighted by its "
        f"rows, so {why} the update differs from the full batch's. Fix: make the loss return (loss_sum, count), with "
        f"ms_gradaccum.token_sum_loss(loss_fn) (for MindFormers' models: calculate_per_token_loss=True in their "
        f"config), and pass per_token_loss=True. If every row holds the same number of valid tokens, pass "
        f"per_token_loss=False to say so.", UserWarning, stacklevel=4)


def warn_token_mean(network: nn.Cell, cls_name: str) -> None:
    """At construction: one UserWarning naming the token-mean loss cells whose update differs from the full batch's
    whatever the labels (class weights, MindFormers' token loss). The others are left to :class:`LabelWatch`."""
    cells = [_describe(name, cell) for name, cell, always in _token_means(network) if always]
    if cells:
        _warn(cls_name, cells, "when micro-batches hold different numbers of valid tokens (padding, ignored labels, "
                               "class weights)")


class LabelWatch:
    """On the first step, the labels that reach the token-mean losses whose equivalence depends on them
    (``nn.CrossEntropyLoss``/``nn.NLLLoss`` with a mean and no class weights): with one label per row and none equal
    to ``ignore_index`` their mean over labels is a mean over rows, and accumulation is exact, so nothing is said.
    Ignored labels present, or several labels per row (sequences, where padding is the rule), get the warning.

    :meth:`watching` wraps one eager forward pass (the loss contract's, see _contract) in forward pre-hooks on those
    cells; the watch looks once per cell and is then spent. Where no eager pass runs (semi-auto parallel, a network
    that runs only in graph mode), it says nothing; the first step's loss check still stops a pair of micro-batches
    whose counts differ."""

    def __init__(self, network: nn.Cell, cls_name: str, declared: bool):
        self.cls_name = cls_name
        self.cells = [] if declared else [(name, cell) for name, cell, always in _token_means(network) if not always]
        self.findings = {}

    @property
    def armed(self) -> bool:
        return bool(self.cells)

    @contextlib.contextmanager
    def watching(self, rows: int, batch: tuple = ()):
        """For one eager forward pass on the first `rows` rows of `batch` (its inputs split along axis 0): looks at
        what reaches each watched cell; warns after it where the labels make the update differ. Labels that are the
        first rows of a batch input (as ``nn.WithLossCell`` hands them over) are looked at in the whole batch. Spent
        afterwards, whatever happened."""
        if not self.cells:
            yield
            return
        handles = [cell.register_forward_pre_hook(self._look(name, rows, batch)) for name, cell in self.cells]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            cells, self.cells = self.cells, []
        if self.findings:
            found = [f"{_describe(name, cell)}, {self.findings[name]}" for name, cell in cells if name in self.findings]
            _warn(self.cls_name, found, "when micro-batches hold different numbers of valid labels")

    def _look(self, name: str, rows: int, batch: tuple):
        def hook(cell, args):
            if len(args) < 2 or not hasattr(args[1], "asnumpy"):
                return None
            logits, labels = args[0], args[1]
            if labels.ndim == logits.ndim:   # class probabilities: the mean is over rows, nothing is ignored
                return None
            labels = labels.asnumpy()
            seen = []
            if labels.size != rows:
                seen.append(f"{labels.size / rows:.4g} labels per row")
            whole = [x.asnumpy() for x in batch if isinstance(x, Tensor) and tuple(x.shape[1:]) == labels.shape[1:]
                     and len(x) >= rows and x.dtype == args[1].dtype]
            whole = [x for x in whole if np.array_equal(x[:rows], labels)]
            labels = whole[0] if whole else labels
            ignored = int((labels == cell.ignore_index).sum())
            if ignored:
                seen.append(f"{ignored} of {labels.size} labels are ignore_index")
            if seen:
                self.findings.setdefault(name, " and ".join(seen) + " on the first step")
            return None
        return hook


class TokenSumLoss(nn.Cell):
    """``(loss_sum, count)`` of an ``nn.CrossEntropyLoss``/``nn.NLLLoss`` mean: the same loss with ``reduction='sum'``
    and the divisor the mean would use (the class weights of the labels that are not ignored; for probability
    labels, the number of rows). The count carries no gradient."""

    def __init__(self, sum_loss: nn.Cell, ignore_index: int, weight):
        super().__init__()
        self.sum_loss = sum_loss
        self.ignore_index = ignore_index
        self.weight = weight

    def construct(self, logits, labels):
        loss_sum = self.sum_loss(logits, labels)
        if labels.ndim == logits.ndim:   # probabilities per class: the mean is over rows (every axis but the class)
            count = ops.cast(logits.size // logits.shape[1], loss_sum.dtype)
            return loss_sum, ops.stop_gradient(ops.fill(loss_sum.dtype, (), count))
        valid = labels != self.ignore_index
        per_label = ops.cast(valid, loss_sum.dtype)
        if self.weight is not None:
            safe = ops.select(valid, labels, ops.zeros_like(labels))
            per_label = per_label * ops.gather(self.weight, safe, 0)
        return loss_sum, ops.stop_gradient(per_label.sum())


def token_sum_loss(loss_fn: nn.Cell) -> nn.Cell:
    r"""
    The ``(loss_sum, count)`` form of a loss that averages over valid tokens, for ``per_token_loss=True``.

    ``nn.CrossEntropyLoss``/``nn.NLLLoss`` with ``reduction='mean'``: a new cell that returns the same loss summed and
    the count the mean divides by (labels other than ``ignore_index``, times their class ``weight``; for probability
    labels, the rows), so that :class:`GradAccumulationCell` divides the whole batch's sum by the whole batch's count.
    MindFormers' ``CrossEntropyLoss``: a copy with its own ``calculate_per_token_loss=True`` (it then returns its
    masked sum and its mask's count). `loss_fn` itself is not changed.

    Args:
        loss_fn (Cell): The loss cell.

    Returns:
        Cell, taking what `loss_fn` takes and returning ``(loss_sum, count)``.

    Raises:
        TypeError: If `loss_fn` is not one of the cells above (a network can also return ``(loss_sum, count)`` itself).
        ValueError: If its reduction is not ``'mean'`` (a sum or per-token loss needs no count).

    Supported Platforms:
        ``CPU``: in CI. Not run on GPU or Ascend.

    Examples:
        >>> from mindspore import nn
        >>> from ms_gradaccum import GradAccumulationCell, token_sum_loss
        >>> net = nn.Dense(8, 4)
        >>> loss_net = nn.WithLossCell(net, token_sum_loss(nn.CrossEntropyLoss(ignore_index=-100)))
        >>> cell = GradAccumulationCell(loss_net, micro_size=4, per_token_loss=True)
        >>> cell.per_token_loss
        True
    """
    if _is_mindformers_cross_entropy(loss_fn):
        summed = copy.copy(loss_fn)
        summed.calculate_per_token_loss = True
        return summed
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        if loss_fn.reduction != "mean":
            raise ValueError(argument_error(_NAME, "loss_fn", "a loss with reduction='mean'", loss_fn,
                                            f"It has reduction={loss_fn.reduction!r}: a sum needs no count."))
        kwargs = dict(weight=loss_fn.weight, ignore_index=loss_fn.ignore_index, reduction="sum")
        if isinstance(loss_fn, nn.CrossEntropyLoss):
            kwargs["label_smoothing"] = loss_fn.label_smoothing
        return TokenSumLoss(type(loss_fn)(**kwargs), loss_fn.ignore_index, loss_fn.weight)
    raise TypeError(argument_error(_NAME, "loss_fn", _SUPPORTED, loss_fn,
                                   "Any other loss can be made to return (loss_sum, count) itself."))
