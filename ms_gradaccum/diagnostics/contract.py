"""The loss contract, checked on the first step and again on later ones instead of assumed (docs/design.md, "What is
decided when").

The cells are exact when the loss is what they are told (a row mean, a row sum, ``(loss_sum, count)``, or a loss they
recognise, _tokens); losses that zoos and users write break that without a sign (a detector's ``B * sum / max(S, 1)``
trained 4 to 16 times too small; a masked mean over micro-batches whose masks differ is a mean of means). On the steps
:func:`check_due` names (1, 2, 4, ... :data:`RECHECK_EVERY`, then every :data:`RECHECK_EVERY`), the network's loss on
the first two micro-batches together is compared with what the kind tallies from their own losses; a mismatch stops
before that step's update, with the ratio and the route that fits. The first step shows a loss that scales with its
rows; a normalisation by a count taken over the batch shows on the first step whose micro-batches hold different
counts, which the later checks sample; one whose rows' losses are still alike (a zero output layer) combines in
value but not in gradient, so the eager passes also compare the gradients of the last two trainable weights
(:meth:`ContractCheck.compare_gradients`). The passes run eagerly (PyNative, ``_eager.run_eagerly``) on the batch the
step is called with, before its graph runs. Batch statistics and dropout are tolerated within [1/1.5, 1.5].
Where the batch cannot be reached from Python (a train cell of one's own, a ``jit`` function, sink mode, dynamic
shapes) or the network runs only in graph mode, the graph runs the pair's pass itself, on the same steps.
"""
import numbers
from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._base import PrecisionNeutral, Unsaved
from ms_gradaccum._mindspore.graph import compile_time, eager_mode, gradients_recorded, primexpr
from ms_gradaccum._mindspore.patches import with_context
from ms_gradaccum._mindspore.surroundings import parallel_mode
from ms_gradaccum.diagnostics.eager import BatchRows, run_eagerly, runs_on
from ms_gradaccum._microbatch import SPLIT, assemble, micro_batch_rows
from ms_gradaccum._validation import batch_norm_cells, computes_in_float16, readable

# Relative tolerance of the comparison: float32 reductions in another order; float16 networks round far more.
RTOL, RTOL_FLOAT16, ATOL = 1e-3, 2e-2, 1e-6
# Where batch statistics or random cells make the two forward passes differ anyway: only a gross mismatch stops.
NOISY_BAND = 1.5
ONE = Tensor(1.0, mstype.float32)   # the eager passes' scale and count unit (the unit cancels in every comparison)
# The checks after the first: steps 2, 4, 8, ... up to this one, then every this many steps (docs/measurements.md,
# "The loss contract's re-checks", for their cost).
RECHECK_EVERY = 1024


def check_due(step: int) -> bool:
    """Whether the loss contract is checked on `step` (counted from 1): a power of two up to
    :data:`RECHECK_EVERY`, then every multiple of it."""
    return step & (step - 1) == 0 if step <= RECHECK_EVERY else step % RECHECK_EVERY == 0


def _due_in_graph(step):
    """:func:`check_due` in a graph, on an int32 step."""
    power_of_two = ops.logical_and(ops.bitwise_and(step, step - 1) == 0, step <= RECHECK_EVERY)
    return ops.logical_or(power_of_two, ops.logical_and(step > RECHECK_EVERY, step % RECHECK_EVERY == 0))


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
    sizes = micro_batch_rows(batch, micro_size)[:2]
    return sizes[0] + sizes[1] if len(sizes) == 2 else 0


def routes(kind) -> str:
    """The exact routes, for the message (`kind`: the loss kind, _kinds)."""
    return (f"The cell was told the loss is {kind.description}. If the loss is a sum over the rows, or a mean "
            f"multiplied by the batch size, pass reduction='sum'. If it is normalised by a count taken over the batch "
            f"(valid tokens, a mask, sample weights, targets, a score sum), return (loss_sum, count) and pass "
            f"per_token_loss=True (min_count=1.0 for a max(count, 1) floor, and reduction='sum' as well if it is also "
            f"multiplied by the batch size). If you know the loss is fine here, pass check_loss=False.")


class GradientPass(nn.Cell):
    """A pass of the engine's ``ScaledLoss`` (scale 1) and the gradient of its loss with respect to `weights`, eagerly:
    its four outputs and the gradients as a fifth."""

    def __init__(self, scaled_loss: nn.Cell, weights: list):
        super().__init__(auto_prefix=False)
        self.scaled_loss = scaled_loss
        object.__setattr__(self, "_weights", list(weights))   # not a Cell attribute: nothing of theirs is renamed

    def construct(self, *args):
        # Made here, in PyNative mode with recording on: value_and_grad reads the mode when it is made, and made in
        # graph mode it compiles a graph on every call.
        with gradients_recorded():
            outputs, gradients = ms.value_and_grad(self.scaled_loss, None, self._weights, has_aux=True)(*args)
        return tuple(outputs) + (gradients,)


