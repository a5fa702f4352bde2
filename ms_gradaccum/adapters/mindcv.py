"""mindcv's trainer with exact gradient accumulation: the one import changed in mindcv's ``train.py``::

    from ms_gradaccum.mindcv import create_scheduler, create_trainer   # instead of mindcv's

mindcv 0.3.0's ``create_trainer(..., gradient_accumulation_steps=K)`` (as mindocr's wrapper and ``mindspore.boost``)
adds each batch's gradient divided by K and steps every K calls, the counter running across epochs: an epoch's last
partial window runs on into the next (the last one of training is never applied), a short batch weighs as a full one,
each batch is clipped before accumulating, and EMA updates once per batch. Here the train step is
:class:`~ms_gradaccum.AccumulatingTrainOneStepCell` through its hooks: windows weighted by their rows, each epoch's last
window closed at its last batch (the epoch length is read from the dataset ``Model.train`` is given), the window's
gradient clipped once, EMA once per optimizer step under mindcv's names (``ema.*``, ``updates``), the loss scale and
overflow skip on every device. The learning-rate schedule then has one entry per optimizer step: build it with
:func:`create_scheduler` (mindcv's arguments and ``gradient_accumulation_steps``). Guide: ``docs/mindcv.md``.
"""
import math
from typing import Optional, Union

try:
    from mindcv.scheduler import create_scheduler as _mindcv_create_scheduler
    from mindcv.utils import create_trainer as _mindcv_create_trainer
    from mindcv.utils.amp import auto_mixed_precision
    from mindcv.utils.trainer_factory import add_loss_network
except ImportError as error:   # pragma: no cover - the message is what matters
    raise ImportError(
        f"ms_gradaccum.mindcv adapts mindcv's trainer, but mindcv cannot be imported ({error}). Install it: pip "
        f"install mindcv==0.3.0 (ms_gradaccum's CI installs it with --no-deps, see .ci/run), or use ms_gradaccum's "
        f"cells with mindspore.train.Model instead.") from error

import mindspore as ms
from mindspore import nn, ops, Parameter, ParameterTuple, Tensor
from mindspore.train import DynamicLossScaleManager, FixedLossScaleManager, Model

from ms_gradaccum.cells.accumulating import AccumulatingTrainOneStepCell, StepOptions
from ms_gradaccum.cells.scheduler import warn_per_batch_schedule
from ms_gradaccum.core.validation import argument_error, check_bool, check_positive_float, check_positive_int

__all__ = ["TrainStep", "create_scheduler", "create_trainer"]

_NAME = "create_trainer"
_ema = ops.MultitypeFuncGraph("_ema")


@_ema.register("Tensor", "Tensor", "Tensor")
def _ema_update(factor, ema_weight, weight):
    return ops.assign(ema_weight, ema_weight * factor + weight * (1 - factor))


class TrainStep(AccumulatingTrainOneStepCell):
    """mindcv's ``TrainStep`` on the package's accumulation: returns the batch's loss as mindcv's does; EMA (``ema.*``,
    ``updates``, mindcv's decay ``ema_decay * (1 - exp(-updates / 2000))``) once per optimizer step; clipping once on
    the window's gradient (``max_grad_norm=clip_value``)."""

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, accumulate_steps: int, scale_sense,
                 ema: bool, ema_decay: float, clip_grad: bool, clip_value: float, drop_overflow_update: bool,
                 steps_per_epoch: Optional[int] = None, batch_norm: Optional[str] = None):
        # mindcv's resume loads the network and optim_<model>.ckpt only: the window's state goes under the optimizer.
        super().__init__(network, optimizer, accumulate_steps, scale_sense=scale_sense,
                         max_grad_norm=clip_value if clip_grad else None, steps_per_epoch=steps_per_epoch,
                         batch_norm=batch_norm,
                         options=StepOptions(skips_overflow=drop_overflow_update, state_under_optimizer=True))
        self.ema = ema
        self.ema_decay = ema_decay
        self.keep_state("updates", Parameter(Tensor(0.0, ms.float32), name="updates", requires_grad=False))
        if ema:
            self.weights_all = ParameterTuple(list(network.get_parameters()))
            self.ema_weight = self.weights_all.clone("ema", init="same")
        self.steps_per_epoch_given = steps_per_epoch is not None

    def construct(self, *inputs):
        loss, overflow, _ = self.accumulate(*inputs)
        return ops.depend(loss, overflow)

    def after_optimizer_step(self, stepped):
        if self.ema:
            updates = ops.assign_add(self.updates, Tensor(1.0, ms.float32))
            decay = self.ema_decay * (1 - ops.exp(-updates / 2000))
            stepped = ops.depend(stepped, self.hyper_map(ops.partial(_ema, decay), self.ema_weight, self.weights_all))
        return stepped


