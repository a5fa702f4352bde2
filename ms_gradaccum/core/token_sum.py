"""``token_sum_loss``: the ``(loss_sum, count)`` form of a loss that averages over valid tokens (``per_token_loss=True``
divides the whole batch's sum by the whole batch's count). The cells use the same form for the losses they recognise
(core.tokens)."""
from mindspore import nn, ops

from ms_gradaccum._mindspore.surroundings import copy_cell
from ms_gradaccum.core.validation import argument_error

_NAME = "token_sum_loss"
_SUPPORTED = ("mindspore.nn.CrossEntropyLoss or mindspore.nn.NLLLoss with reduction='mean', or MindFormers' "
              "CrossEntropyLoss")


def is_mindformers_cross_entropy(cell: nn.Cell) -> bool:
    return type(cell).__name__ == "CrossEntropyLoss" and type(cell).__module__.startswith("mindformers") and \
        hasattr(cell, "calculate_per_token_loss")


def is_token_mean(cell: nn.Cell) -> bool:
    """Whether `cell` is a loss :func:`token_sum_loss` has the ``(loss_sum, count)`` form of: a mean over its valid
    labels (or tokens)."""
    if isinstance(cell, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return cell.reduction == "mean"
    return is_mindformers_cross_entropy(cell) and not cell.calculate_per_token_loss


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
    if is_mindformers_cross_entropy(loss_fn):
        summed = copy_cell(loss_fn)   # its own attributes: the setting below does not reach loss_fn
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
