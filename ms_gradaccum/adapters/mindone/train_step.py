"""mindone's diffusion train step (``mindone.trainers.train_step.TrainOneStepWrapper``) on this package's
accumulation."""
from typing import Optional

from mindone.trainers.ema import EMA
from mindspore import nn

from ms_gradaccum.adapters.zoo_step import ZooTrainOneStepWrapper

_NAME = "TrainOneStepWrapper"


class TrainOneStepWrapper(ZooTrainOneStepWrapper):
    r"""
    mindone's ``TrainOneStepWrapper`` (same constructor, same outputs ``(loss, overflow, loss scale)``) whose
    accumulation is exact: the optimizer steps once every `gradient_accumulation_steps` calls with the update the full
    batch of those rows would have given (an :class:`~ms_gradaccum.AccumulatingTrainOneStepCell`).

    Unlike mindone 0.5.0's own wrapper, a window's gradient is the mean over its rows (mindone adds each batch's mean
    divided by K, whatever its rows), an epoch's last partial window is applied (with `steps_per_epoch` or
    :class:`~ms_gradaccum.GradAccumulationScheduler`), overflow is checked on every device (mindone reports none on
    CPU), and ``ema.ema_update()`` runs once per optimizer step (mindone: every call). The learning rate advances once
    per optimizer step, as mindone's does on MindSpore >= 2.2 (its per-call ``get_lr()`` no longer moves it). The
    window's state is registered under the optimizer too, so mindone's ``resume_train_network`` restores a run saved
    mid-window by ``EvalSaveCallback``. Details: ``docs/mindone.md``.

    Args:
        network, optimizer, scale_sense, ema, drop_overflow_update, gradient_accumulation_steps, clip_grad, clip_norm:
            As mindone's (`scale_sense`: a number, a scalar Tensor, ``nn.DynamicLossScaleUpdateCell`` or
            ``nn.FixedLossScaleUpdateCell``; `clip_grad`: clip the window's gradient to the global norm `clip_norm`).
        verbose (bool): Only ``False``: mindone's wrapper stores it and prints nothing with it.
        updates (int): Accepted as mindone's, which ignores it; only 0: give the count to ``EMA(updates=...)``.
        zero_helper: Only ``None`` (ZeRO is refused: it shards the gradients the window sums).
        micro_size, per_token_loss, shared_inputs, steps_per_epoch, check_loss, batch_norm: As for
            :class:`~ms_gradaccum.AccumulatingTrainOneStepCell` (keyword only).

    Outputs:
        Tuple ``(loss, overflow, loss scale)``: the batch's loss, whether the window closed by this call overflowed
        (its step skipped when `drop_overflow_update`), and the scale.

    Raises:
        TypeError: If an argument has the wrong type (`ema` not mindone's ``EMA``, `clip_grad` not a bool, ...).
        ValueError: If `gradient_accumulation_steps` < 1, `clip_norm` <= 0, `updates` != 0, `verbose` is True, or
            `zero_helper` is given.

    Supported Platforms:
        ``CPU``: with mindone 0.5.0 in CI, around networks that run on CPU. Not run on Ascend or GPU.
    """

    zoo = "mindone"
    ema_types = (EMA,)
    ema_type_name = "mindone.trainers.ema.EMA"

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, scale_sense=1.0, ema: Optional[EMA] = None,
                 updates: int = 0, drop_overflow_update: bool = True, gradient_accumulation_steps: int = 1,
                 clip_grad: bool = False, clip_norm: float = 1.0, verbose: bool = False, zero_helper=None, *,
                 micro_size: Optional[int] = None, per_token_loss: Optional[bool] = None, shared_inputs=None,
                 steps_per_epoch: Optional[int] = None, check_loss: Optional[bool] = None,
                 batch_norm: Optional[str] = None):
        if zero_helper is not None:
            raise ValueError(
                f"For '{_NAME}', the argument 'zero_helper' must be None, but got {type(zero_helper).__name__}: ZeRO "
                f"shards the gradients and the optimizer state across devices, and this wrapper sums whole gradients "
                f"over the window. Train without ZeRO (zero_stage=0), or with mindone's own wrapper.")
        super().__init__(network, optimizer, scale_sense, ema, updates, drop_overflow_update,
                         gradient_accumulation_steps, clip_grad, clip_norm, verbose, micro_size=micro_size,
                         per_token_loss=per_token_loss, shared_inputs=shared_inputs, steps_per_epoch=steps_per_epoch,
                         check_loss=check_loss, batch_norm=batch_norm)
