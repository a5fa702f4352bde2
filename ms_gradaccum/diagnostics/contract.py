"""The loss contract, decided from the loss's structure on the first call (docs/design.md, "The loss contract").

The cells are exact when the loss is what they take it for: a mean over independent rows (the default), a sum
(``reduction='sum'``), ``(loss_sum, count)`` (``per_token_loss=True``), or a mean over valid labels that they count.
Losses that zoos and users write break that without a sign (a masked mean over micro-batches whose masks differ is a
mean of means), and sampling the data cannot settle it: the first batches may be regular and a later one not. So on the
first call (and again, in PyNative mode, when the inputs' layout changes) :meth:`ContractCheck.probe` runs the network
eagerly on rows of that batch with inputs it chooses, and what it finds holds whatever values later batches hold.

1. **The gradient probe** (:meth:`ContractCheck._gradient_probe`). What a micro-batch adds is its loss times the kind's
   weight (its rows, or its count of valid labels); that sum over rows is the contract. So the gradient of the weighted
   loss with respect to some rows' float inputs (B) must not move when other rows (A) change: each float input of A
   moved, half the entries of each input of A set to 0, and of each integer input to the ignored label (-100). Random
   draws are held the same in every pass (``_mindspore.randomness``) and batch normalisation is in eval mode, so rows
   that are independent move by exactly 0. What moved B's gradient names the cause: a float input moving its own
   rows' gradient, rows coupled across the batch (InfoNCE, statistics over the batch: no split reproduces the full
   batch); otherwise the input the loss is normalised through (a mask, sample weights, a count of thresholded targets:
   the ``(loss_sum, count)`` route). Where only the ignored label moved it and a mean over the labels that are not -100
   holds, the loss is counted that way from then on (``core.kinds.IgnoredLabelMean``: exact by construction, every
   step).
2. **Integer inputs only** (:meth:`ContractCheck._integer_probe`; a language model's ids and labels, where no gradient
   reaches a float input): the gradient of the tallied value with respect to the network's last two weights must add
   up over B and A, unchanged, with A's integer labels set to -100 and with A's inputs set to 0 (losses alike at
   initialisation do not hide a count: their gradients differ). The same causes, the same counting of -100 labels.
3. **Every row's values** (:meth:`ContractCheck._every_row`; networks that draw no random values). Each micro-batch's
   loss, and each micro-batch with the next together, compared as the kind combines them, to a relative tolerance: a
   sum taken for a mean stops here.

Random draws (dropout, noise) are never a reason to stop or to loosen. Where the batch cannot be reached from Python (a
train cell of one's own, a ``jit`` function, sink mode) or the network runs only in graph mode, the graph compares the
first two micro-batches' values on its first run instead (:meth:`ContractCheck.construct`).
"""
import dataclasses
from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.graph import compile_time, eager_mode, gradients_recorded, primexpr
from ms_gradaccum._mindspore.patches import with_context
from ms_gradaccum._mindspore.randomness import HeldDraws
from ms_gradaccum._mindspore.surroundings import parallel_mode
from ms_gradaccum.core.base import PrecisionNeutral, Unsaved
from ms_gradaccum.core.kinds import IGNORE_INDEX, IgnoredLabelMean, RowMean
from ms_gradaccum.core.microbatch import SPLIT, assemble, micro_batch_rows
from ms_gradaccum.core.validation import batch_norm_cells, computes_in_float16, readable
from ms_gradaccum.diagnostics import graph_contract
from ms_gradaccum.diagnostics.eager import BatchRows, own_gradients_off, run_eagerly, runs_on, training_off
from ms_gradaccum.diagnostics.graph_messages import LossContractError, decided

# Relative tolerance of the value comparisons: float32 reductions in another order; float16 networks round far more.
RTOL, RTOL_FLOAT16 = 1e-3, 2e-2
# The coupling probe: a float input changed by this much of its size; rows whose gradient then moves by more than
# COUPLING of the largest gradient element are coupled to the changed ones (independent rows move by exactly 0.0).
STEP, COUPLING = 0.1, 1e-4
ONE = Tensor(1.0, mstype.float32)   # the passes' scale and count unit (the unit cancels in every comparison)


@dataclasses.dataclass(frozen=True)
class Findings:
    """What the first call's probe found (``check_loss_contract`` reports it).

    Attributes:
        kind (LossKind): The kind the cell trains with (an ``IgnoredLabelMean`` where the probe found one).
        separable (Optional[bool]): Whether the rows are independent through the float inputs; None where no float
            input could be probed (integer inputs only, or no gradient reaches them).
        probed_inputs (tuple): The network's float inputs changed by the coupling probe, by position.
        ignore_labels (Optional[int]): The input whose -100 labels the loss leaves out (then counted), if any.
        random (bool): The network draws random values: only the coupling probe ran (draws held the same).
        rows_compared (int): The rows whose values were compared (every row of the batch, or 0).
        batch_rows (int): The rows of the batch probed.
        measured (float): The loss on the pair of micro-batches whose comparison was closest to failing.
        predicted (float): The same, combined from the two micro-batches' own losses.
        not_finite (Optional[int]): The first micro-batch whose loss is not finite (nothing compared then).
    """
    kind: object
    separable: Optional[bool]
    probed_inputs: tuple
    ignore_labels: Optional[int]
    random: bool
    rows_compared: int
    batch_rows: int
    measured: float = float("nan")
    predicted: float = float("nan")
    not_finite: Optional[int] = None
    read_from_graph: bool = False
    graph: object = None


