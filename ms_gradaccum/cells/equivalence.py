"""check_equivalence: does accumulation give the full-batch update on THIS machine, in THIS parallel mode?

The question users with GPUs or Ascend cards must be able to answer for themselves (this project's tests
cannot run there). Both runs go through ``mindspore.Model``, so each gets the train cell ``Model`` builds
for the parallel mode in force: stand-alone, data parallel, or semi-auto/auto parallel (where
``GradAccumulationCell`` hands the accumulation to MindSpore's parallel pass).
"""
import dataclasses
import sys
from typing import Callable, List, Optional, Sequence, TextIO

import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore import nn

from ms_gradaccum._mindspore.randomness import random_primitives
from ms_gradaccum.cells.grad_accumulation import GradAccumulationCell
from ms_gradaccum.core.validation import batch_norm_cells, check_positive_int

_NAME = "check_equivalence"


@dataclasses.dataclass
class ParameterDifference:
    """One parameter: how far the accumulated run is from the full batch, relative to the full batch's update."""
    name: str
    max_difference: float
    max_update: float

    @property
    def relative(self) -> float:
        return self.max_difference / self.max_update if self.max_update > 0 else float("inf")


@dataclasses.dataclass
class EquivalenceReport:
    """The outcome of :func:`check_equivalence`; ``bool(report)`` is ``report.passed``."""
    passed: bool
    tolerance: float
    parameters: List[ParameterDifference]
    causes: List[str]

    def __bool__(self) -> bool:
        return self.passed


class _Batches:
    """Whole batches as dataset rows (no ``.batch()``), in order."""

    def __init__(self, batches):
        self.batches = [tuple(np.asarray(a) for a in batch) for batch in batches]

    def __getitem__(self, index):
        return self.batches[index]

    def __len__(self):
        return len(self.batches)


def _train(network: nn.Cell, optimizer: nn.Optimizer, batches) -> None:
    columns = [f"input_{i}" for i in range(len(batches[0]))]
    dataset = ds.GeneratorDataset(_Batches(batches), columns, shuffle=False)
    ms.Model(network, optimizer=optimizer).train(1, dataset, dataset_sink_mode=False)


def _likely_causes(network: nn.Cell, actual: dict, expected: dict, initial: dict, micro_size: int) -> List[str]:
    causes = []
    norms = batch_norm_cells(network)
    if norms:
        causes.append(f"batch normalisation ({', '.join(norms)}): its statistics are per micro-batch")
    random = sorted({f"{type(cell).__name__}.{attribute} ({type(primitive).__name__})"
                     for cell, attribute, primitive in random_primitives(network)})
    if random:
        causes.append(f"random draws ({', '.join(random)}): masks and noise differ between the runs; set_train(False) "
                      f"the cells that draw them or drop them for the check")
    update = np.sqrt(sum(float(np.sum((actual[n] - initial[n]) ** 2)) for n in initial))
    reference = np.sqrt(sum(float(np.sum((expected[n] - initial[n]) ** 2)) for n in initial))
    if reference > 0 and micro_size > 1:
        ratio = update / reference
        if abs(ratio * micro_size - 1) < 0.2 or abs(ratio / micro_size - 1) < 0.2:
            causes.append(f"a loss that is not a mean over the batch: the accumulated update is {ratio:.3g}x the "
                          f"full batch's (micro_size={micro_size}); reduce the loss with a mean, or return "
                          f"(loss_sum, count)")
    if not causes:
        causes.append("none visible (no BatchNorm, no dropout, update sizes agree): look for other state that "
                      "depends on the batch, or a tolerance too tight for this precision")
    return causes


