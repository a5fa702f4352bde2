"""Gradient accumulation inside MindFormers' ``Trainer``, stand-alone and data parallel.

Importing this module registers :class:`GradAccumulationWrapper` in MindFormers' wrapper registry, so that its
``Trainer`` builds it as the train cell::

    import ms_gradaccum.mindformers  # noqa: F401  (registers GradAccumulationWrapper)
    args = TrainingArguments(..., wrapper_type="GradAccumulationWrapper")

or, in a YAML config::

    runner_wrapper:
      type: GradAccumulationWrapper
      micro_size: 4          # micro-batches per batch (this package's key)
      accumulate_steps: 2    # batches per optimizer step (this package's key)
      scale_sense: {type: DynamicLossScaleUpdateCell, loss_scale_value: 65536, scale_factor: 2, scale_window: 1000}
      use_clip_grad: True
      max_grad_norm: 1.0

MindFormers builds a wrapper as ``cls(**runner_wrapper keys, network=, optimizer=, calculate_per_token_loss=,
global_norm_spike_threshold=, print_separate_loss=, use_skip_data_by_global_norm=, lr_scheduler=,
grouped_lr_scheduler=)`` (``trainer/base_trainer.py::create_model_wrapper``, ``wrapper/build_wrapper.py``,
``tools/register/register.py``; MindFormers 2.1.0). The package itself never imports MindFormers; only this module
does, and ``_mindspore.mindformers``, which it alone imports. What it relies on in MindFormers, checked against 2.1.0:

- the registry (``MindFormerRegister.register_cls``) and the keywords above;
- ``BaseTrainer._check_grad_accumulation_steps``, run before the wrapper is built, which resets
  ``gradient_accumulation_steps`` to 1 outside semi-auto/auto parallel (and elsewhere replaces the wrapper type): this
  module runs its own check first (:func:`check_trainer_config`, through ``_mindspore.mindformers``, which
  ``remove_patches()`` undoes);
- ``CheckpointMonitor`` leaves out every parameter whose name contains ``accu_grads``, and a resumed run loads the
  checkpoint into the model and the optimizer only (``trainer/utils.py::load_ckpt``): the wrapper names its buffers
  ``grad_accumulation.<weight>`` and also registers its window state under the optimizer;
- the outputs MindFormers' monitors read: ``(loss, overflow, loss scale, learning rate, global norm)``
  (``core/callback/callback.py::_get_loss_output``);
- ``ClipGradNorm`` (``core/clip_grad.py``) and ``AdaptiveLossScaleUpdateCell`` (``wrapper/adaptive_loss_scale.py``);
- ``is_legacy_model()`` (``core/context/build_context.py``): MindFormers' mcore models (``use_legacy: False``) return
  four losses, which ``MFTrainOneStepCell`` adds (and prints with ``print_separate_loss``); the wrapper refuses them.
"""
import inspect
import numbers
from typing import Any, Optional

try:
    from mindformers.core.clip_grad import ClipGradNorm
    from mindformers.core.context.build_context import is_legacy_model
    from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
    from mindformers.wrapper.adaptive_loss_scale import AdaptiveLossScaleUpdateCell
except ImportError as error:   # pragma: no cover - the message is what matters
    raise ImportError(
        "ms_gradaccum.mindformers adapts MindFormers' Trainer, but MindFormers cannot be imported "
        f"({error}). Install it: pip install mindformers==2.1.0 (ms_gradaccum's CI installs it with --no-deps, see "
        ".ci/run), or use ms_gradaccum's cells with mindspore.train.Model instead.") from error

from mindspore import nn, ops, Parameter, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum._mindspore.graph import compile_time
from ms_gradaccum._mindspore.mindformers import TrainerCheck
from ms_gradaccum._mindspore.patches import register
from ms_gradaccum._mindspore.surroundings import parallel_mode, parallel_pass_in_force
from ms_gradaccum.cells.accumulating import SCALE_MANAGERS, AccumulatingTrainOneStepCell, StepOptions
from ms_gradaccum.core.kinds import LossSpec
from ms_gradaccum.core.validation import argument_error, check_bool, check_positive_float, check_positive_int
from ms_gradaccum.core.window import STATE_PREFIX

__all__ = ["GradAccumulationWrapper", "check_trainer_config"]

_NAME = "GradAccumulationWrapper"
# Names MindFormers' CheckpointMonitor keeps (it drops any containing 'accu_grads', '_cache', ...).
BUFFER_PREFIX = "grad_accumulation"
# MindFormers' resume loads the model and the optimizer only: the window's state goes under the optimizer too.
_OPTIONS = StepOptions(buffer_prefix=BUFFER_PREFIX, scale_update_cells=SCALE_MANAGERS + (AdaptiveLossScaleUpdateCell,),
                       state_under_optimizer=True)