def loss_name(network: nn.Cell) -> str:
    """The network's class, and its loss cell's (the last ``nn.LossBase`` in it), for messages."""
    losses = [type(cell).__name__ for name, cell in network.cells_and_names() if isinstance(cell, nn.LossBase) and name]
    return type(network).__name__ + (f" ({losses[-1]})" if losses else "")


def _close(measured: float, predicted: float, rtol: float, half: bool = False) -> bool:
    """Equal within `rtol` of the larger (and, for a network computing in float16, `rtol` or a few of float16's steps at
    that size: a loss below float16's normal range keeps few digits); a NaN on either side is not."""
    size = max(abs(measured), abs(predicted))
    step = 4 * float(np.spacing(np.float16(size))) if half and np.isfinite(size) else 0.0
    return abs(measured - predicted) <= rtol * size + step


def _number(value: float) -> str:
    return f"{value:.4g}"


@primexpr
def pair_rows(batch: int, micro_size: int) -> int:
    """The rows of the first two micro-batches (0 when a batch holds fewer than two)."""
    sizes = micro_batch_rows(batch, micro_size)[:2]
    return sizes[0] + sizes[1] if len(sizes) == 2 else 0


class TalliedValue(nn.Cell):
    """What a pass adds to its batch's sum as the kind tallies it (the loss times the kind's weight for its rows), the
    weight differentiable where it depends on an input (a kind weighing by an input)."""

    def __init__(self, scaled_loss: nn.Cell, rows: int):
        super().__init__(auto_prefix=False)
        # A child (no prefix: no name changes), so that the eager pass puts back what the network's cells set
        # (diagnostics.eager.run_eagerly reads the cells of the cell it runs).
        self.scaled_loss = scaled_loss
        object.__setattr__(self, "_rows", rows)

    def construct(self, *args):
        loss, count, _ = self.scaled_loss.loss_and_count(args, self._rows)
        return self.scaled_loss.kind.tally(loss, count, self._rows, ONE, args)[1]


class WeightedGradients(nn.Cell):
    """The gradient of a pass's :class:`TalliedValue` with respect to the network's inputs at `positions`, eagerly."""

    def __init__(self, scaled_loss: nn.Cell, positions: tuple, rows: int):
        super().__init__(auto_prefix=False)
        self.tallied = TalliedValue(scaled_loss, rows)
        object.__setattr__(self, "_positions", tuple(positions))

    def construct(self, *args):
        # Made here, in PyNative mode with recording on: ms.grad reads the mode when it is made, and made in graph mode
        # it compiles a graph on every call. Of a Cell, not a function: inside a gradient the user's function records
        # (ms.value_and_grad of a Python function), a nested gradient of a function loses the outer one's top cell.
        with gradients_recorded():
            gradients = ms.grad(self.tallied, grad_position=self._positions)(*args)
        return gradients if isinstance(gradients, tuple) else (gradients,)


class WeightGradients(WeightedGradients):
    """The gradient of a pass's tallied value (:class:`WeightedGradients`) with respect to `weights`, eagerly."""

    def __init__(self, scaled_loss: nn.Cell, weights: list, rows: int):
        super().__init__(scaled_loss, (), rows)
        object.__setattr__(self, "_weights", list(weights))   # not a Cell attribute: nothing of theirs is renamed

    def construct(self, *args):
        with gradients_recorded():
            gradients = ms.grad(self.tallied, grad_position=None, weights=self._weights)(*args)
        return tuple(gradients)


def _movement(moved: np.ndarray, before: np.ndarray, size: float) -> tuple:
    """``(movement, scaled)``: how far a gradient moved, in `size` (its largest element before), and whether it moved
    as a whole by one factor (a normaliser changed), to the probe's precision."""
    if not before.size:
        return 0.0, False
    movement = float(np.abs(moved - before).max()) / size
    norm = float((before * before).sum())
    factor = float((moved * before).sum()) / norm if norm else 0.0
    return movement, bool(norm) and float(np.abs(moved - factor * before).max()) / size <= COUPLING


def _first_only(function):
    """`function`, called on the first call only."""
    calls = []

    def first():
        if not calls:
            calls.append(1)
            function()
    return first


def _is_float(x) -> bool:
    return isinstance(x, Tensor) and x.dtype in (mstype.float16, mstype.float32, mstype.float64)


def _is_integer(x) -> bool:
    return isinstance(x, Tensor) and x.dtype in (mstype.int8, mstype.int16, mstype.int32, mstype.int64, mstype.uint8)


def _set_half(array: np.ndarray, rows: int, value) -> np.ndarray:
    """`array` with every other entry of its first `rows` rows set to `value` (at least one entry kept)."""
    array = array.copy()
    head = array[:rows].reshape(-1)
    if head.size < 2:
        return None
    head[::2] = value
    array[:rows] = head.reshape(array[:rows].shape)
    return array


