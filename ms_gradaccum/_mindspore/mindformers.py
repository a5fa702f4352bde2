"""The one change the MindFormers adapter (ms_gradaccum.adapters.mindformers, which alone imports this module) makes to
MindFormers: its trainer's ``BaseTrainer._check_grad_accumulation_steps``, a private method run before the wrapper is
built, runs the adapter's check first (it resets ``gradient_accumulation_steps`` to 1 outside semi-auto/auto parallel,
and elsewhere replaces the wrapper type). Registered with ``remove_patches()``. Checked against MindFormers 2.1.0."""
from typing import Callable

from mindformers.trainer.base_trainer import BaseTrainer

from ms_gradaccum._mindspore.patches import Patch


class TrainerCheck(Patch):
    """``check(trainer.config)`` run first in ``BaseTrainer._check_grad_accumulation_steps``, before MindFormers resets
    or replaces anything; ``uninstall()`` puts MindFormers' method back."""

    def __init__(self, check: Callable):
        self._check = check
        self._original = None

    @property
    def installed(self) -> bool:
        return self._original is not None

    def install(self) -> bool:
        if self._original is not None:
            return True
        original, check = BaseTrainer._check_grad_accumulation_steps, self._check

        def _check_grad_accumulation_steps(trainer):
            check(trainer.config)
            return original(trainer)

        self._original = original
        BaseTrainer._check_grad_accumulation_steps = _check_grad_accumulation_steps
        return True

    def uninstall(self) -> None:
        if self._original is not None:
            BaseTrainer._check_grad_accumulation_steps = self._original
            self._original = None
