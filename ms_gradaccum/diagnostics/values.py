"""Every row's values compared, eagerly: the loss contract where the graph leaves it undecided (docs/design.md, "The
loss contract"), and the advice to give one input whole to every micro-batch.

Each micro-batch's loss, and each micro-batch with the next together, are combined as the kind combines them and
compared to a relative tolerance (:func:`compare_rows`). Only where the network draws no random values: a network that
draws is accepted as declared (the graph's reading stops an undeclared one). Functions of a
:class:`~ms_gradaccum.diagnostics.contract.LossContract` (`check`), whose engine copy they run.
"""

import numpy as np
from mindspore import Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.graph import eager_mode
from ms_gradaccum._mindspore.randomness import HeldDraws
from ms_gradaccum._mindspore.surroundings import parallel_pass_outside, stand_alone
from ms_gradaccum.core.microbatch import SPLIT
from ms_gradaccum.core.validation import batch_norm_cells
from ms_gradaccum.diagnostics.eager import BatchRows, own_gradients_off, run_eagerly, training_off
from ms_gradaccum.diagnostics.graph_messages import LossContractError, values_message

# Relative tolerance of the value comparisons: float32 reductions in another order; float16 networks round far more.
RTOL, RTOL_FLOAT16 = 1e-3, 2e-2
ONE = Tensor(1.0, mstype.float32)   # the passes' scale and count unit (the unit cancels in every comparison)


def close(measured: float, predicted: float, rtol: float, half: bool = False) -> bool:
    """Equal within `rtol` of the larger (and, for a network computing in float16, `rtol` or a few of float16's steps at
    that size: a loss below float16's normal range keeps few digits); a NaN on either side is not."""
    size = max(abs(measured), abs(predicted))
    step = 4 * float(np.spacing(np.float16(size))) if half and np.isfinite(size) else 0.0
    return abs(measured - predicted) <= rtol * size + step


def _first_only(function):
    """`function`, called on the first call only."""
    calls = []

    def first():
        if not calls:
            calls.append(1)
            function()
    return first


def compare_rows(check, batch: BatchRows, public: bool = False) -> tuple:
    """``(random, measured, predicted, rows, not_finite)`` of every row's values on `batch`: `random` where the
    network draws random values (nothing compared then), else :func:`_every_row`'s. Raises
    :class:`LossContractError` where the loss does not combine. `public`: messages name ``check_loss_contract``'s
    arguments."""
    sizes = batch.micro_rows
    network = check.engine_network
    with training_off(batch_norm_cells(network, cells=True)), own_gradients_off(network), \
            HeldDraws(network) as held:
        # Twice on micro-batch 0, its draws held for the first pass only: a network that draws random values
        # (dropout, noise) differs, and its values are not compared.
        first = _values(check, batch, [[(0, sizes[0])]] * 2, before_each=_first_only(held.repeat))
        if not all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(first[0], first[1])):
            return (True, float("nan"), float("nan"), 0, None)
        return (False,) + _every_row(check, batch, check.kind, public, held.repeat)


def _values(check, batch: BatchRows, parts: list, kind=None, before_each=None) -> list:
    """``[(value, count), ...]``: the kind's tally (`kind`, else the check's) of the network's loss on each part
    (``[(start, stop), ...]`` of the batch's rows), random draws held the same before each pass by `before_each`."""
    calls = [(batch.spans(spans), ONE, sum(stop - start for start, stop in spans), ONE) for spans in parts]
    scaled_loss = check.scaled_loss_cell
    kept = scaled_loss.kind
    scaled_loss.kind = kind if kind is not None else check.kind
    try:
        outputs = run_eagerly(scaled_loss, calls, before_each=before_each)
    finally:
        scaled_loss.kind = kept
    return [(out[1], out[2]) for out in outputs]