def check_equivalence(make_loss_network: Callable[[], nn.Cell], batches: Sequence[Sequence[np.ndarray]],
                      micro_size: int, make_optimizer: Optional[Callable[[list], nn.Optimizer]] = None,
                      tolerance: float = 1e-3, stream: Optional[TextIO] = None) -> EquivalenceReport:
    r"""
    Train twice from the same weights on the same batches, ``GradAccumulationCell(loss_net, micro_size)``
    against the plain full batch, both through ``mindspore.Model`` in the parallel mode in force, and compare
    every parameter.

    A parameter passes when its largest difference between the two runs is at most `tolerance` times the
    largest change the full-batch run made to it; every parameter must also have moved (otherwise the check
    would pass vacuously). Run it on each rank with that rank's batches under data parallel; the report is
    per rank. On FAIL it names the likely causes it can see: batch normalisation, dropout, or a loss that is
    a sum rather than a mean (the updates then differ by a factor of about `micro_size`).

    The cells themselves check the loss contract on their first step (read from the loss network's graph, and where that
    leaves it undecided every row's values compared; ``check_loss``): that stops rows coupled over the batch, or a loss
    not one kind they can count, before any update, but not a loss whose form the graph leaves to the values and that
    breaks only on some batches, nor effects beyond the loss (batch statistics, other state). This function trains
    several steps and compares the weights, so it sees those too; it runs with the cells' check off, to measure how far
    such a network trains.

    Args:
        make_loss_network (Callable[[], Cell]): Builds the loss network, e.g.
            ``lambda: nn.WithLossCell(Net(), loss_fn)``; called twice. The second network gets the first
            one's initial weights.
        batches (Sequence[Sequence[numpy.ndarray]]): The batches, each a sequence of the network's inputs.
        micro_size (int): The number of micro-batches each batch is split into.
        make_optimizer (Callable[[list], Optimizer], optional): Builds the optimizer from the parameters.
            Default: ``None`` (``nn.SGD(params, 0.01)``).
        tolerance (float): The allowed difference, relative to each parameter's full-batch update.
            Default: ``1e-3``.
        stream (TextIO, optional): Where the table goes. Default: ``None`` (standard output).

    Returns:
        EquivalenceReport: ``passed``, ``tolerance``, per-parameter differences, and the likely causes.

    Raises:
        TypeError: If `micro_size` is not an int.
        ValueError: If `micro_size` < 1, `batches` is empty, `tolerance` is not positive, or the two networks
            built by `make_loss_network` do not have the same parameters.
    """
    micro_size = check_positive_int(micro_size, "micro_size", _NAME)
    if not batches:
        raise ValueError(f"For '{_NAME}', the argument 'batches' must hold at least one batch, but got none.")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise ValueError(f"For '{_NAME}', the argument 'tolerance' must be a positive float, but got {tolerance!r}.")
    stream = stream or sys.stdout
    make_optimizer = make_optimizer or (lambda params: nn.SGD(params, 0.01))

    reference_net, candidate_net = make_loss_network(), make_loss_network()
    initial = {p.name: p.asnumpy().copy() for p in reference_net.trainable_params()}
    not_loaded, _ = ms.load_param_into_net(candidate_net, {p.name: ms.Parameter(p.data.copy(), name=p.name)
                                                           for p in reference_net.get_parameters()})
    if not_loaded or sorted(initial) != sorted(p.name for p in candidate_net.trainable_params()):
        raise ValueError(f"For '{_NAME}', 'make_loss_network' must build the same network each call, but the two "
                         f"builds differ in their parameters (not loaded: {not_loaded}).")

    _train(reference_net, make_optimizer(reference_net.trainable_params()), batches)
    # The loss contract's own check is off here: this measures how far a broken loss trains (the cells stop it).
    accumulated = GradAccumulationCell(candidate_net, micro_size, check_loss=False)
    _train(accumulated, make_optimizer(candidate_net.trainable_params()), batches)

    expected = {p.name: p.asnumpy() for p in reference_net.trainable_params()}
    actual = {p.name: p.asnumpy() for p in candidate_net.trainable_params()}
    rows = [ParameterDifference(name, float(np.max(np.abs(actual[name] - expected[name]))),
                                float(np.max(np.abs(expected[name] - initial[name])))) for name in initial]
    passed = all(row.max_update > 0 and row.relative <= tolerance for row in rows)
    causes = [] if passed else _likely_causes(candidate_net, actual, expected, initial, micro_size)

    mode = ms.get_auto_parallel_context("parallel_mode")
    print(f"equivalence check: GradAccumulationCell(micro_size={micro_size}) vs full batch, {len(batches)} step(s), "
          f"parallel mode {mode}", file=stream)
    width = max(len(row.name) for row in rows)
    print(f"  {'parameter':<{width}}  max |diff|   max |update|  diff/update", file=stream)
    for row in rows:
        flag = "" if row.max_update > 0 and row.relative <= tolerance else "  <-"
        print(f"  {row.name:<{width}}  {row.max_difference:10.3e}  {row.max_update:12.3e}  {row.relative:11.3e}{flag}",
              file=stream)
    verdict = "PASS" if passed else "FAIL"
    print(f"equivalence check: {verdict} (tolerance {tolerance:g} of each parameter's full-batch update; "
          f"max {max(row.relative for row in rows):.3e})", file=stream)
    for cause in causes:
        print(f"  likely cause: {cause}", file=stream)
    stream.flush()
    return EquivalenceReport(passed, tolerance, rows, causes)