class AccumulatingModel(Model):
    """mindcv's ``Model`` around :class:`TrainStep`; ``train`` tells the step the epoch's length (the dataset's size),
    so that each epoch's last window closes at its last batch."""

    def train(self, epoch, train_dataset, *args, **kwargs):
        step = self.train_network
        batches = train_dataset.get_dataset_size()
        if step.steps_per_epoch_given and step.window.epoch_length != batches:
            raise ValueError(
                f"For '{_NAME}', steps_per_epoch={step.window.epoch_length} was given, but the dataset given to "
                f"Model.train has {batches} batches per epoch. Leave steps_per_epoch out (the dataset's is read), or "
                f"give the dataset's.")
        step.set_steps_per_epoch(batches)
        warn_per_batch_schedule(_NAME, step.optimizer, [batches] * epoch, [step.accumulate_steps] * epoch,
                                f"ms_gradaccum.mindcv.create_scheduler({batches}, ..., "
                                f"gradient_accumulation_steps={step.accumulate_steps})")
        return super().train(epoch, train_dataset, *args, **kwargs)


def _loss_scale(loss_scale_type: str, loss_scale: float, drop_overflow_update: bool):
    """The train step's ``scale_sense`` as mindcv derives it (a fixed Tensor, or the manager's update cell)."""
    if loss_scale_type.lower() == "fixed":
        manager = FixedLossScaleManager(loss_scale=loss_scale, drop_overflow_update=drop_overflow_update)
    elif loss_scale_type.lower() == "dynamic":
        manager = DynamicLossScaleManager(init_loss_scale=loss_scale, scale_factor=2, scale_window=2000)
    else:
        raise ValueError(argument_error(_NAME, "loss_scale_type", "'fixed' or 'dynamic' (with accumulation)",
                                        loss_scale_type))
    update_cell = manager.get_update_cell()
    return Tensor(loss_scale, ms.float32) if update_cell is None else update_cell


