"""mindone's Transformers ``Trainer`` with exact gradient accumulation: the one import changed in a training script::

    from ms_gradaccum.mindone.transformers import Trainer   # instead of: from mindone.transformers import Trainer
    trainer = Trainer(model=model, args=TrainingArguments(..., per_device_train_batch_size=8,
                                                          gradient_accumulation_steps=4), train_dataset=...)

How: mindone 0.5.0's loop counts an optimizer step every `gradient_accumulation_steps` batches across epochs (its
last partial window is never applied; ``len // K`` steps per epoch set ``max_steps`` and the learning-rate schedule)
and its train cell does not compile for K > 1 without ZeRO. This subclass instead draws batches of
``per_device_train_batch_size * gradient_accumulation_steps`` rows and runs each as that many micro-batches of
``per_device_train_batch_size`` rows inside the compiled graph (:class:`~ms_gradaccum.AccumulatingTrainOneStepCell`
with ``micro_size``): one loop step is one optimizer step, so mindone's own counting (``global_step``, ``max_steps``,
the schedule, logging, saving) is right as it stands, and an epoch's last, shorter batch is its last window. While
its loop runs, ``args`` reads ``gradient_accumulation_steps=1`` and the enlarged batch (restored afterwards), which is
what mindone's log lines then print. Guide: ``docs/mindone.md``.
"""
from typing import Optional

from mindone.transformers import Trainer as _MindoneTrainer
from mindone.transformers.mindspore_adapter.clip_grad import clip_grad_norm
from mindone.transformers.mindspore_adapter.train_onestep_wrapper import TrainOneStepWrapper as _AdapterWrapper
from mindspore import nn

from ms_gradaccum.cells.accumulating import AccumulatingTrainOneStepCell
from ms_gradaccum.core.kinds import LossSpec

__all__ = ["Trainer"]

_NAME = "Trainer"
# mindone's Trainer builds its train cell with a static loss scale of 1024, skips overflowing steps, clips to the
# global norm max_grad_norm (transformers/trainer.py, _wrap_model); so does this one.
_LOSS_SCALE = 1024.0


class TrainerStep(AccumulatingTrainOneStepCell):
    """The train cell this Trainer builds: one optimizer step per call on `micro_size` micro-batches, clipped as
    mindone's Trainer clips (``clip_grad_norm``: ``max_norm / (norm + 1e-6)``, at most 1), returning what mindone's
    ``training_step`` reads: ``(loss, None, overflow)``."""

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, micro_size: int, max_grad_norm: float,
                 spec: LossSpec):
        super().__init__(network, optimizer, 1, micro_size=micro_size, kind=spec.kind,
                         shared_inputs=spec.shared_inputs, scale_sense=_LOSS_SCALE, check_loss=spec.check_loss)
        self.max_norm = max_grad_norm

    def construct(self, *inputs):
        loss, overflow, _ = self.accumulate(*inputs)
        return loss, None, overflow

    def transform_gradients(self, grads):
        return clip_grad_norm(grads, self.max_norm), True


class _SumAndCount(nn.Cell):
    """The loss network for ``per_token_loss=True``: the model's first two outputs, ``(loss_sum, token_count)``."""

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, *inputs):
        outputs = self.model(*inputs)
        return outputs[0], outputs[1]


