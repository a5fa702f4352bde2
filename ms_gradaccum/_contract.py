"""The loss contract, checked on the first step instead of assumed.

The cells are exact when the network's loss is what they are told it is: a mean over independent rows (the default),
a sum over them (``reduction='sum'``), or ``(loss_sum, count)`` with ``per_token_loss=True``. Zoos break that without a
sign: a detector's ``B * sum / max(S, 1)``, with ``S`` summed over the whole batch, trained 4 to 16 times too small.

On the first step (per cell; not carried by checkpoints, so every new cell checks once) the network runs forward once
more, on the rows of the first two micro-batches together (two micro-batches' worth), and the result is compared with
what the cell computes from those two micro-batches' own losses, which the micro-batch loop keeps: their row-weighted
mean, their sum, or the sums of ``loss_sum`` and of ``count``. A mismatch stops training before the first update, with
the measured ratio and the route that fits it. Noise that one forward pass sees and the other does not is tolerated
where the network has it: batch statistics (BatchNorm in training, warned about at construction) and random cells
(dropout), for which only a gross mismatch (a ratio outside [1/1.5, 1.5]) stops. What it cannot see: a loss that breaks
the contract on some batches only (the first step's pair passes), or only beyond two micro-batches.
"""
import numbers

from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._internals import compile_time, primexpr
from ms_gradaccum._loss_scale import PrecisionNeutral
from ms_gradaccum._microbatch import assemble, plan
from ms_gradaccum._reduce import Unsaved
from ms_gradaccum._validation import batch_norm_cells, computes_in_float16

# Relative tolerance of the comparison: float32 reductions in another order; float16 networks round far more.
RTOL, RTOL_FLOAT16, ATOL = 1e-3, 2e-2, 1e-6
# Where batch statistics or random cells make the two forward passes differ anyway: only a gross mismatch stops.
NOISY_BAND = 1.5


def random_cells(network: nn.Cell) -> list:
    """``["name (Class)", ...]``: cells of `network` whose output is random in training (dropout with a rate > 0)."""
    found = []
    for name, cell in network.cells_and_names():
        if "dropout" not in type(cell).__name__.lower():
            continue
        rate = getattr(cell, "p", None)
        if rate is None and getattr(cell, "keep_prob", None) is not None:
            rate = 1.0 - float(cell.keep_prob)
        if rate is None or (isinstance(rate, numbers.Real) and rate > 0):
            found.append(f"{name or 'network'} ({type(cell).__name__})")
    return found


@primexpr
def pair_rows(batch: int, micro_size: int) -> int:
    """The rows of the first two micro-batches (0 when a batch holds fewer than two)."""
    sizes = [rows for count, rows in plan(batch, micro_size) for _ in range(count)]
    return sizes[0] + sizes[1] if len(sizes) >= 2 else 0


def routes(kind: str) -> str:
    """The exact routes, for the message."""
    current = {"mean": "a mean over the rows it is given (the default)",
               "sum": "a sum over the rows (reduction='sum')",
               "token": "(loss_sum, count) with per_token_loss=True"}[kind]
    return (f"The cell was told the loss is {current}. If the loss is a sum over the rows, or a mean multiplied by the "
            f"batch size, pass reduction='sum'. If it is normalised by a count taken over the batch (valid tokens, "
            f"targets, a score sum), return (loss_sum, count) and pass per_token_loss=True (min_count=1.0 for a "
            f"max(count, 1) floor, and reduction='sum' as well if it is also multiplied by the batch size). If you "
            f"know the loss is fine here, pass check_loss=False.")


class ContractCheck(PrecisionNeutral):
    """Runs once, on the first step the owner trains (see the module docstring)."""

    def __init__(self, scaled_loss: nn.Cell, network: nn.Cell, micro_size: int, per_token_loss: bool,
                 sum_over_rows: bool, enabled: bool, cls_name: str):
        super().__init__(auto_prefix=False)
        object.__setattr__(self, "_scaled_loss", scaled_loss)   # the engine's own cell: not a second child
        self.micro_size = micro_size
        self.per_token_loss = per_token_loss
        self.sum_over_rows = sum_over_rows
        self.enabled = enabled
        self.owner_name = cls_name
        self.kind = "token" if per_token_loss else ("sum" if sum_over_rows else "mean")
        self.rtol = RTOL_FLOAT16 if computes_in_float16(network) else RTOL
        noise = batch_norm_cells(network) + random_cells(network)
        self.noisy = bool(noise)
        self.noise = f" The network has batch statistics or random cells ({', '.join(noise)}): their noise " \
                     f"is tolerated, so only a ratio outside [1/{NOISY_BAND}, {NOISY_BAND}] stops." if noise else ""
        self._checked = Unsaved(Parameter(Tensor(False), name="accu_state.loss_contract_checked",
                                           requires_grad=False))

    @compile_time
    def checked(self) -> Parameter:
        return self._checked.parameter

    @compile_time
    def scaled_loss(self) -> nn.Cell:
        return self._scaled_loss

    def _mismatch(self, measured, predicted):
        error = ops.abs(measured - predicted)
        if self.noisy:
            ratio = measured / ops.select(predicted == 0, ops.ones_like(predicted), predicted)
            return ops.logical_or(ratio > NOISY_BAND, ratio < 1 / NOISY_BAND)
        return error > self.rtol * ops.abs(predicted) + ATOL

    def construct(self, split, others, pair_value, pair_count, unit, after):
        """Checks the contract on the first call (`after` is returned, made to depend on it)."""
        if self.enabled:
            rows = pair_rows(split[0].shape[0], self.micro_size)
            if rows > 0:
                checked = self.checked
                if not checked:
                    shared, constants, layout = others
                    pair = ()
                    for x in split:
                        pair += (x[:rows],)
                    out = self.scaled_loss(assemble(pair, shared, constants, layout), Tensor(1.0, mstype.float32))
                    if self.per_token_loss:
                        measured, predicted = out[1] / out[2], pair_value / pair_count
                        bad = ops.logical_or(self._mismatch(out[1], pair_value), self._mismatch(out[2], pair_count))
                    elif self.sum_over_rows:
                        measured, predicted = out[1], pair_value * unit
                        bad = self._mismatch(measured, predicted)
                    else:
                        measured, predicted = out[1], pair_value / pair_count
                        bad = self._mismatch(measured, predicted)
                    if bad:
                        ratio = measured / predicted
                        raise ValueError(
                            f"For '{self.owner_name}', the network's loss does not combine over micro-batches as the "
                            f"cell computes it, so training would not give the full batch's update: on the first "
                            f"step, its loss on the first two micro-batches together ({rows} rows) is {measured}, but "
                            f"combined from their own losses it is {predicted} (ratio {ratio}; about 2 means the loss "
                            f"scales with the rows, other values a normalisation over the batch).{self.noise} "
                            f"{routes(self.kind)}")
                    after = ops.depend(after, ops.assign(checked, Tensor(True)))
        return after
