"""The loss contract's check as a public eager entry: :func:`check_loss_contract` runs the check the cells run on the
steps ``contract.check_due`` names, on a batch of one's choosing, and raises as the cells would or reports what it
compared."""
import dataclasses
from typing import Optional

import numpy as np
from mindspore import nn

from ms_gradaccum._engine import MicroBatchGradients
from ms_gradaccum._kinds import LossKind, LossSpec
from ms_gradaccum._mindspore.graph import eager_mode
from ms_gradaccum._microbatch import check_tensor_inputs
from ms_gradaccum._tokens import recognised
from ms_gradaccum._validation import argument_error, check_cell
from ms_gradaccum.diagnostics.contract import ONE

_PUBLIC = "check_loss_contract"


@dataclasses.dataclass(frozen=True)
class LossContractReport:
    """What :func:`check_loss_contract` compared (it raises where they differ).

    Attributes:
        kind (LossKind): The loss kind the cells would use for this network and these arguments (a recognised loss
            counted, ``_tokens.CountedMean``, where nothing was declared).
        rows (tuple): The rows of the first two micro-batches.
        measured (float): The network's loss on the two together, as the kind compares it.
        predicted (float): The same combined from the two micro-batches' own losses by the kind.
        gradients (tuple): The names of the weights whose gradients were compared as well (empty: the values only;
            see ``docs/design.md``, "The loss contract's check").
    """
    kind: LossKind
    rows: tuple
    measured: float
    predicted: float
    gradients: tuple = ()

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("nan")


def check_loss_contract(loss_net: nn.Cell, inputs, micro_size: int, kind: Optional[LossKind] = None,
                        shared_inputs=()) -> LossContractReport:
    """Check, eagerly, that `loss_net`'s loss on `inputs` combines over micro-batches as the cells combine it: the
    check ``GradAccumulationCell`` and ``AccumulatingTrainOneStepCell`` run on the steps :func:`check_due` names, on a
    batch of one's choosing (say, the batch of a dataset most unlike the first: the most padding, the fewest valid
    labels). Nothing is compiled or trained; BatchNorm's moving statistics are left as they were.

    Args:
        loss_net (Cell): The loss network, as given to the cells.
        inputs (tuple): One batch, as the cells are called with it (Tensors; axis 0 is split).
        micro_size (int): Micro-batches per batch (at least 2: the check compares the first two).
        kind (LossKind, optional): What the loss is, as the cells' `kind`; None: as the cells decide without it (a row
            mean, or a recognised token mean counted). Default: ``None``.
        shared_inputs (Union[int, tuple[int]]): Inputs every micro-batch receives whole. Default: ``()``.

    Returns:
        LossContractReport: the kind, the rows and the two values compared.

    Raises:
        TypeError, ValueError: On bad arguments. ValueError: where the loss does not combine (the cells' own message,
            with the route that fits), or a micro-batch's loss or count is not finite while the pair's is; and errors
            the network raises on the micro-batches.
    """
    check_cell(loss_net, "loss_net", _PUBLIC)
    if not isinstance(inputs, (tuple, list)) or not inputs:
        raise TypeError(argument_error(_PUBLIC, "inputs", "a non-empty tuple of the batch's inputs", inputs))
    inputs = tuple(inputs)
    check_tensor_inputs(_PUBLIC, inputs)
    spec = LossSpec.of(_PUBLIC, micro_size, shared_inputs=shared_inputs, kind=kind)
    if spec.micro_size < 2:
        raise ValueError(f"For '{_PUBLIC}', the argument 'micro_size' must be at least 2, but got {micro_size}: the "
                         f"check compares the first two micro-batches with the two together.")
    spec = recognised(spec, loss_net, True)
    engine = MicroBatchGradients(loss_net, spec, overwrite=True, targets=lambda: ((), ()), cls_name=_PUBLIC,
                                 loss_scale=None)
    check = engine.contract
    found = check._passes(engine, inputs)  # pylint: disable=protected-access
    if found is None:
        raise ValueError(
            f"For '{_PUBLIC}', the check cannot run on these inputs: it runs stand-alone or data parallel, on Tensors "
            f"with data and static shapes, and on a batch of at least two micro-batches' rows (micro_size="
            f"{spec.micro_size}). Use check_equivalence to train both ways instead.")
    (first, second, pair), sizes, batch = found
    values = [float(x.asnumpy().reshape(())) for x in first + second]
    if not np.isfinite(values).all():
        raise ValueError(
            f"For '{_PUBLIC}', a micro-batch of rows {sizes} returned a non-finite loss or count (nan or inf): the "
            f"cells stop such a step before any weight changes. A loss normalised by a count taken over its own rows "
            f"is 0/0 on a micro-batch without a valid row or token: return (loss_sum, count) and pass "
            f"per_token_loss=True.")
    with eager_mode():
        check._compare(pair[0], pair[1], first[0] + second[0], first[1] + second[1], ONE,  # pylint: disable=W0212
                       sum(sizes), "", where="on this batch")
        measured = check.kind.compared(pair[0], pair[1], sum(sizes), ONE)[0]
        predicted = check.kind.compared(first[0] + second[0], first[1] + second[1], sum(sizes), ONE)[0]
    gradient_passes = check._gradient_passes(batch, sizes)  # pylint: disable=protected-access
    if gradient_passes is not None:
        check.compare_gradients(*gradient_passes, "", where="on this batch")
    compared = tuple(weight.name for weight in gradient_passes[3]) if gradient_passes is not None else ()
    return LossContractReport(spec.kind, tuple(sizes), float(measured.asnumpy().reshape(())),
                              float(predicted.asnumpy().reshape(())), compared)