def create_trainer(network: nn.Cell, loss: nn.Cell, optimizer: nn.Optimizer, metrics: Union[dict, set],
                   amp_level: str, amp_cast_list: str, loss_scale_type: str, loss_scale: float = 1.0,
                   drop_overflow_update: bool = False, ema: bool = False, ema_decay: float = 0.9999,
                   clip_grad: bool = False, clip_value: float = 15.0, gradient_accumulation_steps: int = 1, *,
                   steps_per_epoch: Optional[int] = None, batch_norm: Optional[str] = None) -> Model:
    r"""
    mindcv's ``create_trainer`` (same arguments, a ``Model`` with mindcv's eval network and ``eval_indexes``) whose
    ``gradient_accumulation_steps`` trains exactly the full batch of each window's rows.

    With ``gradient_accumulation_steps=1`` it returns mindcv's own ``Model``, unchanged. Otherwise the train step is
    :class:`TrainStep`. Differences from mindcv, each measured in ``docs/mindcv.md``: a window's gradient is the mean
    over its rows (mindcv: each batch's mean / K); each epoch's last window closes at the epoch's last batch, the epoch
    length read from the dataset ``Model.train`` is given (or `steps_per_epoch`); the window's gradient is clipped once
    (mindcv clips every batch before adding it); EMA updates once per optimizer step (mindcv: per batch); an
    overflowing window is skipped on CPU too (mindcv refuses a dropping loss scale on CPU).

    Args:
        network, loss, optimizer, metrics, amp_level, amp_cast_list, loss_scale_type, loss_scale,
            drop_overflow_update, ema, ema_decay, clip_grad, clip_value, gradient_accumulation_steps: As mindcv's.
            The optimizer's learning-rate list must have one entry per optimizer step: :func:`create_scheduler`.
        steps_per_epoch (int, optional): Batches per epoch (keyword only). Default: ``None``: read from the dataset
            ``Model.train`` is given.
        batch_norm (str, optional): What the network's BatchNorm cells do under accumulation (keyword only):
            ``'per_step'``, ``'frozen'`` or ``'micro'``, as for :class:`~ms_gradaccum.GradAccumulationCell`. Default:
            ``None`` (``'per_step'``, warned about where the network has BatchNorm).

    Returns:
        mindspore.Model.

    Raises:
        ValueError: As mindcv's (a loss scale below 1, a dynamic scale that does not drop overflows,
            `gradient_accumulation_steps` < 1), or `steps_per_epoch` against the dataset's at ``train``.

    Supported Platforms:
        ``CPU``: with mindcv 0.3.0 in CI. Not run on Ascend or GPU.
    """
    gradient_accumulation_steps = check_positive_int(gradient_accumulation_steps, "gradient_accumulation_steps",
                                                     _NAME)
    if gradient_accumulation_steps == 1:
        return _mindcv_create_trainer(network, loss, optimizer, metrics, amp_level, amp_cast_list, loss_scale_type,
                                      loss_scale, drop_overflow_update, ema, ema_decay, clip_grad, clip_value, 1)
    loss_scale = check_positive_float(loss_scale, "loss_scale", _NAME)
    if loss_scale < 1.0:
        raise ValueError(argument_error(_NAME, "loss_scale", "a float >= 1.0 (as mindcv)", loss_scale))
    drop_overflow_update = check_bool(drop_overflow_update, "drop_overflow_update", _NAME)
    if not drop_overflow_update and str(loss_scale_type).lower() == "dynamic":
        raise ValueError(f"For '{_NAME}', a dynamic loss scale always drops overflowing steps (as mindcv): pass "
                         f"drop_overflow_update=True with loss_scale_type='dynamic'.")
    if steps_per_epoch is not None:
        steps_per_epoch = check_positive_int(steps_per_epoch, "steps_per_epoch", _NAME)
    scale_sense = _loss_scale(str(loss_scale_type), loss_scale, drop_overflow_update)
    eval_network = nn.WithEvalCell(network, loss, amp_level in ["O2", "O3", "auto"])
    auto_mixed_precision(network, amp_level, amp_cast_list)
    net_with_loss = add_loss_network(network, loss, amp_level)
    step = TrainStep(net_with_loss, optimizer, gradient_accumulation_steps, scale_sense, check_bool(ema, "ema", _NAME),
                     ema_decay, check_bool(clip_grad, "clip_grad", _NAME), clip_value, drop_overflow_update,
                     steps_per_epoch, batch_norm).set_train()
    return AccumulatingModel(step, eval_network=eval_network, metrics=metrics, eval_indexes=[0, 1, 2])


def create_scheduler(steps_per_epoch: int, *args, gradient_accumulation_steps: int = 1, **kwargs) -> list:
    """mindcv's ``create_scheduler`` for a run that steps the optimizer once every `gradient_accumulation_steps`
    batches: the full-batch run's schedule, one entry per optimizer step (``ceil(steps_per_epoch / K)`` per epoch, the
    epoch's last window included), so that warm-up, decay epochs and the end value land at the same epochs as in the
    run without accumulation. The other arguments are mindcv's."""
    steps_per_epoch = check_positive_int(steps_per_epoch, "steps_per_epoch", "create_scheduler")
    steps = check_positive_int(gradient_accumulation_steps, "gradient_accumulation_steps", "create_scheduler")
    return _mindcv_create_scheduler(math.ceil(steps_per_epoch / steps), *args, **kwargs)