class ContractCheck(PrecisionNeutral):
    """The probe (see the module docstring): :meth:`first_call` runs it eagerly before the first step's graph runs;
    where it cannot run so, ``construct`` compares the first two micro-batches' values inside the graph, on its first
    run."""

    def __init__(self, scaled_loss: nn.Cell, network: nn.Cell, micro_size: int, kind, enabled: bool, cls_name: str,
                 declared: bool = False):
        super().__init__(auto_prefix=False)
        object.__setattr__(self, "_scaled_loss", scaled_loss)   # the engine's own cell: not a second child
        object.__setattr__(self, "scaled_loss_cell", scaled_loss)   # (read by the graph, not registered)
        self.micro_size = micro_size
        self.kind = kind
        self.enabled = enabled
        self.declared = declared
        self.owner_name = cls_name
        object.__setattr__(self, "_user_network", network)   # the user's network (not a child): its precision now
        self.loss_name = loss_name(network)   # the user's network, for messages (not the engine's counting copy)
        # Whether the graph's own comparison has run (0: not yet).
        self._graph_runs = Unsaved(Parameter(Tensor(0, mstype.int32), name="accu_state.loss_contract_step",
                                             requires_grad=False))
        object.__setattr__(self, "graph_runs", self._graph_runs.parameter)   # read by the graph, not registered
        # Python state. `probed`: the probe ran (graphs compiled later leave the in-graph comparison out), on inputs of
        # `layout` (dtypes and ranks). `failed`: the probe cannot run eagerly (the graph compares instead).
        self.probed = False
        self.layout = None
        self.failed = False
        self.findings = None
        self._held = None   # the probe's HeldDraws while it runs
        self._refusable = True   # whether the probe may try labels the network refuses (first_call)

    @classmethod
    def of(cls, engine: nn.Cell, network: nn.Cell, spec, cls_name: str) -> "ContractCheck":
        """The check of a package cell's `engine` (on `network`, the user's loss network) as its `spec` says."""
        return cls(engine.scaled_loss, network, spec.micro_size, spec.kind, spec.check_loss and spec.micro_size > 1,
                   cls_name, spec.declared)

    @compile_time
    def half(self) -> bool:
        """Whether the network computes in float16, as it is now (``Model``'s ``amp_level`` sets it after the cell is
        built)."""
        return computes_in_float16(self._user_network)

    @compile_time
    def rtol(self) -> float:
        """The value comparisons' relative tolerance: float32 reductions in another order; float16 rounds far more."""
        return RTOL_FLOAT16 if self.half else RTOL

    @property
    def _network(self) -> nn.Cell:
        """The network the engine runs (a recognised loss's counting copy, where it counts)."""
        return self._scaled_loss.loss_of_inputs.network

    @compile_time
    def in_graph(self) -> bool:
        """Whether the graph being compiled compares values itself: the check is on and the probe has not run (where it
        can, it has run by the time a graph compiles, or stopped)."""
        return self.enabled and not self.probed

    # --- the first call ---------------------------------------------------------------------------------------------

    def first_call(self, engine: nn.Cell, inputs: tuple, refusable: bool = True):
        """Before the first step's graph compiles or runs on `inputs` (the owner's; the batch): the probe, where the
        check is on, unless it ran on inputs of the same layout. Returns the kind the probe found (an
        ``IgnoredLabelMean``) where it differs from the cell's, else None; raises :class:`LossContractError` where the
        loss does not combine. `refusable`: the probe may try labels the network refuses (not inside a gradient of a
        Python function in PyNative mode, whose record an error would lose: ``_mindspore.graph.in_function_gradient``;
        there the -100 labels are not tried)."""
        if not self.enabled or self.failed:
            return None
        layout = tuple((x.dtype, x.ndim) if isinstance(x, Tensor) else type(x) for x in inputs)
        if self.probed and layout == self.layout:
            return None
        self._refusable = refusable
        try:
            findings = self.read_graph(engine, inputs)
            if findings is None:
                findings = self.probe(engine, inputs)
        except LossContractError as error:
            error.args = (error.args[0] + self.shared_input_hint(engine, inputs),) + error.args[1:]
            raise
        except Exception as error:  # pylint: disable=broad-except
            self._on_error(error, engine, inputs)
            return None
        finally:
            self._refusable = True
        if findings is None:
            return None
        self.probed, self.layout, self.findings = True, layout, findings
        return findings.kind if findings.kind != self.kind else None

    def reachable(self, inputs: tuple) -> bool:
        """Whether the probe can run on `inputs`: stand-alone or data parallel, Tensors with data and static shapes."""
        if parallel_mode() not in (ms.ParallelMode.STAND_ALONE, ms.ParallelMode.DATA_PARALLEL):
            return False
        return bool(inputs) and not any(isinstance(x, Tensor) and (x.has_init or any(d < 0 for d in x.shape))
                                        for x in inputs)

    def read_graph(self, engine: nn.Cell, inputs: tuple, public: bool = False) -> Optional[Findings]:
        """The contract read from the loss network's graph (diagnostics.graph_contract), compiled for micro-batch 0's
        inputs: raises :class:`LossContractError` where it shows the loss does not combine, else returns what it
        found; None where the graph leaves it undecided and the network draws nothing random (the probe's value
        comparison decides then)."""
        if not self.reachable(inputs):
            return None
        batch = BatchRows(engine, inputs)
        sizes = batch.micro_rows
        if len(sizes) < 2:
            return None
        try:
            other = sizes[0] - 1 if sizes[0] > 1 else min(2, batch.batch)
            reading = graph_contract.read(self._user_network, lambda rows: batch.rows(0, rows),
                                          tuple(batch.positions), sizes[0], other)
        except Exception:  # pylint: disable=broad-except
            return None   # the network's own error: the eager passes report it with the split's context
        kind = decided(self, reading, public)
        if kind is None:
            return None
        ignore = reading.count_input if isinstance(kind, IgnoredLabelMean) else None
        return Findings(kind, True, (), ignore, bool(reading.random), 0, batch.batch, read_from_graph=True,
                        graph=reading)

    def probe(self, engine: nn.Cell, inputs: tuple, public: bool = False) -> Optional[Findings]:
        """The probe on `inputs` (see the module docstring): raises :class:`LossContractError` where the loss does not
        combine, else returns what it found; None where it cannot run (the graph compares then). `public`: messages
        name ``check_loss_contract``'s arguments."""
        if not self.reachable(inputs):
            return None
        batch = BatchRows(engine, inputs)
        sizes = batch.micro_rows
        if len(sizes) < 2:
            return None
        network = self._network
        starts = np.cumsum([0] + sizes[:-1]).tolist()
        compared = (float("nan"), float("nan"), 0, None)
        with training_off(batch_norm_cells(network, cells=True)), own_gradients_off(network), \
                HeldDraws(network) as held:
            self._held = held
            try:
                # Twice on micro-batch 0, its draws held for the first pass only: a network that draws random values
                # (dropout, noise) differs, and gets the gradient probe alone, its draws held the same in every pass.
                first = self._values(batch, [[(0, sizes[0])]] * 2, before_each=_first_only(held.repeat))
                random = not all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(first[0], first[1]))
                separable, probed, kind, ignore = self._gradient_probe(batch, sizes, held, public)
                if not random:
                    if separable is None:   # no gradient reaches a float input: the weights' gradients add up
                        kind, ignore = self._integer_probe(batch, sizes, public)
                    compared = self._every_row(batch, sizes, starts, kind, public)
            finally:
                self._held = None
        return Findings(kind, separable, probed, ignore, random, compared[2], batch.batch, compared[0], compared[1],
                        compared[3])

    def _values(self, batch: BatchRows, parts: list, kind=None, before_each=None) -> list:
        """``[(value, count), ...]``: the kind's tally (`kind`, else the cell's) of the network's loss on each part
        (``[(start, stop), ...]`` of the batch's rows). Random draws are held the same before each pass (`before_each`
        instead, if given)."""
        calls = [(batch.spans(spans), ONE, sum(stop - start for start, stop in spans), ONE) for spans in parts]
        kept = self._scaled_loss.kind
        self._scaled_loss.kind = kind if kind is not None else self.kind
        if before_each is None and self._held is not None:
            before_each = self._held.repeat
        try:
            outputs = run_eagerly(self._scaled_loss, calls, before_each=before_each)
        finally:
            self._scaled_loss.kind = kept
        return [(out[1], out[2]) for out in outputs]

    def _combination(self, kind, parts: list, pair: tuple, rows: int) -> tuple:
        """``(measured, predicted, holds)``: the pair's loss as `kind` reads it, the same combined from the `parts`'
        own tallies, and whether they agree (every value `kind` compares); NaN where a part is not finite."""
        with eager_mode():
            measured = kind.compared(pair[0], pair[1], rows, ONE)
            predicted = kind.compared(sum(part[0] for part in parts), sum(part[1] for part in parts), rows, ONE)
        measured = [float(x.asnumpy().reshape(())) for x in measured]
        predicted = [float(x.asnumpy().reshape(())) for x in predicted]
        holds = all(_close(m, p, self.rtol, self.half) for m, p in zip(measured, predicted))
        return measured[0], predicted[0], holds

    # --- 1. coupling through float inputs -----------------------------------------------------------------------------

    def _gradient_probe(self, batch: BatchRows, sizes: list, held: HeldDraws, public: bool) -> tuple:
        """``(separable, probed, kind, ignore)``, from the gradient of the weighted loss (:class:`WeightedGradients`)
        with respect to the float inputs of the first half of micro-batch 0 (B), on B and the first half of
        micro-batch 1 (A) together: unchanged, and with one input of A changed at a time (a float input moved by
        :data:`STEP` of its size; half the entries of any input set to 0, and of an integer input to the ignored
        label). The kind's contract, a weighted loss that adds up over rows, is that B's gradient does not move; raises
        where it does (the cause named by what moved it). Where the ignored label moves it but a mean over the labels
        that are not -100 holds, that is the `kind` from now on (``IgnoredLabelMean``, input `ignore`). ``(None, (),
        kind, None)`` where no gradient reaches a float input."""
        floats = [index for index, x in enumerate(batch.split) if _is_float(x)]
        if not floats:
            return None, (), self.kind, None
        rows_b, rows_a = max(1, sizes[0] // 2), max(1, sizes[1] // 2)
        base = batch.arrays([(0, rows_b), (sizes[0], sizes[0] + rows_a)])
        positions = tuple(batch.positions[index] for index in floats)
        generator = np.random.RandomState(0)
        sentinel = self._sentinel()
        changes = []   # (split index, what): what = "moved", 0 (set to 0 or False) or the sentinel
        for index, x in enumerate(batch.split):
            if index in floats:
                changes.append((index, "moved"))
            if isinstance(x, Tensor) and x[:1].size > 0:
                changes.append((index, 0))
            if _is_integer(x) and self._refusable:
                changes.append((index, sentinel))

        def changed(index, what):
            arrays = list(base)
            part = arrays[index][rows_b:]
            if what == "moved":
                part = part.astype(np.float64)
                scale = float(np.abs(part).mean()) or 1.0
                part = part + STEP * generator.standard_normal(part.shape) * (np.abs(part) + scale)
            else:
                flat = part.reshape(-1).copy()
                flat[::2] = False if part.dtype == np.bool_ else what
                part = flat.reshape(part.shape)
            arrays[index] = np.concatenate([arrays[index][:rows_b], part.astype(base[index].dtype)])
            return batch.inputs_of(arrays)

        def gradients(kind, inputs):
            """B's gradient on `inputs` with the cell's loss taken as `kind`; None where the network refuses them."""
            if not self._runs(inputs, rows_a + rows_b):
                return None
            kept = self._scaled_loss.kind
            self._scaled_loss.kind = kind
            try:
                out = run_eagerly(WeightedGradients(self._scaled_loss, positions, rows_a + rows_b), [inputs],
                                  before_each=held.repeat)[0]
            except Exception:  # pylint: disable=broad-except
                return None
            finally:
                self._scaled_loss.kind = kept
            return [g.asnumpy()[:rows_b].astype(np.float64) for g in out]

        def moves(kind, calls):
            """How far B's gradient moves with each change of `calls[1:]` against `calls[0]` (:func:`_movement`, one
            per float input), None for a change the network refuses; None for all where the unchanged pass gives no
            finite gradient."""
            reference = gradients(kind, calls[0])
            size = max((float(np.abs(g).max()) for g in reference if g.size), default=0.0) if reference else 0.0
            if not np.isfinite(size) or size == 0:
                return None
            found = []
            for inputs in calls[1:]:
                out = gradients(kind, inputs)
                found.append(None if out is None else [_movement(g, r, size) for g, r in zip(out, reference)])
            return found

        calls = [batch.inputs_of(base)] + [changed(index, what) for index, what in changes]
        moved = moves(self.kind, calls)
        if moved is None or not held.complete:
            return None, (), self.kind, None
        # coupled[(changed input, differentiated input)]: how far B's gradient moved, where it moved (non-finite too).
        coupled, kind, ignore = {}, self.kind, None
        for (index, what), out in zip(changes, moved):
            for target, (move, scaled) in zip(floats, out or ()):   # a change the network refuses tells nothing
                if not move <= COUPLING:
                    coupled.setdefault((index, what), {})[target] = (move, scaled)
        labels = [index for (index, what) in coupled if what == sentinel and what != 0]
        if labels and isinstance(kind, RowMean):
            index = labels[0]
            candidate = IgnoredLabelMean(batch.positions[index])
            counted = moves(candidate, [calls[0], changed(index, sentinel), changed(index, 0)])
            if counted is not None and all(out is not None and all(move <= COUPLING for move, _ in out)
                                           for out in counted):
                if self.declared:
                    raise LossContractError(self._declared_message(candidate, public))
                kind, ignore = candidate, batch.positions[index]
                coupled.pop((index, sentinel))
                coupled.pop((index, 0), None)
        if coupled:
            raise LossContractError(self._gradient_message(batch, coupled, floats, sentinel, rows_b, rows_a, kind,
                                                           public))
        return True, positions, kind, ignore

    def _runs(self, inputs: tuple, rows: int) -> bool:
        """Whether the network runs on `inputs` (`rows` of them), forward only: a pass that raises inside a gradient
        would leave PyNative's record of a gradient the caller takes around the cell without its top (a functional
        ``ms.value_and_grad`` loop), so a changed input the network refuses is found before any gradient is taken."""
        try:
            run_eagerly(TalliedValue(self._scaled_loss, rows), [inputs])
        except Exception:  # pylint: disable=broad-except
            return False
        return True

    def _additive(self, batch: BatchRows, sizes: list, index: Optional[int], value, kind) -> Optional[tuple]:
        """``(holds, gap)``: whether the gradient of the tallied value (`kind`'s) with respect to the network's last
        two trainable weights on B and A together (the first halves of micro-batches 0 and 1) is the sum of theirs on
        each, with half the entries of A's split input `index` set to `value` (None: unchanged); `gap` is the largest
        difference over the largest element. None where that tells nothing (the network refuses the value, a
        gradient is not finite or all zero)."""
        weights = self._network.trainable_params()[-2:]
        rows_b, rows_a = max(1, sizes[0] // 2), max(1, sizes[1] // 2)
        part_b = batch.arrays([(0, rows_b)])
        part_a = batch.arrays([(sizes[0], sizes[0] + rows_a)])
        if index is not None:
            changed = _set_half(part_a[index], rows_a, value)
            if changed is None:
                return None
            part_a = part_a[:index] + [changed] + part_a[index + 1:]
        together = [np.concatenate([b, a]) for b, a in zip(part_b, part_a)]
        if index is not None and not self._runs(batch.inputs_of(together), rows_a + rows_b):
            return None   # the network refuses that value there: it says nothing about the loss
        kept = self._scaled_loss.kind
        self._scaled_loss.kind = kind
        try:
            gradients = []
            for arrays, rows in ((part_b, rows_b), (part_a, rows_a), (together, rows_a + rows_b)):
                out = run_eagerly(WeightGradients(self._scaled_loss, weights, rows), [batch.inputs_of(arrays)],
                                  before_each=self._held.repeat if self._held is not None else None)[0]
                gradients.append([g.asnumpy().astype(np.float64) for g in out])
        except Exception:  # pylint: disable=broad-except
            return None   # the network refuses that value there: it says nothing about the loss
        finally:
            self._scaled_loss.kind = kept
        (one, other, both) = gradients
        size = max(float(np.abs(g).max()) for g in both + one + other)
        if not np.isfinite(size) or size == 0:
            return None
        gap = max(float(np.abs(w - (u + v)).max()) for w, u, v in zip(both, one, other)) / size
        return gap <= self.rtol, gap

    def _sentinel(self) -> int:
        """The label a mean over valid labels leaves out: the recognised cells' own ``ignore_index`` where the cell
        counts them, else -100."""
        kind = self.kind
        found = {getattr(cell, "ignore_index", IGNORE_INDEX) for name, cell in self._network.cells_and_names()
                 if kind.counts_in_network and (name or "network") in getattr(kind, "cells", ())}
        return found.pop() if len(found) == 1 and isinstance(next(iter(found)), int) else IGNORE_INDEX

    def _integer_probe(self, batch: BatchRows, sizes: list, public: bool) -> tuple:
        """``(kind, ignore)`` where no gradient reaches a float input (integer inputs only, as a language model's): the
        weights' gradient must add up over B and A (:meth:`_additive`), unchanged, with A's integer inputs set to the
        ignored label (:meth:`_sentinel`; where a row mean breaks and a mean over the labels that are not -100 holds,
        that is the kind from now on, unless another was declared) and with A's inputs set to 0. Raises where it does
        not; losses alike at initialisation do not hide it, their gradients differ."""
        kind, ignore, broken = self.kind, None, []
        if kind.counts_in_network or self._additive(batch, sizes, None, None, kind) is None:
            return kind, ignore   # a recognised loss is counted: exact by construction
        sentinel = self._sentinel()
        for index, x in enumerate(batch.split):
            if not _is_integer(x) or not self._refusable:
                continue
            found = self._additive(batch, sizes, index, sentinel, kind)
            if found is None or found[0]:
                continue
            position = batch.positions[index]
            if isinstance(kind, RowMean) and ignore is None:
                candidate = IgnoredLabelMean(position)
                counted = [self._additive(batch, sizes, index, value, candidate) for value in (sentinel, 0)]
                if all(item is not None and item[0] for item in counted):
                    if self.declared:
                        raise LossContractError(self._declared_message(candidate, public))
                    kind, ignore = candidate, position
                    continue
            broken.append((position, found[1]))
        # Unchanged, under the kind found: what the batch holds already (ignored labels, uneven counts) shows here.
        unchanged = self._additive(batch, sizes, None, None, kind)
        if unchanged is not None and not unchanged[0]:
            token, total = self._routes(public)
            raise LossContractError(
                f"For '{self.owner_name}', the loss of {self.loss_name} does not combine over micro-batches: if it is "
                f"normalised by something taken over the batch, {token}; if it is a sum, pass {total}; if its rows "
                f"meet across the batch (similarities, statistics over the batch), train with micro_size=1. Found on "
                f"the first call: the gradient of the loss (weighted as {self._taken_as(kind)}) with respect to the "
                f"last weights on {max(1, sizes[0] // 2) + max(1, sizes[1] // 2)} rows of two micro-batches together "
                f"differs from the sum of theirs by {_number(unchanged[1])} of its size.")
        for position, gap in broken:
            raise LossContractError(self._labels_message(position, gap, sentinel, max(1, sizes[0] // 2),
                                                         max(1, sizes[1] // 2), public, weights=True))
        for index, x in enumerate(batch.split):
            found = self._additive(batch, sizes, index, False if x.dtype == mstype.bool_ else 0, kind)
            if found is not None and not found[0]:
                raise LossContractError(self._coupled_message(batch.positions[index], False, 0, found[1],
                                                              max(1, sizes[0] // 2), max(1, sizes[1] // 2), kind,
                                                              public, weights=True))
        return kind, ignore

    # --- 3. every row's values ----------------------------------------------------------------------------------------

    def _every_row(self, batch: BatchRows, sizes: list, starts: list, kind, public: bool) -> tuple:
        """``(measured, predicted, rows, not_finite)``: each micro-batch's loss and each micro-batch with the next
        together, compared as `kind` combines them; raises at the first pair that does not combine. The pair closest to
        failing is returned; nothing is compared where a micro-batch's loss is not finite (`not_finite`: the first such;
        the engine stops that step, naming it)."""
        spans = [(start, start + rows) for start, rows in zip(starts, sizes)]
        singles = [[span] for span in spans]
        pairs = [[(spans[i][0], spans[i + 1][1])] for i in range(len(spans) - 1)]
        outputs = self._values(batch, singles + pairs, kind)
        own, together = outputs[:len(singles)], outputs[len(singles):]
        finite = [all(np.isfinite(x.asnumpy()).all() for x in out) for out in own]
        if not all(finite):
            return float("nan"), float("nan"), 0, finite.index(False)
        worst = (float("nan"), float("nan"), -1.0)
        for i, both in enumerate(together):
            rows = sizes[i] + sizes[i + 1]
            measured, predicted, holds = self._combination(kind, own[i:i + 2], both, rows)
            if not holds:
                raise LossContractError(self._values_message(i, spans[i][0], spans[i + 1][1], measured, predicted,
                                                             sizes, kind, public))
            gap = abs(measured - predicted) / max(abs(measured), abs(predicted), 1e-30)
            if gap > worst[2]:
                worst = (measured, predicted, gap)
        return worst[0], worst[1], batch.batch, None

    # --- messages -----------------------------------------------------------------------------------------------------

    @staticmethod
    def _routes(public: bool) -> tuple:
        """``(token route, sum route)`` in the arguments of the entry point the message is for."""
        if public:
            return ("return (loss_sum, count) from the network and pass kind=ms_gradaccum.TokenMean()",
                    "kind=ms_gradaccum.RowSum()")
        return ("return (loss_sum, count) from the network and pass per_token_loss=True (min_count=1.0 for a "
                "max(count, 1) floor)", "reduction='sum'")

    def _taken_as(self, kind) -> str:
        if self.declared:
            return f"the cell was told the loss is {kind.description}"
        return f"the cell takes the loss for {kind.description}"

    def _gradient_message(self, batch: BatchRows, coupled: dict, floats: list, sentinel: int, rows_b: int,
                          rows_a: int, kind, public: bool) -> str:
        """The message for what moved B's gradient (:meth:`_gradient_probe`; `coupled`: ``{(input, change): {target:
        (moved, scaled)}}``). Scaled as a whole by a change of another row's input (a mask, weights, the data a count
        is taken from): a normaliser taken over the batch through that input. Only by the ignored label: a mean over
        valid labels mixed with another term. Otherwise the rows meet across the batch (similarities, statistics)."""
        scaled = [(index, what) for (index, what), targets in coupled.items()
                  if any(scale for _, scale in targets.values()) and what != sentinel]
        if scaled:
            index, what = min(scaled, key=lambda change: (change[1] == "moved", change[0]))
            move = max(move for move, _ in coupled[(index, what)].values())
            return self._coupled_message(batch.positions[index], False, what, move, rows_b, rows_a, kind, public)
        if all(what == sentinel for _, what in coupled):
            index = next(iter(coupled))[0]
            move = max(move for move, _ in coupled[(index, sentinel)].values())
            return self._labels_message(batch.positions[index], move, sentinel, rows_b, rows_a, public)
        index, what = min((change for change in coupled if change[1] != sentinel),
                          key=lambda change: (change[1] != "moved", change[0]))
        move = max(move for move, _ in coupled[(index, what)].values())
        return self._coupled_message(batch.positions[index], True, what, move, rows_b, rows_a, kind, public)

    def _coupled_message(self, position: int, first: bool, what, moved: float, rows_b: int, rows_a: int, kind,
                         public: bool, weights: bool = False) -> str:
        name = self.loss_name
        how = {"moved": " moved by a tenth of its size", 0: " set to 0 in half of its entries", None: ""}[what]
        if weights:
            probe = (f"Found on the first call: with input {position}{how} on {rows_a} rows, the gradient of the loss "
                     f"(weighted as {self._taken_as(kind)}) with respect to the last weights on those rows and "
                     f"{rows_b} others together differs from the sum of theirs by {_number(moved)} of its size.")
        else:
            probe = (f"Found on the first call: with input {position}{how} on {rows_a} rows, the gradient of the loss "
                     f"(weighted as {self._taken_as(kind)}) on {rows_b} other rows moved by {_number(moved)} of its "
                     f"size; rows that are independent move by 0.")
        if first:
            later = "" if public else (" check_loss=False would train another objective (the mean of micro-batch "
                                       "losses), not this one.")
            return (f"For '{self.owner_name}', the loss of {name} couples the rows of a batch, so no split into "
                    f"micro-batches gives the full batch's update: train with micro_size=1 (a smaller batch if memory "
                    f"is short), or a loss whose rows are independent. {probe} Losses over the batch's rows together "
                    f"(InfoNCE over its similarity matrix, mining over the batch, statistics over the batch inside the "
                    f"network) are such losses.{later}")
        token, _ = self._routes(public)
        return (f"For '{self.owner_name}', the loss of {name} is normalised over the batch through input "
                f"{position}: {token}, so that the batch's sum is divided by the batch's count. {probe} A masked or "
                f"sample-weighted mean, or a normaliser from the targets, splits into a mean of micro-batch means, "
                f"which is not the batch's mean.")

    def _through_message(self, position: int, how: str, found: tuple, sizes: list, kind, public: bool) -> str:
        token, _ = self._routes(public)
        measured, predicted, _ = found
        return (f"For '{self.owner_name}', the loss of {self.loss_name} is normalised over the batch through "
                f"input {position}: {token}. Found on the first call: with half of micro-batch 0's entries of input "
                f"{position} {how}, the loss on micro-batches 0 and 1 together ({sizes[0] + sizes[1]} rows) is "
                f"{_number(measured)}, but {_number(predicted)} combined from their own losses as "
                f"{self._taken_as(kind)}: a mean of micro-batch means is not the batch's mean.")

    def _labels_message(self, position: int, moved: float, sentinel: int, rows_b: int, rows_a: int,
                        public: bool, weights: bool = False) -> str:
        token, _ = self._routes(public)
        undeclare = "" if public or not self.declared else (
            "; or, where the cell recognises the loss (nn.CrossEntropyLoss, nn.NLLLoss, MindFormers' "
            "CrossEntropyLoss), leave per_token_loss, reduction and kind unset and it counts them")
        return (f"For '{self.owner_name}', the loss of {self.loss_name} weighs the labels of input {position} that are "
                f"{sentinel} otherwise than {self._taken_as(self.kind)}, so micro-batches holding different numbers "
                f"of them do not combine into the full batch's update: {token}, giving each term its sum and count "
                f"(ms_gradaccum.token_sum_loss for nn.CrossEntropyLoss){undeclare}. Found on the first call: with half "
                f"of input {position}'s entries on {rows_a} rows set to {sentinel}, the gradient of the loss "
                + (f"with respect to the last weights on those rows and {rows_b} others together differs from the sum "
                   f"of theirs by {_number(moved)} of its size" if weights else
                   f"on {rows_b} other rows moved by {_number(moved)} of its size")
                + ", as no count of the labels alone explains (a mean over valid labels with a term over the rows "
                  "beside it does this).")

    def _declared_message(self, found, public: bool) -> str:
        token, _ = self._routes(public)
        undeclared = "pass kind=None" if public else "leave per_token_loss, reduction and kind unset"
        return (f"For '{self.owner_name}', the loss of {self.loss_name} is {found.description}, but "
                f"{self._taken_as(self.kind)}: {undeclared} and the cell counts those labels on every step, or "
                f"{token}. Found on the first call: labels of input {found.position} set to {found.ignore_index} on "
                f"some rows move the gradient on the others exactly as such a mean's count does; a mean of "
                f"micro-batch means is not the batch's mean once micro-batches hold different numbers of them.")

    def _values_message(self, pair: int, start: int, stop: int, measured: float, predicted: float, sizes: list,
                        kind, public: bool) -> str:
        token, total = self._routes(public)
        name = self.loss_name
        rows = sizes[pair] + sizes[pair + 1]
        where = (f"on micro-batches {pair} and {pair + 1} together (rows {start} to {stop - 1}) its loss is "
                 f"{_number(measured)}, but {_number(predicted)} combined from their own losses as "
                 f"{self._taken_as(kind)}")
        ratio = measured / predicted if predicted else None
        grows = ratio is not None and abs(ratio - rows / max(sizes[pair], sizes[pair + 1])) < 0.05 * ratio
        if grows:
            return (f"For '{self.owner_name}', the loss of {name} grows with the rows it is given (a sum, or a mean "
                    f"times the batch size): pass {total}. Found on the first call: {where}.")
        return (f"For '{self.owner_name}', the loss of {name} does not combine over micro-batches: if it is "
                f"normalised by something taken over the batch, {token}; if it is a sum, pass {total}. Found on the "
                f"first call: {where} (a count of thresholded targets, or labels other than {IGNORE_INDEX} left out, "
                f"do this).")

    def shared_input_hint(self, engine: nn.Cell, inputs: tuple) -> str:
        """Where giving one split input whole to every micro-batch makes the loss combine: the advice to declare it
        (an input shared by the whole batch whose axis 0 only equals the batch size); _failures asks it too. Tried,
        not guessed: per-row labels of a loss whose normalisation is the problem give no such advice."""
        try:
            batch = BatchRows(engine, inputs)
        except Exception:  # pylint: disable=broad-except
            return ""
        sizes = batch.micro_rows
        if len(sizes) < 2 or not self.reachable(inputs):
            return ""
        rows = sizes[0] + sizes[1]
        for position, (role, index) in enumerate(batch.layout):
            if role != SPLIT or index == 0:
                continue
            try:
                calls = [(batch.rows(start, stop, index), ONE, stop - start, ONE)
                         for start, stop in ((0, sizes[0]), (sizes[0], rows), (0, rows))]
                one, two, both = [(out[1], out[2]) for out in run_eagerly(self._scaled_loss, calls)]
                if not self._combination(self.kind, [one, two], both, rows)[2]:
                    continue
            except Exception:  # pylint: disable=broad-except
                continue
            name = f" ('{engine.input_names[position]}')" if position < len(engine.input_names) else ""
            return (f" Given whole to every micro-batch, input {position}{name} makes the loss combine: if it is not "
                    f"one row per sample but shared by the whole batch (class weights, ids or a mask of fixed size) "
                    f"whose axis 0 only equals the batch size, declare it (e.g. shared_inputs=({position},)): every "
                    f"micro-batch then gets it whole.")
        return ""

    def _on_error(self, error: Exception, engine: nn.Cell, inputs: tuple) -> None:
        """An error of the eager passes: one the network raises on micro-batch rows only is the split's, and says so;
        anything else leaves the check to the graph, which raises what it has to (the package's own refusal of the
        network's output too, after the checks of its surroundings that come first there)."""
        if str(error).startswith(f"For '{self.owner_name}',"):
            return
        network = self._scaled_loss.loss_of_inputs.network
        try:
            batch = BatchRows(engine, inputs)
            split_only = runs_on(network, batch.rows(0, batch.batch))
        except Exception:  # pylint: disable=broad-except
            split_only = False
        if split_only:
            # A graph built from it would fail the same way, at compile or only at run time, without the context.
            from ms_gradaccum.diagnostics.failures import failure_context   # pylint: disable=import-outside-toplevel
            with_context(error, failure_context(self.owner_name, self.micro_size, engine, inputs, 0, self))
            raise error
        # Not the contract: a network that runs only in graph mode, or an error the graph's compile reports with its
        # own message. The graph compares values itself (and raises what it has to).
        self.failed = True

    # --- the graph's comparison, where the probe cannot run -----------------------------------------------------------

    def _compare(self, value, count, pair_value, pair_count, count_unit, rows):
        """Raises, in the graph, where the network's `value` and `count` on the first two micro-batches together
        (`rows`) do not match the loop's tallies of the two, `pair_value` and `pair_count` (in units `count_unit`)."""
        measured = self.kind.compared(value, count, rows, count_unit)
        predicted = self.kind.compared(pair_value, pair_count, rows, count_unit)
        bad = Tensor(False)
        for one, other in zip(measured, predicted):
            size = ops.maximum(ops.abs(one), ops.abs(other))
            bad = ops.logical_or(bad, ops.logical_not(ops.abs(one - other) <= self.rtol * size))
        if bad:
            raise ValueError(
                f"For '{self.owner_name}', the network's loss does not combine over micro-batches as the cell combines "
                f"it, so training would not give the full batch's update: on the first step, its loss on the first two "
                f"micro-batches together ({rows} rows) is {readable(measured[0])}, but {readable(predicted[0])} "
                f"combined from their own losses. Compared inside the graph, where the probe of the loss's structure "
                f"cannot run (a train cell of one's own, a jit function, sink mode): a sum over the rows needs "
                f"reduction='sum'; a normalisation over the batch (a mask, sample weights, a count) needs "
                f"(loss_sum, count) and per_token_loss=True.")
        return bad

    def construct(self, split, others, pair_value, pair_count, count_unit, after):
        """Where the probe could not run: on the graph's first run, the pass on the first two micro-batches together
        inside the graph, compared with the loop's tallies (`after` is returned, made to depend on it)."""
        if self.in_graph:
            rows = pair_rows(split[0].shape[0], self.micro_size)
            if rows > 0:
                first = self.graph_runs == 0
                after = ops.depend(after, ops.assign(self.graph_runs, ops.ones_like(self.graph_runs)))
                if first:
                    shared, constants, layout = others
                    pair = ()
                    for x in split:
                        pair += (x[:rows],)
                    out = self.scaled_loss_cell(assemble(pair, shared, constants, layout), Tensor(1.0, mstype.float32),
                                                rows, count_unit)
                    after = ops.depend(after, self._compare(out[1], out[2], pair_value, pair_count, count_unit, rows))
        return after