def combination(check, kind, parts: list, pair: tuple, rows: int) -> tuple:
    """``(measured, predicted, holds)``: the pair's loss as `kind` reads it, the same combined from the `parts`' own
    tallies, and whether they agree (every value `kind` compares); NaN where a part is not finite."""
    with eager_mode():
        measured = kind.compared(pair[0], pair[1], rows, ONE)
        predicted = kind.compared(sum(part[0] for part in parts), sum(part[1] for part in parts), rows, ONE)
    measured = [float(x.asnumpy().reshape(())) for x in measured]
    predicted = [float(x.asnumpy().reshape(())) for x in predicted]
    holds = all(close(m, p, check.rtol, check.half) for m, p in zip(measured, predicted))
    return measured[0], predicted[0], holds


def _every_row(check, batch: BatchRows, kind, public: bool, before_each) -> tuple:
    """``(measured, predicted, rows, not_finite)``: each micro-batch's loss and each micro-batch with the next
    together, compared as `kind` combines them; raises at the first pair that does not combine. The pair closest to
    failing is returned; nothing is compared where a micro-batch's loss is not finite (`not_finite`: the first such;
    the engine stops that step, naming it)."""
    sizes = batch.micro_rows
    starts = np.cumsum([0] + sizes[:-1]).tolist()
    spans = [(start, start + rows) for start, rows in zip(starts, sizes)]
    singles = [[span] for span in spans]
    pairs = [[(spans[i][0], spans[i + 1][1])] for i in range(len(spans) - 1)]
    outputs = _values(check, batch, singles + pairs, kind, before_each)
    own, together = outputs[:len(singles)], outputs[len(singles):]
    finite = [all(np.isfinite(x.asnumpy()).all() for x in out) for out in own]
    if not all(finite):
        return float("nan"), float("nan"), 0, finite.index(False)
    worst = (float("nan"), float("nan"), -1.0)
    for i, both in enumerate(together):
        rows = sizes[i] + sizes[i + 1]
        measured, predicted, holds = combination(check, kind, own[i:i + 2], both, rows)
        if not holds:
            raise LossContractError(values_message(check, i, spans[i][0], spans[i + 1][1], measured, predicted,
                                                   sizes, kind, public))
        gap = abs(measured - predicted) / max(abs(measured), abs(predicted), 1e-30)
        if gap > worst[2]:
            worst = (measured, predicted, gap)
    return worst[0], worst[1], batch.batch, None


def shared_input_hint(check, engine, inputs: tuple) -> str:
    """Where giving one split input whole to every micro-batch makes the loss combine: the advice to declare it (an
    input shared by the whole batch whose axis 0 only equals the batch size; under semi-auto/auto parallel, which
    cannot share it, the other routes); diagnostics.failures asks it too. Tried, not guessed: per-row labels of a loss
    whose normalisation is the problem give no such advice. Run stand-alone, as the comparison is."""
    with stand_alone():
        return _shared_input_hint(check, engine, inputs)


def _shared_input_hint(check, engine, inputs: tuple) -> str:
    try:
        batch = BatchRows(engine, inputs)
    except Exception:  # pylint: disable=broad-except
        return ""
    sizes = batch.micro_rows
    if len(sizes) < 2 or not check.reachable(inputs):
        return ""
    rows = sizes[0] + sizes[1]
    for position, (role, index) in enumerate(batch.layout):
        if role != SPLIT or index == 0:
            continue
        try:
            calls = [(batch.rows(start, stop, index), ONE, stop - start, ONE)
                     for start, stop in ((0, sizes[0]), (sizes[0], rows), (0, rows))]
            one, two, both = [(out[1], out[2]) for out in run_eagerly(check.scaled_loss_cell, calls)]
            if not combination(check, check.kind, [one, two], both, rows)[2]:
                continue
        except Exception:  # pylint: disable=broad-except
            continue
        name = f" ('{engine.input_names[position]}')" if position < len(engine.input_names) else ""
        found = (f" Given whole to every micro-batch, input {position}{name} makes the loss combine: if it is "
                 f"not one row per sample but shared by the whole batch (class weights, ids or a mask of fixed "
                 f"size) whose axis 0 only equals the batch size, ")
        if parallel_pass_outside():
            return found + ("no micro-batch can get it whole under semi-auto/auto parallel, where MindSpore's "
                            "parallel pass slices every input along axis 0: give it one row per sample, or train "
                            "data parallel.")
        return found + f"declare it (e.g. shared_inputs=({position},)): every micro-batch then gets it whole."
    return ""
