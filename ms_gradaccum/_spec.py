"""What the cells are told about the loss, validated once into one frozen object (both cells and the MindFormers
wrapper take it)."""
import dataclasses
from typing import Optional

from ms_gradaccum._validation import (check_bool, check_input_indices, check_min_count, check_positive_int,
                                      check_reduction)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """How a loss network is split and what its loss is.

    Attributes:
        micro_size: micro-batches per batch.
        per_token_loss: the network returns ``(loss_sum, count)``.
        declared: `per_token_loss` or `reduction` was given (the token-mean warning is then not given).
        shared_inputs: indices of the inputs every micro-batch receives whole.
        reduction: ``'mean'`` or ``'sum'`` over the rows.
        min_count: the smallest count a batch or window divides by (token losses).
        check_loss: whether the first step checks the loss contract (_contract).
    """
    micro_size: int = 1
    per_token_loss: bool = False
    declared: bool = False
    shared_inputs: tuple = ()
    reduction: str = "mean"
    min_count: float = 0.0
    check_loss: bool = True

    @property
    def sum_over_rows(self) -> bool:
        return self.reduction == "sum"

    @classmethod
    def of(cls, cls_name: str, micro_size: Optional[int] = None, per_token_loss: Optional[bool] = None,
           shared_inputs=None, reduction: Optional[str] = None, min_count: Optional[float] = None,
           check_loss: Optional[bool] = None) -> "LossSpec":
        """The spec of the arguments given (None: the default), each checked, errors naming `cls_name`."""
        micro_size = 1 if micro_size is None else check_positive_int(micro_size, "micro_size", cls_name)
        declared = per_token_loss is not None or reduction not in (None, "mean")
        per_token_loss = False if per_token_loss is None else check_bool(per_token_loss, "per_token_loss", cls_name)
        shared_inputs = () if shared_inputs is None else check_input_indices(shared_inputs, "shared_inputs", cls_name)
        reduction = "mean" if reduction is None else check_reduction(reduction, cls_name)
        min_count = check_min_count(0.0 if min_count is None else min_count, per_token_loss, cls_name)
        check_loss = True if check_loss is None else check_bool(check_loss, "check_loss", cls_name)
        return cls(micro_size, per_token_loss, declared, shared_inputs, reduction, min_count, check_loss)

    def merged(self, cls_name: str, owner: str, **given) -> "LossSpec":
        """This spec (held by `owner`) with the arguments `given` to `cls_name` as well: each given one must agree with
        it (``check_loss`` is taken as given)."""
        changes = {}
        for name, value in given.items():
            if value is None:
                continue
            context = {} if name == "per_token_loss" else {"per_token_loss": self.per_token_loss}
            checked = getattr(LossSpec.of(cls_name, **context, **{name: value}), name)
            if name == "check_loss":
                changes[name] = checked
            elif checked != getattr(self, name):
                raise ValueError(
                    f"For '{cls_name}', the argument '{name}' is {value!r} but the {owner} given as 'network' has "
                    f"{name}={getattr(self, name)!r}. Give it once: either {cls_name}(loss_net, optimizer, "
                    f"accumulate_steps, {name}=...) or the {owner}'s.")
        if given.get("per_token_loss") is not None or given.get("reduction") not in (None, "mean"):
            changes["declared"] = True
        return dataclasses.replace(self, **changes)
