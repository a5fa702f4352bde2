"""GradAccumulationScheduler: change accumulate_steps at epoch boundaries, like Lightning's callback; and the warning
for a learning-rate list paced per batch while the optimizer steps once per window."""
import math
import warnings
from typing import Dict, List

from mindspore import nn
from mindspore.train import Callback

from ms_gradaccum.cells.accumulating import AccumulatingTrainOneStepCell
from ms_gradaccum.core.validation import argument_error, check_int

_NAME = "GradAccumulationScheduler"


class GradAccumulationScheduler(Callback):
    r"""
    A ``mindspore.train`` callback that sets an :class:`AccumulatingTrainOneStepCell`'s `accumulate_steps`
    at the start of each epoch, following `scheduling`, without recompiling.

    At the end of every epoch it applies the epoch's last, possibly short, window (:meth:`AccumulatingTrainOneStepCell.
    flush`), so windows never span epochs and a new schedule value always starts a fresh window. Windows follow the
    batches ``Model`` actually runs, whatever they are: with ``dataset_sink_mode=True`` and a ``sink_size`` on CPU
    (where MindSpore runs the whole dataset each epoch while callbacks are told ``sink_size``), on devices that sink
    ``sink_size`` batches per epoch, with a short last batch, or when a callback stops an epoch early.

    Args:
        scheduling (dict): ``{epoch: accumulate_steps}`` with zero-based epoch keys (int >= 0) and values
            (int >= 1); a value holds from its epoch until the next key. As in Lightning, when epoch 0 is
            missing the epochs before the first key use 1 (no accumulation). The dict is copied, never
            modified.

    Raises:
        TypeError: If `scheduling` is not a dict, or a key or value is not an int (bool included).
        ValueError: If `scheduling` is empty, a key < 0 or a value < 1.
        TypeError: At the start of training, if ``Model``'s train network contains no
            :class:`AccumulatingTrainOneStepCell`.

    Examples:
        >>> from ms_gradaccum import GradAccumulationScheduler
        >>> scheduler = GradAccumulationScheduler({0: 8, 4: 4, 8: 1})
        >>> [scheduler.accumulate_steps_for(epoch) for epoch in range(10)]
        [8, 8, 8, 8, 4, 4, 4, 4, 1, 1]
    """

    def __init__(self, scheduling: Dict[int, int]):
        super().__init__()
        if not isinstance(scheduling, dict):
            raise TypeError(argument_error(_NAME, "scheduling", "a dict {epoch: accumulate_steps}", scheduling))
        if not scheduling:
            raise ValueError(argument_error(_NAME, "scheduling", "a non-empty dict {epoch: accumulate_steps}",
                                            scheduling))
        schedule = {}
        for epoch, steps in scheduling.items():
            epoch = check_int(epoch, 0, "every key of 'scheduling'", "a zero-based epoch (int >= 0)", _NAME)
            schedule[epoch] = check_int(steps, 1, f"the accumulate_steps of epoch {epoch} in 'scheduling'",
                                        "an int >= 1", _NAME)
        schedule = dict(sorted(schedule.items()))
        if 0 not in schedule:
            schedule = {0: 1, **schedule}
        self.scheduling = schedule
        self._cell = None

    def accumulate_steps_for(self, epoch: int) -> int:
        """accumulate_steps in force during zero-based `epoch`."""
        return [steps for start, steps in self.scheduling.items() if start <= epoch][-1]

    def on_train_begin(self, run_context):
        args = run_context.original_args()
        self._cell = _find_accumulating_cell(args.train_network)
        # Tells the cell that every epoch's last window is closed here (it warns when nothing does).
        self._cell.window.closed_at_epoch_end = True
        epochs, batches = int(args.epoch_num), int(args.batch_num)
        warn_per_batch_schedule(_NAME, self._cell.optimizer, [batches] * epochs,
                                [self.accumulate_steps_for(epoch) for epoch in range(epochs)],
                                "a list with one entry per optimizer step (for mindcv's schedulers, "
                                "ms_gradaccum.mindcv.create_scheduler(..., gradient_accumulation_steps=K))")

    def on_train_epoch_begin(self, run_context):
        # cur_epoch_num is one-based and already counts the epoch that is starting.
        epoch = run_context.original_args().cur_epoch_num - 1
        self._cell.set_accumulate_steps(self.accumulate_steps_for(epoch))

    def on_train_epoch_end(self, run_context):
        # Called after the batches the epoch actually ran (not a count announced up front, which sink_size can
        # make wrong): the window in progress is applied, weighted by what it holds.
        self._cell.flush()


def _find_accumulating_cell(network: nn.Cell) -> AccumulatingTrainOneStepCell:
    for _, cell in network.cells_and_names():
        if isinstance(cell, AccumulatingTrainOneStepCell):
            return cell
    raise TypeError(f"For '{_NAME}', Model's train network must be or contain an AccumulatingTrainOneStepCell, but "
                    f"got {type(network).__name__}. Build it as Model(AccumulatingTrainOneStepCell(loss_net, "
                    f"optimizer, accumulate_steps)) without the optimizer argument.")


def warn_per_batch_schedule(cls_name: str, optimizer: nn.Optimizer, batches: List[int], steps: List[int],
                            helper: str) -> None:
    """One UserWarning when the optimizer's learning-rate list has one entry per batch while it steps once per window
    (`batches` and `steps`: each epoch's batches and accumulate_steps): the schedule would run K times slow, its
    warm-up and decay epochs too. `helper` says how to build it per optimizer step. Lists only: a
    ``LearningRateSchedule`` is a function of the step, which the caller builds knowing what a step is."""
    entries = getattr(optimizer.learning_rate, "learning_rate", None)   # a list: _IteratorLearningRate's Parameter
    if not optimizer.dynamic_lr or optimizer.is_group_lr or entries is None or all(k == 1 for k in steps):
        return
    length, per_batch = int(entries.shape[0]), sum(batches)
    optimizer_steps = sum(math.ceil(b / k) for b, k in zip(batches, steps))
    if length == per_batch != optimizer_steps:
        warnings.warn(
            f"{cls_name}: the optimizer's learning-rate list has {length} entries, one per batch ({len(batches)} "
            f"epochs x {batches[0]} batches), but the optimizer steps once per window: {optimizer_steps} optimizer "
            f"steps. The schedule would run about {per_batch / optimizer_steps:.1f}x slow (its warm-up and decay "
            f"epochs too). Build it per optimizer step: {helper}.", UserWarning, stacklevel=3)
