"""The loss contract (docs/design.md, "The loss contract"): read from the loss network's graph once, before any step
runs, compared by values only where the graph leaves it undecided.

The cells are exact when the loss is what they train it as: a mean over independent rows (the default), a sum, a mean
over a count taken from the inputs, ``(loss_sum, count)`` (``per_token_loss=True``), or a recognised loss they count.
What the graph shows holds whatever values later batches hold, and a kind it shows is the one the cell trains with.

- GRAPH_MODE, stand-alone or data parallel: :meth:`LossContract.read_step` reads the network's forward in the compiled
  step's own graph (``_mindspore.step_graph``; a ``jit`` function's too), after the compile and before the graph runs;
  a kind other than the compiled one compiles the step once more. Where the step cannot show the network, its own
  frontend graph is read (:meth:`LossContract.read_graph`).
- PyNative mode (again when the inputs' layout changes), and semi-auto/auto parallel, whose pass rewrites the step's
  graph: :meth:`LossContract.first_call` reads the network's own frontend graph before the step (stand-alone under
  semi-auto, where a kind MindSpore's pass cannot train, anything but a row mean, stops).
- Undecided (control flow, a primitive without a rule) with nothing random drawn: :meth:`LossContract.compare_values`
  compares every row's values eagerly (diagnostics.values), as the kind combines them, to a relative tolerance; where
  the batch's values cannot be reached (a train cell of one's own, sink mode, a ``jit`` function) or the compile hook
  was removed, the graph compares the first two micro-batches' values on its first run
  (:meth:`LossContract.construct`).
"""
from typing import Optional

from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.graph import compile_time, primexpr
from ms_gradaccum._mindspore.patches import with_context
from ms_gradaccum._mindspore.step_graph import loss_graphs
from ms_gradaccum._mindspore.surroundings import parallel_pass_in_force, stand_alone
from ms_gradaccum.core.base import PrecisionNeutral, Unsaved
from ms_gradaccum.core.microbatch import SPLIT, assemble, micro_batch_rows
from ms_gradaccum.core.validation import computes_in_float16, readable
from ms_gradaccum.diagnostics import graph_contract, values
from ms_gradaccum.diagnostics.eager import BatchRows, runs_on
from ms_gradaccum.diagnostics.findings import Findings, input_layout, loss_name
from ms_gradaccum.diagnostics.graph_messages import LossContractError, beyond_parallel_pass, decided, declare_kind


@primexpr
def pair_rows(batch: int, micro_size: int) -> int:
    """The rows of the first two micro-batches (0 when a batch holds fewer than two)."""
    sizes = micro_batch_rows(batch, micro_size)[:2]
    return sizes[0] + sizes[1] if len(sizes) == 2 else 0


