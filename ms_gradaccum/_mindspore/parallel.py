"""What the parallel modes read of MindSpore: whether communication is initialised, the gradient reducer's collectives
(data parallel), and how semi-auto/auto parallel expands the batch axis and leaves the loss scale out. Imported by
parallel.data_parallel and parallel.parallel_pass only: a stand-alone step never reads it. Checked 2.7.0-2.10.0.
"""
import mindspore as ms
from mindspore import nn
from mindspore.communication._comm_helper import GlobalComm
from mindspore.parallel import _utils as parallel_utils

from ms_gradaccum._mindspore.surroundings import TrainGradAccuStepCell


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


# nn.DistributedGradReducer's primitives and filter are attributes (allreduce_filter, split_fusion, op_list, allreduce,
# mean, degree): AccumulatingTrainOneStepCell reuses them to all-reduce its buffers in place with the same collectives.
def reducer_all_reduces(reducer: nn.DistributedGradReducer) -> tuple:
    """``(per-weight all-reduce flag, per-weight AllReduce primitive, whether the reducer averages, device count)``."""
    flags = tuple(reducer.allreduce_filter)
    if reducer.split_fusion:
        primitives = tuple(reducer.op_list)
    else:
        primitives = (reducer.allreduce,) * len(flags)
    devices = float(round(1.0 / float(reducer.degree.asnumpy())))
    return flags, primitives, bool(reducer.mean), devices
