"""Adapters: a zoo's own train step or trainer, rebuilt on this package's accumulation. One module per zoo, imported
only by whoever uses it, under its public path (``ms_gradaccum.mindformers``, ``.mindcv``, ``.mindocr``, ``.mindone``,
``.mindone.transformers``, which re-export these modules); the package imports none of them.

What an adapter is, in one place (as einops' einops/_backends.py states a backend's):

- **One base class**, :class:`ms_gradaccum.AccumulatingTrainOneStepCell`, subclassed once per zoo step (the train step
  mindone's diffusion trainers and mindocr share is :mod:`.zoo_step`'s ``ZooTrainOneStepWrapper``).
- **Its options, passed in**, never set on the class or the instance:
  ``super().__init__(network, optimizer, accumulate_steps, ..., options=StepOptions(...))``
  (``ms_gradaccum.cells.accumulating.StepOptions``): ``buffer_prefix`` (the buffers' names in checkpoints: the zoo's
  checkpoint filters must keep them), ``scale_update_cells`` (the loss-scale update cells its ``scale_sense`` may be),
  ``skips_overflow`` (whether an overflowing window's step is skipped), ``state_under_optimizer`` (whether the window's
  state is registered under the optimizer too, for a resume that loads the model and the optimizer only).
- **Its hooks, overridden and nothing else**: ``transform_gradients(grads) -> (grads, step)`` once per optimizer step
  (clipping, skipping a spike; set ``changes_gradients`` when it may leave them as they are),
  ``after_optimizer_step(stepped)`` (an EMA), ``keep_state(name, parameter)`` for state a hook keeps (in checkpoints,
  and under the optimizer with ``state_under_optimizer``), and ``construct`` calling ``accumulate(*inputs)`` where the
  zoo's step returns other outputs.
- **Its module**: raises ImportError naming the install where the zoo cannot be imported; checks the zoo's own
  arguments under the zoo's class name, with the message format of ``ms_gradaccum.core.validation``; refuses what the
  zoo's step accepts and this one cannot honour, with the fix.
"""