class Trainer(_MindoneTrainer):
    r"""
    ``mindone.transformers.Trainer`` whose ``gradient_accumulation_steps`` trains exactly the full batch of
    ``per_device_train_batch_size * gradient_accumulation_steps`` rows per optimizer step, on the memory of
    ``per_device_train_batch_size`` rows (see the module's docstring for how).

    Args:
        \*args, \*\*kwargs: mindone's ``Trainer`` arguments.
        per_token_loss (bool): Required (keyword only) with ``gradient_accumulation_steps > 1``. True: the model's first
            two outputs are ``(loss_sum, token_count)`` (a loss that is a mean over tokens is exact only so); False:
            its first output is the loss, a mean over rows.
        shared_inputs, check_loss: As for :class:`~ms_gradaccum.GradAccumulationCell` (keyword only).

    Raises:
        ValueError: At ``train()``, if `per_token_loss` is not given with ``gradient_accumulation_steps > 1``, ZeRO-3 is
            on (``use_zero3``: it shards what the micro-batches sum), or `per_token_loss` is combined with label
            smoothing.

    Supported Platforms:
        ``CPU``: with mindone 0.5.0 in CI, around a small ``PreTrainedModel`` of layers that run on CPU (its LLMs do
        not: no ``Arange`` kernel). Not run on Ascend or GPU.
    """

    def __init__(self, *args, per_token_loss: Optional[bool] = None, shared_inputs=None,
                 check_loss: Optional[bool] = None, **kwargs):
        self.accumulation_spec = LossSpec.of(_NAME, micro_size=None, per_token_loss=per_token_loss,
                                             shared_inputs=shared_inputs, check_loss=check_loss)
        self._micro_size = 1
        super().__init__(*args, **kwargs)

    def _inner_training_loop(self, batch_size=None, args=None, *rest, **kwargs):
        args = self.args if args is None else args
        steps = args.gradient_accumulation_steps
        if getattr(self, "use_zero3", False):
            raise ValueError(
                f"For '{_NAME}', ZeRO-3 (use_zero3) is not supported: it shards the parameters and gradients that the "
                f"micro-batches sum. Train without ZeRO-3, or with mindone's own Trainer.")
        if steps > 1 and not self.accumulation_spec.declared:
            raise ValueError(
                f"For '{_NAME}', with gradient_accumulation_steps={steps} the loss kind must be declared: pass "
                f"Trainer(..., per_token_loss=False) if the model's loss is a mean over rows (every row weighs the "
                f"same: classification, sequences without padding or ignored labels), or per_token_loss=True with a "
                f"model whose first two outputs are (loss_sum, token_count). A causal LM's loss is a mean over its "
                f"valid tokens: with padding or -100 labels its micro-batches hold different token counts, and "
                f"weighting them by rows would not be the full batch's update (and a first-step check cannot tell "
                f"while the per-token losses are alike).")
        per_device = args.per_device_train_batch_size
        self._micro_size = steps
        args.gradient_accumulation_steps, args.per_device_train_batch_size = 1, per_device * steps
        try:
            return super()._inner_training_loop(None if batch_size is None else batch_size * steps, args, *rest,
                                                **kwargs)
        finally:
            args.gradient_accumulation_steps, args.per_device_train_batch_size = steps, per_device
            self._train_batch_size = args.train_batch_size
            self._micro_size = 1

    def _wrap_model(self, model, dataloader=None):
        # mindone's own wrapping (mixed precision, label smoothing, the loss as the model's first output), built
        # with gradient_accumulation_steps=1; its loss network is taken and trained by TrainerStep.
        model, built = super()._wrap_model(model, dataloader)
        if not isinstance(built, _AdapterWrapper):
            raise TypeError(f"For '{_NAME}', mindone's _wrap_model built {type(built).__name__}, not its "
                            f"TrainOneStepWrapper: this mindone version is not the one ms_gradaccum adapts (0.5.0).")
        loss_network = built.network.network   # LossWithScaleSense(loss network, scaler)
        if self.accumulation_spec.kind.returns_count:
            if self.label_smoother is not None:
                raise ValueError(
                    f"For '{_NAME}', per_token_loss=True cannot be combined with label smoothing "
                    f"(label_smoothing_factor={self.args.label_smoothing_factor}): mindone's label smoother returns a "
                    f"token mean, not (loss_sum, token_count).")
            loss_network = _SumAndCount(model)
        return model, TrainerStep(loss_network, self.optimizer, self._micro_size, float(self.args.max_grad_norm),
                                  self.accumulation_spec)
