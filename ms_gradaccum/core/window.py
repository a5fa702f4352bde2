"""The window of batches an AccumulatingTrainOneStepCell sums before one optimizer step, as one object.

Like optax's ``MultiStepsState``, the state lives in one place: scalar Parameters saved in checkpoints as
``accu_state.<name>`` (the names of 0.1.0, so its checkpoints load unchanged), with the graph operations the train cell
needs (:meth:`Window.record`, :meth:`Window.closes`, :meth:`Window.reset`, :meth:`Window.unit`) and its Python side.
"""
import warnings

from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum.core.validation import check_positive_int

STATE_PREFIX = "accu_state"   # the window's scalar Parameters: accu_state.<name>


def _scalar(name: str, value, dtype=mstype.int32) -> Parameter:
    return Parameter(Tensor(value, dtype), name=f"{STATE_PREFIX}.{name}", requires_grad=False)


def _write(parameter: Parameter, value: int) -> None:
    # In place: the storage a compiled graph reads (set_data may give the Parameter another one).
    ops.assign(parameter, Tensor(value, parameter.dtype))


class Window(nn.Cell):
    """Where the window stands: batches in it (``window_position``) and in the epoch (``epoch_position``), its length
    (``accumulate_steps``) and the epoch's (``steps_per_epoch``, 0: windows span epochs), the loss value, count and
    rows summed so far, the count unit fixed by its first batch, and the mean loss of the last window applied."""

    def __init__(self, accumulate_steps: int, steps_per_epoch: int, cls_name: str):
        super().__init__(auto_prefix=False)
        self.owner_name = cls_name
        self.closed_at_epoch_end = False   # set by GradAccumulationScheduler, which closes every epoch's last window
        self.warned = False
        self.position = _scalar("window_position", 0)
        self.epoch_position = _scalar("epoch_position", 0)
        self.steps = _scalar("accumulate_steps", accumulate_steps)
        self.steps_per_epoch = _scalar("steps_per_epoch", steps_per_epoch)
        self.loss_sum = _scalar("window_loss_sum", 0.0, mstype.float32)
        self.count = _scalar("window_count", 0.0, mstype.float32)
        self.rows = _scalar("window_rows", 0.0, mstype.float32)
        self.count_unit = _scalar("count_unit", 1.0, mstype.float32)
        self.last_loss = _scalar("last_window_loss", float("nan"), mstype.float32)

    # --- graph side ---------------------------------------------------------------------------------------------

    def unit(self, unit):
        """The count unit of this window: `unit` (this batch's) when it opens the window, else the first batch's."""
        if self.position == 0:
            ops.assign(self.count_unit, unit)
        return ops.depend(self.count_unit * 1.0, unit)

    def record(self, after, value, count, rows):
        """Adds a batch's loss value, count and rows; returns `after` made to depend on the writes."""
        ones = ops.ones((), mstype.int32)
        for parameter, amount in ((self.loss_sum, value), (self.count, count), (self.rows, rows),
                                  (self.position, ones), (self.epoch_position, ones)):
            after = ops.depend(after, ops.assign_add(parameter, amount))
        return after

    def closes(self):
        """Whether the batch just recorded closes the window: it is full, or it ends the epoch (whose position then
        restarts)."""
        epoch_end = ops.logical_and(self.steps_per_epoch > 0, self.epoch_position >= self.steps_per_epoch)
        if epoch_end:
            ops.assign(self.epoch_position, ops.zeros((), mstype.int32))
        return ops.logical_or(self.position >= self.steps, epoch_end)

    def reset(self, done, window_loss):
        """Once `done` (an int32 scalar that exists after the step) exists: the window's loss kept, its sums and
        position zeroed. Returns `done` made to depend on the writes."""
        done = ops.depend(done, ops.assign(self.last_loss, window_loss))
        zero = ops.cast(done, mstype.float32)
        for parameter in (self.loss_sum, self.count, self.rows):
            done = ops.depend(done, ops.assign(parameter, zero))
        return ops.depend(done, ops.assign(self.position, done))

    # --- Python side ----------------------------------------------------------------------------------------------

    def state_parameters(self) -> list:
        """The state's Parameters, in a fixed order (for trainers that save them elsewhere too)."""
        return [self.position, self.epoch_position, self.steps, self.steps_per_epoch, self.loss_sum, self.count,
                self.rows, self.count_unit, self.last_loss]

    @property
    def pending_batches(self) -> int:
        return int(self.position.asnumpy())

    @property
    def accumulate_steps(self) -> int:
        return int(self.steps.asnumpy())

    @property
    def epoch_length(self) -> int:
        return int(self.steps_per_epoch.asnumpy())

    @property
    def last_window_loss(self) -> float:
        return float(self.last_loss.asnumpy())

    def warn_if_left_open(self, owner: str, under_model: bool) -> None:
        """One UserWarning when Model trains windows of several batches (`under_model`) and nothing closes an epoch's
        last window: it would run on into the next epoch, and the last one of training would never be applied."""
        if self.closed_at_epoch_end or self.warned:
            return
        steps = self.accumulate_steps
        if steps == 1 or self.epoch_length or not under_model:
            return
        self.warned = True
        warnings.warn(
            f"{owner}: Model trains windows of accumulate_steps={steps} batches, but nothing closes an epoch's last "
            f"window: it runs on into the next epoch, and a window still open when training ends is never applied "
            f"(pending_batches counts it). Pass callbacks=[GradAccumulationScheduler({{0: {steps}}})] to Model.train, "
            f"which closes every epoch's last window as Lightning does, or steps_per_epoch=<batches per epoch> to the "
            f"cell.", UserWarning, stacklevel=2)

    def set_accumulate_steps(self, accumulate_steps: int) -> None:
        value = check_positive_int(accumulate_steps, "accumulate_steps", self.owner_name)
        _write(self.steps, value)

    def set_steps_per_epoch(self, steps_per_epoch: int) -> None:
        value = check_positive_int(steps_per_epoch, "steps_per_epoch", self.owner_name)
        _write(self.steps_per_epoch, value)


class StateUnderOptimizer(nn.Cell):
    """A train cell's window state (buffers, window, loss scale: ``AccumulatingTrainOneStepCell.state()``) registered
    under its optimizer as well (the same Parameters, under their own names), for trainers whose resume loads a
    checkpoint into the model and the optimizer only (MindFormers' ``load_ckpt``, mindone's ``resume_train_network``).
    """

    def __init__(self, parameters):
        super().__init__(auto_prefix=False)
        for parameter in parameters:
            self.insert_param_to_cell(parameter.name, parameter, check_name_contain_dot=False)