# The keys MindFormers passes to every wrapper, and this package's own.
MINDFORMERS_KEYS = ("use_clip_grad", "max_grad_norm", "scale_sense", "local_norm", "calculate_per_token_loss",
                    "global_norm_spike_threshold", "use_skip_data_by_global_norm", "print_separate_loss",
                    "lr_scheduler", "grouped_lr_scheduler")
PACKAGE_KEYS = ("micro_size", "accumulate_steps", "per_token_loss", "shared_inputs", "steps_per_epoch", "check_loss",
                "batch_norm")


class GradAccumulationWrapper(AccumulatingTrainOneStepCell):
    r"""
    The train cell of MindFormers' ``Trainer`` with gradient accumulation, stand-alone and data parallel: an
    :class:`~ms_gradaccum.AccumulatingTrainOneStepCell` that takes MindFormers' ``runner_wrapper`` keys and returns
    what MindFormers' monitors read.

    Each dataset step's batch is split into `micro_size` micro-batches, and the optimizer steps once every
    `accumulate_steps` dataset steps, with the update the full batch of those rows would have given (see
    :class:`~ms_gradaccum.AccumulatingTrainOneStepCell`). MindFormers' ``gradient_accumulation_steps`` works only
    under semi-auto/auto parallel and is refused beside this wrapper (it would be reset to 1, or the wrapper replaced).

    MindFormers' keys, as ``MFTrainOneStepCell`` reads them: `scale_sense` (a number, MindSpore's update cells or
    MindFormers' ``AdaptiveLossScaleUpdateCell``; an overflowing window is skipped), `use_clip_grad`/`max_grad_norm`
    (``ClipGradNorm`` once per optimizer step), `use_skip_data_by_global_norm`/`global_norm_spike_threshold`,
    `calculate_per_token_loss` (the model returns ``(loss_sum, count)``); `local_norm` and `grouped_lr_scheduler` are
    refused when set. `lr_scheduler` and `print_separate_loss`, which the ``Trainer`` always passes, change nothing,
    as in ``MFTrainOneStepCell`` for the models the wrapper takes: it reads `lr_scheduler` only beside
    `grouped_lr_scheduler` (the learning rate reported is the optimizer's), and `print_separate_loss` only for mcore
    models (``use_legacy: False``, whose four losses the wrapper refuses). Details: ``docs/design.md``.

    Args:
        network (Cell): The model, returning its loss (or ``(loss_sum, count)``).
        optimizer (nn.Optimizer): The optimizer MindFormers built (or the one given to the ``Trainer``).
        micro_size (int): Micro-batches per dataset step. Default: ``1``.
        accumulate_steps (int): Dataset steps per optimizer step. Default: ``1``.
        per_token_loss (bool, optional): Declares the loss kind when `calculate_per_token_loss` is False (see above).
            Default: ``None``.
        shared_inputs (Union[int, tuple[int]], optional): Inputs every micro-batch receives whole (see
            :class:`~ms_gradaccum.GradAccumulationCell`). Default: ``None``.
        steps_per_epoch (int, optional): Closes each epoch's last window at its last batch. Default: ``None``.
        batch_norm (str, optional): What BatchNorm cells do under accumulation (see
            :class:`~ms_gradaccum.GradAccumulationCell`). Default: ``None``.
        \*\*mindformers_keys: MindFormers' keys above; any other key is an error naming it.

    Outputs:
        Tuple ``(loss, overflow, loss scale, learning rate, global norm)``: the dataset step's loss (its mean over the
        batch, or its token mean), whether the window closed by this step overflowed, the scale, the optimizer's
        learning rate, and the global norm of the last window stepped (``None`` unless clipping or the skip is on).

    Raises:
        TypeError: If a key has the wrong type, or a key is unknown.
        ValueError: If `micro_size` or `accumulate_steps` < 1, `max_grad_norm` or the threshold is not positive,
            `local_norm` is True or `grouped_lr_scheduler` is given, `per_token_loss` contradicts
            `calculate_per_token_loss`, or MindFormers' context selects mcore models (``use_legacy: False``).

    Supported Platforms:
        ``CPU``: MindFormers 2.1.0's ``Trainer`` in CI, stand-alone and data parallel. Not run on Ascend or GPU.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, micro_size: int = 1, accumulate_steps: int = 1,
                 per_token_loss: Optional[bool] = None, shared_inputs=None, steps_per_epoch: Optional[int] = None,
                 check_loss: bool = True, batch_norm: Optional[str] = None, **mindformers_keys):
        keys = _mindformers_keys(mindformers_keys)
        if not is_legacy_model():
            raise ValueError(
                f"For '{_NAME}', MindFormers' context has use_legacy: False, but the wrapper takes legacy models only "
                f"(one loss, or (loss_sum, count)): mcore models return (lm_loss, mtp_loss, aux_loss, indexer_loss), "
                f"which MFTrainOneStepCell adds. Set use_legacy: True, or train with MindFormers' own wrapper.")
        _package_keys(dict(micro_size=micro_size, accumulate_steps=accumulate_steps, per_token_loss=per_token_loss,
                           check_loss=check_loss))
        per_token_loss = _loss_kind(per_token_loss, keys["calculate_per_token_loss"])
        super().__init__(network, optimizer, accumulate_steps, micro_size=micro_size, per_token_loss=per_token_loss,
                         shared_inputs=shared_inputs, steps_per_epoch=steps_per_epoch,
                         scale_sense=keys["scale_sense"], check_loss=check_loss, batch_norm=batch_norm,
                         options=_OPTIONS)
        self.use_clip_grad = keys["use_clip_grad"]
        self.skip_by_global_norm = keys["use_skip_data_by_global_norm"]
        self.measure_norm = self.use_clip_grad or self.skip_by_global_norm
        self.global_norm_spike_threshold = keys["global_norm_spike_threshold"]
        self.clip_grad_norm = ClipGradNorm(max_norm=keys["max_grad_norm"])
        self.keep_state("global_norm", Parameter(Tensor([0.0], mstype.float32),
                                                 name=f"{STATE_PREFIX}.global_norm", requires_grad=False))

    @classmethod
    def with_keys(cls, **keys) -> type:
        """This wrapper with `keys` as its ``runner_wrapper`` keys, for ``TrainingArguments(wrapper_type=...)``, which
        sets only the type: ``TrainingArguments(wrapper_type=GradAccumulationWrapper.with_keys(micro_size=4))``. The
        keys are checked now; keys in the config still apply over them.

        Raises:
            TypeError: If a key is unknown or has the wrong type.
            ValueError: If a value is out of range or refused (see the class).
        """
        _package_keys(keys)
        checked = _mindformers_keys({key: value for key, value in keys.items() if key not in PACKAGE_KEYS})
        _loss_kind(keys.get("per_token_loss"), checked["calculate_per_token_loss"])
        preset = dict(keys)

        def __init__(self, network, optimizer, **given):
            cls.__init__(self, network, optimizer, **{**preset, **given})

        return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__,
                                           "__doc__": f"{cls.__name__} with the keys {preset}."})

    def construct(self, *inputs):
        learning_rate = learning_rate_now(self.optimizer)
        loss, overflow, scale = self.accumulate(*inputs)
        if self.measure_norm:
            return loss, overflow, scale, learning_rate, ops.depend(self.global_norm * 1.0, overflow)
        return loss, overflow, scale, learning_rate, None

    def transform_gradients(self, grads):
        """MindFormers' ClipGradNorm and spike skip on the window's gradient: the norm is kept (the fifth output),
        the gradient clipped with `use_clip_grad`, the step skipped with `use_skip_data_by_global_norm` when the norm
        reaches `global_norm_spike_threshold`."""
        clipped, norm = self.clip_grad_norm(grads)
        done = ops.assign(self.global_norm, ops.reshape(norm, (1,)))
        grads = clipped if self.use_clip_grad else grads
        # The norm is kept whether the step runs or not: the step decision, or the gradient, waits for the write.
        if self.skip_by_global_norm:
            return grads, ops.depend(norm.reshape(()) < self.global_norm_spike_threshold, done)
        return (ops.depend(grads[0], done),) + tuple(grads[1:]), True

    @compile_time
    def changes_gradients(self) -> bool:
        return self.measure_norm


def learning_rate_now(optimizer: nn.Optimizer):
    """The optimizer's learning rate at its current step, as MFTrainOneStepCell reports it (read before the step)."""
    learning_rate = optimizer.learning_rate
    if optimizer.dynamic_lr:
        if optimizer.is_group_lr:
            return learning_rate[-1](optimizer.global_step).reshape(())
        return learning_rate(optimizer.global_step).reshape(())
    return learning_rate * 1.0


