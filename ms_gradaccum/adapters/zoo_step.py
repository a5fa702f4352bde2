"""The train step mindone's diffusion trainers and mindocr share (mindocr's is mindone's ancestor): the constructor
``(network, optimizer, scale_sense, ema, updates, drop_overflow_update, gradient_accumulation_steps, clip_grad,
clip_norm, verbose)`` and the outputs ``(loss, overflow, loss scale)``, on this package's accumulation. Each zoo's
module (``ms_gradaccum.mindone``, ``ms_gradaccum.mindocr``) subclasses it with its name and its EMA's type."""
from typing import Optional

from mindspore import nn, ops

from ms_gradaccum.cells.accumulating import AccumulatingTrainOneStepCell, StepOptions
from ms_gradaccum.core.kinds import LossSpec
from ms_gradaccum.core.validation import argument_error, check_bool, check_int, check_positive_float, check_positive_int


class ZooTrainOneStepWrapper(AccumulatingTrainOneStepCell):
    """The shared step (see the module docstring); subclasses set :attr:`zoo` (whose wrapper it stands for),
    :attr:`ema_types` and :attr:`ema_type_name` (what `ema` may be; no types: anything with ``ema_update()``)."""

    zoo = "the zoo"
    zoo_name = "TrainOneStepWrapper"
    ema_types: tuple = ()
    ema_type_name = "an EMA with ema_update()"

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, scale_sense=1.0, ema=None, updates: int = 0,
                 drop_overflow_update: bool = True, gradient_accumulation_steps: int = 1, clip_grad: bool = False,
                 clip_norm: float = 1.0, verbose: bool = False, *, micro_size: Optional[int] = None,
                 per_token_loss: Optional[bool] = None, shared_inputs=None, steps_per_epoch: Optional[int] = None,
                 check_loss: Optional[bool] = None, batch_norm: Optional[str] = None):
        name = self.zoo_name
        if ema is not None and not (isinstance(ema, self.ema_types) if self.ema_types else
                                    callable(getattr(ema, "ema_update", None))):
            raise TypeError(argument_error(name, "ema", f"None or {self.ema_type_name}", ema))
        if check_int(updates, 0, "the argument 'updates'", "0", name) != 0:
            raise ValueError(
                f"For '{name}', the argument 'updates' must be 0, but got {updates}: {self.zoo}'s own wrapper ignores "
                f"it (the EMA counts its own updates). Give the count to the EMA: EMA(network, updates={updates}).")
        drop_overflow_update = check_bool(drop_overflow_update, "drop_overflow_update", name)
        gradient_accumulation_steps = check_positive_int(gradient_accumulation_steps, "gradient_accumulation_steps",
                                                         name)
        clip_grad = check_bool(clip_grad, "clip_grad", name)
        clip_norm = check_positive_float(clip_norm, "clip_norm", name)
        if check_bool(verbose, "verbose", name):
            raise ValueError(
                f"For '{name}', the argument 'verbose' must be False, but got True: {self.zoo}'s own wrapper stores it "
                f"and prints nothing with it, and so would this one. Remove verbose=True (overflow is returned as the "
                f"step's second output; LossMonitor or a callback of one's own prints it).")
        # This package's arguments, checked under this class's name (the core checks them again under its own).
        LossSpec.of(name, micro_size=micro_size, per_token_loss=per_token_loss, shared_inputs=shared_inputs,
                    check_loss=check_loss)
        if steps_per_epoch is not None:
            check_positive_int(steps_per_epoch, "steps_per_epoch", name)
        super().__init__(network, optimizer, gradient_accumulation_steps, micro_size=micro_size,
                         per_token_loss=per_token_loss, shared_inputs=shared_inputs, steps_per_epoch=steps_per_epoch,
                         scale_sense=scale_sense, max_grad_norm=clip_norm if clip_grad else None,
                         check_loss=check_loss, batch_norm=batch_norm,
                         # the zoos' resume loads the network and the optimizer only
                         options=StepOptions(skips_overflow=drop_overflow_update, state_under_optimizer=True))
        self.ema = ema
        self.clip_norm, self.verbose = clip_norm, False

    @property
    def drop_overflow_update(self) -> bool:
        """The zoos' name for whether an overflowing window's step is skipped."""
        return self.skips_overflow

    @property
    def clip_grad(self) -> bool:
        """The zoos' name for whether the window's gradient is clipped (to `clip_norm`)."""
        return self.clip

    def after_optimizer_step(self, stepped):
        """The EMA, once per optimizer step, on the updated weights."""
        if self.ema is not None:
            stepped = ops.depend(stepped, self.ema.ema_update())
        return stepped
