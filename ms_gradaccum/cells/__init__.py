"""The public cells and what wires them: ``GradAccumulationCell`` (``grad_accumulation``),
``AccumulatingTrainOneStepCell`` (``accumulating``), ``GradAccumulationScheduler`` (``scheduler``); what a cell trains
with, bound once (``binding``), and the compile hook that binds it from the root MindSpore compiles
(``compile_hook``); ``check_equivalence``, which trains through them both ways (``equivalence``)."""
