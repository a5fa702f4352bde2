"""Losses that average over valid tokens: the warning where the exact route (``token_sum_loss``) is not taken.

A loss such as ``nn.CrossEntropyLoss(ignore_index=-100, reduction='mean')`` divides by the number of labels it does not
ignore (times their class weights), and MindFormers' ``CrossEntropyLoss`` by the number of unmasked tokens.
Micro-batches with different such counts are not weighted by their rows: only ``(loss_sum, count)`` with
``per_token_loss=True`` divides the whole batch's sum by the whole batch's count (the bug transformers fixed in 4.46
with ``num_items_in_batch``).
"""
import contextlib
import warnings

import numpy as np
from mindspore import nn, Tensor


def is_mindformers_cross_entropy(cell: nn.Cell) -> bool:
    return type(cell).__name__ == "CrossEntropyLoss" and type(cell).__module__.startswith("mindformers") and \
        hasattr(cell, "calculate_per_token_loss")


def token_means(network: nn.Cell) -> list:
    """``[(name, cell, always), ...]``: the cells of `network` whose loss is a mean over valid tokens. `always`: the
    update differs from the full batch's whatever the labels (class weights, MindFormers' input_mask); else only
    where the labels make it so (ignored labels, several labels per row), which :class:`LabelWatch` looks at."""
    found = []
    for name, cell in network.cells_and_names():
        if isinstance(cell, (nn.CrossEntropyLoss, nn.NLLLoss)) and cell.reduction == "mean":
            found.append((name or "network", cell, cell.weight is not None))
        elif is_mindformers_cross_entropy(cell) and not cell.calculate_per_token_loss:
            found.append((name or "network", cell, True))
    return found


def describe(name: str, cell: nn.Cell) -> str:
    if is_mindformers_cross_entropy(cell):
        return f"{name} (MindFormers CrossEntropyLoss: mean over the tokens its input_mask keeps)"
    weighted = ", weighted by class" if cell.weight is not None else ""
    return (f"{name} ({type(cell).__name__}: mean over the labels that are not "
            f"ignore_index={cell.ignore_index}{weighted})")


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
    cells = [describe(name, cell) for name, cell, always in token_means(network) if always]
    if cells:
        _warn(cls_name, cells, "when micro-batches hold different numbers of valid tokens (padding, ignored labels, "
                               "class weights)")


class LabelWatch:
    """On the first step, the labels that reach the token-mean losses whose equivalence depends on them
    (``nn.CrossEntropyLoss``/``nn.NLLLoss`` with a mean and no class weights): one label per row and none ignored is a
    mean over rows (exact, nothing said); ignored labels, or several labels per row, get the warning. :meth:`watching`
    hooks one eager forward pass (the loss contract's); where none runs, the loss check still stops a pair of
    micro-batches whose counts differ."""

    def __init__(self, network: nn.Cell, cls_name: str, declared: bool):
        self.cls_name = cls_name
        self.cells = [] if declared else [(name, cell) for name, cell, always in token_means(network) if not always]
        self.findings = {}

    @property
    def armed(self) -> bool:
        return bool(self.cells)

    @contextlib.contextmanager
    def watching(self, rows: int, batch: tuple = ()):
        """For one eager forward pass on the first `rows` rows of `batch`: looks at what reaches each watched cell (in
        the whole batch where the labels are a batch input's first rows); warns after it. Spent afterwards."""
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
            found = [f"{describe(name, cell)}, {self.findings[name]}" for name, cell in cells if name in self.findings]
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