def _package_keys(given: dict) -> None:
    """This package's keys among `given`, checked like the cells' own arguments (the loss keys into a LossSpec)."""
    for key in ("accumulate_steps", "steps_per_epoch"):
        if given.get(key) is not None:
            check_positive_int(given[key], key, _NAME)
    LossSpec.of(_NAME, **{key: given.get(key) for key in ("micro_size", "per_token_loss", "shared_inputs",
                                                          "check_loss")})


def _loss_kind(per_token_loss: Optional[bool], calculate_per_token_loss: bool) -> Optional[bool]:
    """The core's per_token_loss: True with MindFormers' calculate_per_token_loss (the model returns (loss_sum, count));
    otherwise what runner_wrapper declares, or None (undeclared: a token-mean loss is warned about)."""
    if calculate_per_token_loss:
        if per_token_loss is False:
            raise ValueError(
                f"For '{_NAME}', the argument 'per_token_loss' is False but MindFormers' calculate_per_token_loss is "
                f"True (the model returns (loss_sum, count)). Remove per_token_loss from runner_wrapper.")
        return True
    return per_token_loss


def _mindformers_keys(given: dict) -> dict:
    """MindFormers' keys, checked and with MFTrainOneStepCell's defaults; any other key is an error naming it."""
    unknown = sorted(set(given) - set(MINDFORMERS_KEYS))
    if unknown:
        raise TypeError(
            f"For '{_NAME}', the runner_wrapper key(s) {', '.join(repr(key) for key in unknown)} are not known. It "
            f"takes this package's keys ({', '.join(PACKAGE_KEYS)}) and MindFormers' ({', '.join(MINDFORMERS_KEYS)}).")
    keys = dict(use_clip_grad=False, max_grad_norm=1.0, scale_sense=1.0, local_norm=False,
                calculate_per_token_loss=False, global_norm_spike_threshold=1.0, use_skip_data_by_global_norm=False,
                print_separate_loss=False, lr_scheduler=None, grouped_lr_scheduler=None)
    keys.update(given)
    # MindFormers passes None where its config leaves a switch unset.
    for key in ("use_clip_grad", "local_norm", "calculate_per_token_loss", "use_skip_data_by_global_norm",
                "print_separate_loss"):
        keys[key] = False if keys[key] is None else check_bool(keys[key], key, _NAME)
    keys["max_grad_norm"] = check_positive_float(keys["max_grad_norm"], "max_grad_norm", _NAME)
    keys["global_norm_spike_threshold"] = check_positive_float(keys["global_norm_spike_threshold"],
                                                               "global_norm_spike_threshold", _NAME)
    if keys["local_norm"]:
        raise ValueError(
            f"For '{_NAME}', local_norm=True is not supported: it reports every step's per-rank gradient norms, and "
            f"with accumulation a gradient exists only when a window closes. Remove local_norm from runner_wrapper.")
    if keys["grouped_lr_scheduler"] is not None:
        raise ValueError(
            f"For '{_NAME}', grouped learning-rate schedules (grouped_lr_scheduler) are not supported: MindFormers "
            f"reports them through MFTrainOneStepCell's own parameter registry. Use one learning-rate schedule.")
    if keys["lr_scheduler"] is not None and not isinstance(keys["lr_scheduler"], (nn.Cell, numbers.Real)):
        raise TypeError(argument_error(_NAME, "lr_scheduler", "None, a number or a LearningRateSchedule",
                                       keys["lr_scheduler"]))
    return keys


