"""What the cells are told about the loss, validated once into one frozen object (both cells and the adapters take
it): the loss kind (_kinds), chosen by ``kind=`` or by ``per_token_loss``/``reduction``/``min_count``."""
import dataclasses
from typing import Optional

from ms_gradaccum import _kinds
from ms_gradaccum._kinds import LossKind
from ms_gradaccum._validation import (argument_error, check_bool, check_input_indices, check_min_count,
                                      check_positive_int, check_reduction)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """How a loss network is split and what its loss is.

    Attributes:
        micro_size: micro-batches per batch.
        kind: the loss kind (_kinds).
        declared: the kind was given (`kind`, `per_token_loss` or `reduction`): the token-mean warning is then not
            given.
        shared_inputs: indices of the inputs every micro-batch receives whole.
        check_loss: whether the first step checks the loss contract (_contract).
    """
    micro_size: int = 1
    kind: LossKind = dataclasses.field(default_factory=_kinds.RowMean)
    declared: bool = False
    shared_inputs: tuple = ()
    check_loss: bool = True

    # The public arguments of the kind, for messages and the cells' attributes.
    @property
    def per_token_loss(self) -> bool:
        return _kinds.arguments_of(self.kind)["per_token_loss"]

    @property
    def reduction(self) -> str:
        return _kinds.arguments_of(self.kind)["reduction"]

    @property
    def min_count(self) -> float:
        return self.kind.min_count

    @classmethod
    def of(cls, cls_name: str, micro_size: Optional[int] = None, per_token_loss: Optional[bool] = None,
           shared_inputs=None, reduction: Optional[str] = None, min_count: Optional[float] = None,
           check_loss: Optional[bool] = None, kind: Optional[LossKind] = None) -> "LossSpec":
        """The spec of the arguments given (None: the default), each checked, errors naming `cls_name`."""
        micro_size = 1 if micro_size is None else check_positive_int(micro_size, "micro_size", cls_name)
        shared_inputs = () if shared_inputs is None else check_input_indices(shared_inputs, "shared_inputs", cls_name)
        check_loss = True if check_loss is None else check_bool(check_loss, "check_loss", cls_name)
        if kind is not None:
            if not isinstance(kind, LossKind):
                raise TypeError(argument_error(cls_name, "kind", "None or an ms_gradaccum.LossKind", kind))
            given = [name for name, value in (("per_token_loss", per_token_loss), ("reduction", reduction),
                                              ("min_count", min_count)) if value is not None]
            if given:
                raise ValueError(
                    f"For '{cls_name}', the argument 'kind' is {kind!r}, and {', '.join(given)} is given as well: "
                    f"both say what the loss is. Give the kind alone, or these arguments without it.")
            return cls(micro_size, kind, True, shared_inputs, check_loss)
        declared = per_token_loss is not None or reduction not in (None, "mean")
        per_token_loss = False if per_token_loss is None else check_bool(per_token_loss, "per_token_loss", cls_name)
        reduction = "mean" if reduction is None else check_reduction(reduction, cls_name)
        min_count = check_min_count(0.0 if min_count is None else min_count, per_token_loss, cls_name)
        return cls(micro_size, _kinds.of_arguments(per_token_loss, reduction, min_count), declared, shared_inputs,
                   check_loss)

    def merged(self, cls_name: str, owner: str, **given) -> "LossSpec":
        """This spec (held by `owner`) with the arguments `given` to `cls_name` as well: each given one must agree with
        it (``check_loss`` is taken as given)."""
        changes = {}
        for name, value in given.items():
            if value is None:
                continue
            context = {"per_token_loss": self.per_token_loss} if name == "min_count" else {}
            checked = getattr(LossSpec.of(cls_name, **context, **{name: value}), name)
            if name == "check_loss":
                changes[name] = checked
            elif checked != getattr(self, name):
                raise ValueError(
                    f"For '{cls_name}', the argument '{name}' is {value!r} but the {owner} given as 'network' has "
                    f"{name}={getattr(self, name)!r}. Give it once: either {cls_name}(loss_net, optimizer, "
                    f"accumulate_steps, {name}=...) or the {owner}'s.")
        if given.get("per_token_loss") is not None or given.get("reduction") not in (None, "mean") or \
                given.get("kind") is not None:
            changes["declared"] = True
        return dataclasses.replace(self, **changes)
