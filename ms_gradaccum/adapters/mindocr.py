"""mindocr's train step (``mindocr.utils.train_step_wrapper.TrainOneStepWrapper``) with exact gradient accumulation.

The one import changed in a mindocr training script (``tools/train.py``)::

    # from mindocr.utils.train_step_wrapper import TrainOneStepWrapper
    from ms_gradaccum.mindocr import TrainOneStepWrapper

mindocr's wrapper is the ancestor of mindone's and shares its constructor and outputs ``(loss, overflow, loss scale)``;
so does this one (``ms_gradaccum.adapters.zoo_step``). It imports nothing of mindocr: mindocr 0.5.0 cannot be imported
on MindSpore 2.10 (its package imports ``mindspore.parallel._transformer``, which 2.10 removed), and the wrapper needs
none of it. Its EMA (``mindocr.utils.ema.EMA``) is taken as anything with ``ema_update()``. Without mindocr installed,
importing this module raises ImportError naming the install. Guide: ``docs/mindcv.md`` ("mindocr").
"""
import importlib.util

from ms_gradaccum.adapters.zoo_step import ZooTrainOneStepWrapper

if importlib.util.find_spec("mindocr") is None:   # found without running mindocr's package (see above)
    raise ImportError(
        "ms_gradaccum.mindocr adapts mindocr's train step, but mindocr is not installed. Install it: pip install "
        "mindocr==0.5.0 (ms_gradaccum's CI installs it with --no-deps, see .ci/run), or use ms_gradaccum's cells "
        "directly.")

__all__ = ["TrainOneStepWrapper"]


class TrainOneStepWrapper(ZooTrainOneStepWrapper):
    r"""
    mindocr's ``TrainOneStepWrapper`` (same constructor, same outputs ``(loss, overflow, loss scale)``) whose
    accumulation is exact: the optimizer steps once every `gradient_accumulation_steps` calls with the update the full
    batch of those rows would have given (an :class:`~ms_gradaccum.AccumulatingTrainOneStepCell`).

    Unlike mindocr 0.5.0's own wrapper, a window's gradient is the mean over its rows (mindocr adds each batch's mean
    divided by K, whatever its rows), an epoch's last partial window is applied (with `steps_per_epoch` or
    :class:`~ms_gradaccum.GradAccumulationScheduler`; mindocr's runs on into the next epoch), overflow is checked on
    every device (mindocr reports none on CPU), and ``ema.ema_update()`` runs once per optimizer step (mindocr: every
    call). Clipping is once per window, as mindocr's. The window's state is registered under the optimizer, so a resume
    that loads the network and the optimizer restores a run saved mid-window.

    Args:
        network, optimizer, scale_sense, ema, updates, drop_overflow_update, gradient_accumulation_steps, clip_grad,
            clip_norm, verbose: As mindocr's (`scale_sense`: a number, a scalar Tensor,
            ``nn.DynamicLossScaleUpdateCell`` or ``nn.FixedLossScaleUpdateCell``; `ema`: mindocr's ``EMA`` or anything
            with ``ema_update()``; `updates`: only 0, as mindocr ignores it; `verbose`: only False, as mindocr stores it
            and prints nothing with it).
        micro_size, per_token_loss, shared_inputs, steps_per_epoch, check_loss, batch_norm: As for
            :class:`~ms_gradaccum.AccumulatingTrainOneStepCell` (keyword only).

    Outputs:
        Tuple ``(loss, overflow, loss scale)``: the batch's loss, whether the window closed by this call overflowed
        (its step skipped when `drop_overflow_update`), and the scale.

    Raises:
        TypeError: If an argument has the wrong type (`ema` without ``ema_update()``, `clip_grad` not a bool, ...).
        ValueError: If `gradient_accumulation_steps` < 1, `clip_norm` <= 0, `updates` != 0 or `verbose` is True.

    Supported Platforms:
        ``CPU``: against mindocr 0.5.0's own wrapper in CI, around networks that run on CPU. Not run on Ascend or GPU.
    """

    zoo = "mindocr"
    ema_type_name = "mindocr.utils.ema.EMA (anything with ema_update())"