class LossContract(PrecisionNeutral):
    """The loss contract's check (see the module docstring): :meth:`first_call` runs it before the first step's graph
    runs; where it cannot run so, ``construct`` compares the first two micro-batches' values inside the graph, on its
    first run."""

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
        # Python state. `decided`: the contract was read or compared before a graph ran (graphs compiled later leave
        # the in-graph comparison out), on inputs of `layout` (dtypes and ranks). `failed`: it cannot be decided before
        # the graph runs (the graph compares instead). `reads_step`: the compile under way is read after it
        # (:meth:`read_step`), so it leaves the in-graph comparison out.
        self.decided = False
        self.layout = None
        self.failed = False
        self.reads_step = False
        self.findings = None

    @classmethod
    def of(cls, engine: nn.Cell, network: nn.Cell, spec, cls_name: str) -> "LossContract":
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
        return values.RTOL_FLOAT16 if self.half else values.RTOL

    @property
    def engine_network(self) -> nn.Cell:
        """The network the engine runs (a recognised loss's counting copy, where it counts)."""
        return self._scaled_loss.loss_of_inputs.network

    @compile_time
    def in_graph(self) -> bool:
        """Whether the graph being compiled compares values itself: the check is on, did not decide before the compile
        and will not read the compiled step's graph (:meth:`read_step`)."""
        return self.enabled and not self.decided and not self.reads_step

    # --- the first call ---------------------------------------------------------------------------------------------

    def first_call(self, engine: nn.Cell, inputs: tuple, refusable: bool = True):
        """Before the first step's graph compiles or runs on `inputs` (the owner's; the batch): the check, where the
        check is on, unless it ran on inputs of the same layout: the graph read, the values compared where it leaves
        the contract undecided. Returns the kind the graph showed where it differs from the cell's, else None; raises
        :class:`LossContractError` where the loss does not combine. `refusable` is no longer read (no value is written
        into an input)."""
        if not self.enabled or self.failed:
            return None
        layout = input_layout(inputs)
        if self.decided and layout == self.layout:
            return None
        # Semi-auto/auto parallel: the loss network read and run alone, on this process (its errors too).
        with stand_alone():
            try:
                findings = self.read_graph(engine, inputs)
                if findings is None:
                    findings = self.compare_values(engine, inputs)
            except LossContractError as error:
                error.args = (error.args[0] + self.shared_input_hint(engine, inputs),) + error.args[1:]
                raise
            except Exception as error:  # pylint: disable=broad-except
                self._on_error(error, engine, inputs)
                return None
        if findings is not None and parallel_pass_in_force() and not findings.kind.in_parallel_pass:
            raise LossContractError(beyond_parallel_pass(self, findings.kind))
        if findings is None:
            return None
        self.decided, self.layout, self.findings = True, layout, findings
        return findings.kind if findings.kind != self.kind else None

    # --- after the step's compile, before its graph runs ------------------------------------------------------------

    def expect_step(self) -> bool:
        """Before a compile of the step: the contract will be read from the compiled step's graph (:meth:`read_step`),
        where it is on and undecided; True where it will."""
        self.reads_step = self.enabled and not self.decided and not self.failed
        return self.reads_step

    def read_step(self, engine: nn.Cell, proto, weights: frozenset, inputs: Optional[tuple], comparable: bool):
        """After the compile :meth:`expect_step` prepared, before its graph runs: the contract read from the network's
        forward in the step's own graph (``proto()``: its MindIR; `weights`: the names of its Parameters;
        ``_mindspore.step_graph``); the network is compiled apart only where the step cannot show it (no marked loop
        body, a constant proportional to the rows to confirm). `inputs`: the batch, or Tensors of its shapes and dtypes
        (`comparable` False: their values are not the batch's), None where neither is known. Returns ``(kind,
        again)``: the kind the graph showed where it differs from the cell's (trained from the next compile), and
        whether the step must compile again (with that kind, or with the graph's own comparison where nothing decided
        before it runs). Raises :class:`LossContractError` where the loss does not combine."""
        self.reads_step = False
        batch = self._batch(engine, inputs) if inputs is not None and self.reachable(inputs) else None
        if batch is None and inputs is not None and self.reachable(inputs):
            return None, False   # fewer than two micro-batches: nothing to combine
        try:
            findings = None if batch is None else self._step_findings(engine, proto, weights, inputs, batch)
            if findings is None and comparable:
                findings = self.compare_values(engine, inputs)
        except LossContractError as error:
            if comparable:
                error.args = (error.args[0] + self.shared_input_hint(engine, inputs),) + error.args[1:]
            raise
        except Exception as error:  # pylint: disable=broad-except
            if comparable:
                self._on_error(error, engine, inputs)
            findings = None
        if findings is None:
            self.failed = True   # the graph compares the first two micro-batches' values on its first run
            return None, True
        self.decided, self.layout, self.findings = True, input_layout(inputs), findings
        kind = findings.kind if findings.kind != self.kind else None
        return kind, kind is not None

    def _step_findings(self, engine: nn.Cell, proto, weights: frozenset, inputs: tuple,
                       batch: BatchRows) -> Optional[Findings]:
        """What the step's graph shows (the network's own, compiled apart, where it shows nothing); None where
        undecided and nothing random is drawn."""
        layout = engine.scaled_loss.record.layout
        reading = None
        if layout is not None:
            try:
                bodies = loss_graphs(proto(), weights, type(self._user_network).__name__)
            except Exception:  # pylint: disable=broad-except
                bodies = []   # not the network's: the network's own graph is read instead
            positions = {index: position for position, (role, index) in enumerate(layout[2]) if role == SPLIT}
            reading = graph_contract.read_step(bodies, positions) if bodies else None
        if reading is None:
            return self.read_graph(engine, inputs)
        return self._found(reading, batch.batch, False)

    def read_compiled(self, engine: nn.Cell, inputs: tuple) -> None:
        """After a compile the batch did not reach beforehand, before its graph runs (diagnostics.calls): the graph
        read on `inputs` (of the batch's shapes and dtypes; their values are not read). Raises
        :class:`LossContractError` where it stops, or where it shows a kind other than the one the graph was compiled
        for (the route to declare it); undecided, the compiled graph compares values on its first run."""
        layout = input_layout(inputs)
        with stand_alone():
            findings = self.read_graph(engine, inputs)
        if findings is None:
            return
        if parallel_pass_in_force() and not findings.kind.in_parallel_pass:
            raise LossContractError(beyond_parallel_pass(self, findings.kind))
        if findings.kind != self.kind:
            raise LossContractError(declare_kind(self, findings.kind))
        self.decided, self.layout, self.findings = True, layout, findings

    def reachable(self, inputs: tuple) -> bool:
        """Whether the contract can be read on `inputs`: Tensors with data and static shapes (in any parallel mode:
        under semi-auto/auto parallel it is read stand-alone)."""
        return bool(inputs) and not any(isinstance(x, Tensor) and (x.has_init or any(d < 0 for d in x.shape))
                                        for x in inputs)

    def _batch(self, engine: nn.Cell, inputs: tuple) -> Optional[BatchRows]:
        """`inputs` split as the engine splits them, or None where the contract cannot be read on them (not reachable
        from Python, fewer than two micro-batches)."""
        if not self.reachable(inputs):
            return None
        batch = BatchRows(engine, inputs)
        return batch if len(batch.micro_rows) >= 2 else None

    def read_graph(self, engine: nn.Cell, inputs: tuple, public: bool = False) -> Optional[Findings]:
        """The contract read from the loss network's graph (diagnostics.graph_contract), compiled for micro-batch 0's
        inputs: raises :class:`LossContractError` where it shows the loss does not combine, else returns what it
        found; None where the graph leaves it undecided and the network draws nothing random (the value
        comparison decides then)."""
        batch = self._batch(engine, inputs)
        if batch is None:
            return None
        sizes = batch.micro_rows
        try:
            other = sizes[0] - 1 if sizes[0] > 1 else min(2, batch.batch)
            reading = graph_contract.read(self._user_network, lambda rows: batch.rows(0, rows),
                                          tuple(batch.positions), sizes[0], other)
        except Exception:  # pylint: disable=broad-except
            return None   # the network's own error: the eager passes report it with the split's context
        return self._found(reading, batch.batch, public)

    def _found(self, reading, batch: int, public: bool) -> Optional[Findings]:
        """The findings of a graph's `reading` on a batch of `batch` rows (what it decides: graph_messages.decided)."""
        kind = decided(self, reading, public)
        if kind is None:
            return None
        ignore = reading.count_input if kind.ignores_labels else None
        return Findings(kind, True, ignore, bool(reading.random), 0, batch, read_from_graph=True, graph=reading)

    def compare_values(self, engine: nn.Cell, inputs: tuple, public: bool = False) -> Optional[Findings]:
        """Where the graph leaves the contract undecided: every row's values compared (diagnostics.values), eagerly,
        where the network draws no random values (a network that draws is accepted as declared: the graph's reading
        stops an undeclared one). Raises :class:`LossContractError` where the loss does not combine, else returns
        what it found; None where it cannot run (the graph compares then). `public`: messages name
        ``check_loss_contract``'s arguments."""
        batch = self._batch(engine, inputs)
        if batch is None:
            return None
        random, measured, predicted, rows, not_finite = values.compare_rows(self, batch, public)
        return Findings(self.kind, None, None, random, rows, batch.batch, measured, predicted, not_finite)

    def shared_input_hint(self, engine: nn.Cell, inputs: tuple) -> str:
        """The advice to give one split input whole to every micro-batch, where that makes the loss combine
        (diagnostics.values); diagnostics.failures asks it too."""
        return values.shared_input_hint(self, engine, inputs)

    def _on_error(self, error: Exception, engine: nn.Cell, inputs: tuple) -> None:
        """An error of the eager passes: one the network raises on micro-batch rows only is the split's, and says so;
        anything else leaves the check to the graph, which raises what it has to (the package's own refusal of the
        network's output too, after the checks of its surroundings that come first there)."""
        if str(error).startswith(f"For '{self.owner_name}',"):
            return
        network = self.engine_network
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

    # --- the graph's comparison, where the first call's check cannot run --------------------------------------------

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
                f"combined from their own losses. Compared inside the graph, where the loss network's graph "
                f"left it undecided and the batch's values were out of reach before: a sum over the rows needs "
                f"reduction='sum'; a normalisation over the batch (a mask, sample weights, a count) needs "
                f"(loss_sum, count) and per_token_loss=True.")
        return bad

    def construct(self, split, others, pair_value, pair_count, count_unit, after):
        """Where the first call's check could not run: on the graph's first run, the pass on the first two micro-batches
        together inside the graph, compared with the loop's tallies (`after` is returned, made to depend on it)."""
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