class ContractCheck(PrecisionNeutral):
    """The check (see the module docstring). :meth:`check_step` runs it eagerly before a step's graph runs, on the steps
    :func:`check_due` names; where it cannot run so, ``construct`` runs the pass on the pair inside the graph, on the
    same steps, and compares it with the loop's own tallies of the two micro-batches."""

    def __init__(self, scaled_loss: nn.Cell, network: nn.Cell, micro_size: int, kind, enabled: bool, cls_name: str):
        super().__init__(auto_prefix=False)
        object.__setattr__(self, "_scaled_loss", scaled_loss)   # the engine's own cell: not a second child
        self.micro_size = micro_size
        self.kind = kind
        self.enabled = enabled
        self.owner_name = cls_name
        self.rtol = RTOL_FLOAT16 if computes_in_float16(network) else RTOL
        noise = batch_norm_cells(network) + random_cells(network)
        self.noisy = bool(noise)
        self.noise = f" The network has batch statistics or random cells ({', '.join(noise)}): their noise " \
                     f"is tolerated, so only a ratio outside [1/{NOISY_BAND}, {NOISY_BAND}] stops." if noise else ""
        # The steps the graph's own check has counted (0 while it has run none).
        self._graph_steps = Unsaved(Parameter(Tensor(0, mstype.int32), name="accu_state.loss_contract_step",
                                              requires_grad=False))
        # Python state. `steps`: the steps counted so far. `passed`: the eager check ran and held (graphs compiled
        # later leave the in-graph check out). `failed`: the eager pass cannot run (the graph runs the pass itself).
        self.steps = 0
        self.passed = False
        self.failed = False
        self.graph_checks = False
        self.gradients_fail = False

    @compile_time
    def graph_steps(self) -> Parameter:
        return self._graph_steps.parameter

    @compile_time
    def in_graph(self) -> bool:
        """Whether the graph being compiled holds the check: it is on and the eager check has not run (where it can,
        it has run by the time a graph compiles, or stopped)."""
        return self.enabled and not self.passed

    def count_step(self, engine: nn.Cell, inputs: tuple) -> None:
        """A step on `inputs` (the owner's; the batch) is about to compile or run: counted, and on the steps
        :func:`check_due` names the check runs first (:meth:`check_step`). The step counter of diagnostics.calls does
        the same, inline."""
        self.steps += 1
        if check_due(self.steps):
            self.check_step(engine, inputs)

    def check_step(self, engine: nn.Cell, inputs: tuple) -> None:
        """The check, eagerly, where it is on (it raises on a mismatch, before anything is compiled or updated). Where
        it cannot run eagerly (a semi-auto/auto-parallel graph's global shapes, inputs without data, a network that runs
        only in graph mode), the graph runs it."""
        if self.enabled and not self.failed and not self._graph_runs_it():
            self._check_eagerly(engine, inputs)

    def _graph_runs_it(self) -> bool:
        # Read from the graph's step counter (a device read, on the steps due only, until it has counted one).
        if not self.graph_checks and not self.passed and int(self.graph_steps.asnumpy()) > 0:
            self.graph_checks = True
        return self.graph_checks

    def _passes(self, engine: nn.Cell, inputs: tuple, whole: Optional[int] = None):
        """The tallies ``[(value, count), ...]`` of the network's forward pass, eagerly, on the first micro-batch, on
        the second and on the two together (with `whole`, that split input given whole to each), their rows and the
        batch's split (for :meth:`_gradient_passes`); None where the passes cannot run (the graph runs the check
        then)."""
        if parallel_mode() not in (ms.ParallelMode.STAND_ALONE, ms.ParallelMode.DATA_PARALLEL):
            return None
        if not inputs or any(isinstance(x, Tensor) and (x.has_init or any(d < 0 for d in x.shape)) for x in inputs):
            return None
        batch = BatchRows(engine, inputs)
        sizes = batch.micro_rows[:2]
        if len(sizes) < 2:
            return None
        spans = [(0, sizes[0]), (sizes[0], sizes[0] + sizes[1]), (0, sizes[0] + sizes[1])]
        calls = [(batch.rows(start, stop, whole), ONE, stop - start, ONE) for start, stop in spans]
        outputs = run_eagerly(self._scaled_loss, calls)
        return [(out[1], out[2]) for out in outputs], sizes, batch

    def _gradient_passes(self, batch: BatchRows, sizes: list):
        """``(tallies, gradients, rows, weights)`` of three passes that take the gradients of `weights`
        (:meth:`gradient_weights`): on the
        first half of each of the two micro-batches and on the two halves together (the rows of one micro-batch at
        most: what they hold for the backward pass is no more than a micro-batch step holds); None where they are not
        taken or taking them fails (the forward passes have run: an error of the network's was raised there)."""
        weights = self.gradient_weights()
        if not weights:
            return None
        first, second = (0, max(1, sizes[0] // 2)), (sizes[0], sizes[0] + max(1, sizes[1] // 2))
        calls = [(batch.spans(spans), ONE, sum(stop - start for start, stop in spans), ONE)
                 for spans in ([first], [second], [first, second])]
        try:
            outputs = run_eagerly(GradientPass(self._scaled_loss, weights), calls)
        except Exception:  # pylint: disable=broad-except
            self.gradients_fail = True   # not differentiable eagerly: the values alone decide from now on
            return None
        return [(out[1], out[2]) for out in outputs], [out[4] for out in outputs], calls[2][2], weights

    def gradient_weights(self) -> list:
        """The weights whose gradients the check compares besides the losses: the network's last two trainable ones
        (usually its output layer's, so the backward pass is short); none where the network's own cells count the
        loss (a recognised loss: exact by construction), where batch statistics or random cells make the passes
        differ anyway, or where taking them failed once."""
        if self.noisy or self.gradients_fail or self._scaled_loss.counts_in_network:
            return []
        return self._scaled_loss.trainable_params()[-2:]

    def _check_eagerly(self, engine: nn.Cell, inputs: tuple) -> None:
        """The check on the eager passes (see :meth:`check_step`): raises on a mismatch, or leaves it to the graph where
        the passes cannot run."""
        try:
            found = self._passes(engine, inputs)
        except Exception as error:  # pylint: disable=broad-except
            self._on_error(error, engine, inputs)
            return
        if found is None:
            return
        (first, second, pair), sizes, batch = found
        self.passed = True
        if not all(np.isfinite(x.asnumpy()).all() for x in first + second):
            return   # a non-finite micro-batch: the engine's own check stops the step, naming it
        try:
            with eager_mode():
                self._compare(pair[0], pair[1], first[0] + second[0], first[1] + second[1], ONE, sum(sizes),
                              self.steps)
        except ValueError as error:
            error.args = (error.args[0] + self.shared_input_hint(engine, inputs),) + error.args[1:]
            raise
        gradient_passes = self._gradient_passes(batch, sizes)   # only once the values held
        if gradient_passes is not None:
            self.compare_gradients(*gradient_passes, self.steps)

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
            # The pair's rows where its pass (the last) failed, else a micro-batch's.
            sizes = batch.micro_rows
            pair_rows_run = sizes[0] + sizes[1] if getattr(error, "eager_call", None) == 2 else 0
            from ms_gradaccum.diagnostics.failures import failure_context   # pylint: disable=import-outside-toplevel
            with_context(error, failure_context(self.owner_name, self.micro_size, engine, inputs, pair_rows_run))
            raise error
        # Not the contract: a network that runs only in graph mode, or an error the graph's compile reports with its
        # own message. The graph runs the pass (and raises what it has to).
        self.failed = True

    def shared_input_hint(self, engine: nn.Cell, inputs: tuple) -> str:
        """Where giving one split input whole to every micro-batch makes the loss combine: the advice to declare it
        (an input shared by the whole batch whose axis 0 only equals the batch size); _failures asks it too. Tried,
        not guessed: per-row labels of a loss whose normalisation is the problem give no such advice."""
        for position, (role, index) in enumerate(BatchRows(engine, inputs).layout):
            if role != SPLIT or index == 0:
                continue
            try:
                (first, second, pair), sizes, _ = self._passes(engine, inputs, whole=index)
                with eager_mode():
                    self._compare(pair[0], pair[1], first[0] + second[0], first[1] + second[1], ONE, sum(sizes),
                                  self.steps)
            except Exception:  # pylint: disable=broad-except
                continue
            name = f" ('{engine.input_names[position]}')" if position < len(engine.input_names) else ""
            return (f" Given whole to every micro-batch, input {position}{name} makes the loss combine: if it is not "
                    f"one row per sample but shared by the whole batch (class weights, ids or a mask of fixed size) "
                    f"whose axis 0 only equals the batch size, declare it (e.g. shared_inputs=({position},)): every "
                    f"micro-batch then gets it whole.")
        return ""

    def compare_gradients(self, tallies, gradients, rows, weights, step, where="on step "):
        """Raises where the gradients of the pair's pass (`gradients[2]`, over its divisor) differ from the sum of the
        two parts' (over theirs), as the engine combines them: what the loss values cannot show while the rows' losses
        are alike (a sample-weighted mean at initialisation), each weight's largest difference against its largest
        gradient. `tallies`: the passes' ``(value, count)``; `rows`: the pair's; `weights`: those differentiated
        (:meth:`_gradient_passes`)."""
        (first, second, pair), (grad_first, grad_second, grad_pair) = tallies, gradients
        if not all(np.isfinite(x.asnumpy()).all() for x in first + second + pair):
            return   # a part without a valid row (0/0): the engine's own check names a micro-batch that is not finite
        with eager_mode():
            measured = self.kind.normalise(ONE, pair[0], pair[1], 1.0, rows, ONE)[1]
            predicted = self.kind.normalise(ONE, first[0] + second[0], first[1] + second[1], 1.0, rows, ONE)[1]
        measured, predicted = (float(x.asnumpy().reshape(())) for x in (measured, predicted))
        if not (np.isfinite([measured, predicted]).all() and measured > 0 and predicted > 0):
            return   # nothing counted (a divisor of 0 or infinity): nothing to compare
        for weight, one, other, together in zip(weights, grad_first, grad_second, grad_pair):
            whole = together.asnumpy().astype(np.float64) / measured
            combined = (one.asnumpy().astype(np.float64) + other.asnumpy().astype(np.float64)) / predicted
            size, difference = float(np.abs(combined).max()), float(np.abs(whole - combined).max())
            if not difference <= self.rtol * size + ATOL:
                raise ValueError(
                    f"For '{self.owner_name}', the network's loss does not combine over micro-batches as the cell "
                    f"computes it, so training would not give the full batch's update: {where}{step}, the gradient of "
                    f"its loss on the first halves of the first two micro-batches together ({rows} rows) differs from "
                    f"the one combined from their own by {readable(difference / size if size else float('inf'))} of "
                    f"its largest element (weight '{weight.name}'), though the losses agree: a normalisation over the "
                    f"batch whose rows' losses are still alike.{self.noise} {routes(self.kind)}")

    def _mismatch(self, measured, predicted):
        """Whether `measured` and `predicted` differ beyond the tolerance; a NaN on either side is a mismatch."""
        if self.noisy:
            ratio = measured / ops.select(predicted == 0, ops.ones_like(predicted), predicted)
            return ops.logical_not(ops.logical_and(ratio <= NOISY_BAND, ratio >= 1 / NOISY_BAND))
        return ops.logical_not(ops.abs(measured - predicted) <= self.rtol * ops.abs(predicted) + ATOL)

    def _compare(self, value, count, pair_value, pair_count, count_unit, rows, step, where="on step "):
        """Raises where the network's `value` and `count` on the pair's `rows` together do not match its tallies of the
        two micro-batches, `pair_value` and `pair_count` (eagerly, and in the graph where it runs the pass), all in
        count units `unit`; returns whether they differ (False). The message says where: ``where + step``."""
        measured = self.kind.compared(value, count, rows, count_unit)
        predicted = self.kind.compared(pair_value, pair_count, rows, count_unit)
        bad = self._mismatch(measured[0], predicted[0])
        for one, other in zip(measured[1:], predicted[1:]):
            bad = ops.logical_or(bad, self._mismatch(one, other))
        measured, predicted = measured[0], predicted[0]
        if bad:
            ratio = readable(measured / predicted)
            measured, predicted = readable(measured), readable(predicted)
            raise ValueError(
                f"For '{self.owner_name}', the network's loss does not combine over micro-batches as the "
                f"cell computes it, so training would not give the full batch's update: {where}{step}, its loss on "
                f"the first two micro-batches together ({rows} rows) is {measured}, but combined from their own "
                f"losses it is {predicted} (ratio {ratio}; about 2 means the loss scales with the rows, other values "
                f"a normalisation over the batch).{self.noise} {routes(self.kind)}")
        return bad

    def construct(self, split, others, pair_value, pair_count, count_unit, after):
        """Where the check could not run eagerly: on the steps due, the pass on the pair inside the graph, compared with
        the loop's tallies (`after` is returned, made to depend on it)."""
        if self.in_graph:
            rows = pair_rows(split[0].shape[0], self.micro_size)
            if rows > 0:
                step = self.graph_steps + 1
                after = ops.depend(after, ops.assign(self.graph_steps, step))
                if _due_in_graph(step):
                    shared, constants, layout = others
                    pair = ()
                    for x in split:
                        pair += (x[:rows],)
                    out = self.scaled_loss_cell(assemble(pair, shared, constants, layout), Tensor(1.0, mstype.float32),
                                                rows, count_unit)
                    after = ops.depend(after, self._compare(out[1], out[2], pair_value, pair_count, count_unit, rows,
                                                            step))
        return after

    @compile_time
    def scaled_loss_cell(self) -> nn.Cell:
        return self._scaled_loss
