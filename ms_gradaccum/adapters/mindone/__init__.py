"""Gradient accumulation for mindone's trainers: its diffusion train step and its Transformers ``Trainer``.

The one import changed in a mindone training script::

    # from mindone.trainers.train_step import TrainOneStepWrapper
    from ms_gradaccum.mindone import TrainOneStepWrapper
    # from mindone.transformers import Trainer
    from ms_gradaccum.mindone.transformers import Trainer

The package itself never imports mindone; only this subpackage does (without mindone it raises ImportError saying how
to install it). What it relies on in mindone, checked against 0.5.0: ``TrainOneStepWrapper``'s constructor and outputs
``(loss, overflow, loss scale)`` (what ``OverflowMonitor`` and ``EvalSaveCallback`` read), ``EMA.ema_update()``,
``resume_train_network`` (which loads a checkpoint into the network and the optimizer only), and, for the
``Trainer``, its ``_wrap_model``, ``_inner_training_loop`` and ``training_step``. Guide: ``docs/mindone.md``.
"""
try:
    import mindone.trainers.ema  # noqa: F401
    import mindone.trainers.train_step  # noqa: F401
except ImportError as error:   # pragma: no cover - the message is what matters
    raise ImportError(
        "ms_gradaccum.mindone adapts mindone's trainers, but mindone cannot be imported "
        f"({error}). Install it: pip install mindone==0.5.0 (ms_gradaccum's CI installs it with --no-deps, see "
        ".ci/run), or use ms_gradaccum's cells directly.") from error

from ms_gradaccum.adapters.mindone.train_step import TrainOneStepWrapper as TrainOneStepWrapper

__all__ = ["TrainOneStepWrapper"]
