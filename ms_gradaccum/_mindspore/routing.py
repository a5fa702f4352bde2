"""How ``mindspore.Model`` routes a cell, and the parallel context it reads.

``mindspore/train/amp.py::_is_grad_accumulation`` walks the cell tree and checks ``cell.cls_name`` against
:data:`ROUTED_NAMES`; a match makes ``Model``/``build_train_network`` wrap the network in ``_TrainGradAccuStepCell``,
whose optimizer reads buffers only the semi-auto/auto-parallel compiler pass writes (elsewhere it trains nothing).
``Cell.cls_name`` is a property, so a subclass can present another name. Checked 2.7.0-2.10.0.
"""
import mindspore as ms
from mindspore.communication._comm_helper import GlobalComm
# What Model builds for a routed cell in semi-auto/auto parallel; it applies no loss scale of its own while the
# optimizer divides by its loss_scale (mindspore/train/amp.py::build_train_network).
from mindspore.nn.wrap.cell_wrapper import _TrainGradAccuStepCell as TrainGradAccuStepCell
from mindspore.parallel import _utils as parallel_utils
# Marks micro-batch slices (`grad_accu_num`) and forward ends (`forward_end`) for the parallel pass; only the pass
# reads those attributes.
from mindspore.parallel.nn import GradAccumulation

ROUTED_NAMES = frozenset({"GradAccumulationCell", "GradAccumulation"})
PARALLEL_PASS_MODES = frozenset({ms.ParallelMode.SEMI_AUTO_PARALLEL, ms.ParallelMode.AUTO_PARALLEL})


class ParallelPassMarkers(GradAccumulation):
    """MindSpore's GradAccumulation under a name that Model does not route (GradAccumulationCell presents the routed
    name itself, in the modes where routing is wanted)."""

    @property
    def cls_name(self) -> str:
        return "ParallelPassMarkers"


def parallel_mode() -> str:
    """The parallel mode in force (public API)."""
    return ms.get_auto_parallel_context("parallel_mode")


def communication_initialized() -> bool:
    """Whether ``mindspore.communication.init()`` has run (GlobalComm.INITED, set by init())."""
    return bool(GlobalComm.INITED)


def scale_left_out(train_cell) -> float:
    """The loss scale the optimizer divides out but `train_cell` never applies: only _TrainGradAccuStepCell, built by
    Model in semi-auto/auto parallel for FixedLossScaleManager(S, drop_overflow_update=False), leaves one (S)."""
    if isinstance(train_cell, TrainGradAccuStepCell) and not train_cell.sense_flag:
        return float(getattr(train_cell.optimizer, "loss_scale", 1.0))
    return 1.0


# How semi-auto/auto parallel splits the batch axis of a graph's inputs:
# In these modes a graph is compiled on global shapes: C++ parallel::ExtendInputArgsAbstractShape/ToFullShape multiply
# each input's axis 0 by the dataset strategy's split of that axis, or by device_num // pipeline_stages when there is
# no strategy and full_batch is off (mindspore/parallel/_utils.py::_need_to_full and _to_full_shapes do the same for
# the dataset's shapes). What a cell sees as axis 0 is therefore the rows of every rank together. Checked 2.7.0-2.10.0.
def batch_axis_splits() -> tuple:
    """How many ranks share axis 0 of each graph input: ``(n,)`` for every input alike, or one entry per input (a
    tuple dataset strategy); ``(1,)`` where inputs are not expanded (full_batch, stand-alone, data parallel) or where
    the strategy is given as Layouts, whose split this does not read."""
    if not parallel_utils._need_to_full():  # pylint: disable=protected-access
        return (1,)
    strategy = ms.get_auto_parallel_context("dataset_strategy")
    if strategy not in ("data_parallel", "full_batch") and strategy:
        return tuple(int(item[0]) if isinstance(item, (tuple, list)) and item and isinstance(item[0], int) else 1
                     for item in strategy)
    try:
        ranks = parallel_utils._get_device_num() // parallel_utils._get_pipeline_stages()  # pylint: disable=protected-access
    except RuntimeError:   # no communication initialised and no device_num set: nothing is expanded yet
        ranks = 1
    return (max(int(ranks), 1),)