def _is_this_wrapper(wrapper_type: Any) -> bool:
    if inspect.isclass(wrapper_type):
        return issubclass(wrapper_type, GradAccumulationWrapper)
    return wrapper_type == _NAME


def check_trainer_config(config) -> None:
    """Refuse, before MindFormers resets or replaces anything, a Trainer config that selects this wrapper together
    with MindFormers' own ``gradient_accumulation_steps`` > 1, or under semi-auto/auto parallel."""
    wrapper = getattr(config, "runner_wrapper", None)
    if wrapper is None or not _is_this_wrapper(getattr(wrapper, "type", None)):
        return
    runner = getattr(config, "runner_config", None)
    steps = getattr(runner, "gradient_accumulation_steps", None)
    if steps is not None and not isinstance(steps, bool) and isinstance(steps, int) and steps > 1:
        raise ValueError(
            f"For '{_NAME}', gradient_accumulation_steps must be 1 (or unset) beside it, but got {steps}: MindFormers "
            f"would reset it to 1 outside semi-auto/auto parallel, and replace this wrapper with its own there. "
            f"Accumulate with this wrapper's keys instead: runner_wrapper micro_size={steps} (micro-batches of each "
            f"batch) or accumulate_steps={steps} (dataset steps per optimizer step).")
    if parallel_pass_in_force():
        raise ValueError(
            f"For '{_NAME}', the parallel mode must be stand_alone or data_parallel, but it is {parallel_mode()}: "
            f"there MindFormers' gradient_accumulation_steps (its MFPipelineWithLossScaleCell) accumulates.")


# MindFormers' trainer check runs the package's first (ms_gradaccum._mindspore.mindformers): undone by remove_patches().
TRAINER_CHECK = register("MindFormers trainer check", TrainerCheck(check_trainer_config))
MindFormerRegister.register_cls(GradAccumulationWrapper, module_type=MindFormerModuleType.WRAPPER)
TRAINER_CHECK.install()
