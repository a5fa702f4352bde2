"""How the cell presents itself to MindSpore in each parallel mode (checked on CPU, where
SEMI_AUTO_PARALLEL/AUTO_PARALLEL cannot compile): routing, markers and the loss/gradient contract."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, Tensor
from mindspore.nn.wrap.cell_wrapper import _TrainGradAccuStepCell
from mindspore.train.amp import _is_grad_accumulation

from ms_gradaccum import GradAccumulationCell
from helpers import classification_batches, make_mlp

K = 4


@pytest.fixture(autouse=True)
def reset_parallel_context():
    yield
    ms.reset_auto_parallel_context()


def _loss_net():
    return nn.WithLossCell(make_mlp(), nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))


def _primitives(cell, prim_name):
    found = []
    for _, sub in cell.cells_and_names():
        for value in list(vars(sub).values()) + list(getattr(sub, "add_list", [])):
            if isinstance(value, ms.ops.Primitive) and value.name == prim_name and value not in found:
                found.append(value)
    return found


@pytest.mark.parametrize("mode", [ms.ParallelMode.SEMI_AUTO_PARALLEL, ms.ParallelMode.AUTO_PARALLEL])
def test_parallel_modes_semi_auto_routes_into_mindspore_accumulation_with_markers(mode):
    ms.set_auto_parallel_context(parallel_mode=mode, enable_parallel_optimizer=True)
    cell = GradAccumulationCell(_loss_net(), K)

    assert _is_grad_accumulation(cell) and cell.cls_name == "GradAccumulationCell"
    slices = _primitives(cell, "StridedSlice")
    assert len(slices) == K and all(p.attrs["grad_accu_num"] == K for p in slices)
    ends = [p.attrs["forward_end"] for p in _primitives(cell, "Add") if "forward_end" in p.attrs]
    assert sorted(ends) == list(range(K))

    model = ms.Model(cell, optimizer=nn.SGD(cell.trainable_params(), 0.1))
    train_network = model._train_network  # pylint: disable=protected-access
    assert type(train_network) is _TrainGradAccuStepCell
    assert train_network.sens == pytest.approx(1.0 / K)  # read from the cell's micro_size
    assert train_network.opt_shard  # the parallel optimizer will shard the accumulation buffers


@pytest.mark.parametrize("mode", [ms.ParallelMode.STAND_ALONE, ms.ParallelMode.DATA_PARALLEL])
def test_parallel_modes_stand_alone_and_data_parallel_are_not_routed(mode):
    ms.set_auto_parallel_context(parallel_mode=mode)
    cell = GradAccumulationCell(_loss_net(), K)
    assert not _is_grad_accumulation(cell)
    assert not _primitives(cell, "StridedSlice")


def test_parallel_modes_semi_auto_output_is_mean_loss_with_gradient_of_sum():
    # _TrainGradAccuStepCell multiplies the gradient by 1/micro_size, so the cell must return the mean loss
    # (for LossMonitor) whose gradient is that of the SUM. The graph is built under semi-auto and, since
    # that cannot compile on CPU, evaluated stand-alone (the markers are inert there).
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    cell = GradAccumulationCell(_loss_net(), K)
    ms.reset_auto_parallel_context()
    reference = _loss_net()

    x, y = (Tensor(a) for a in classification_batches(1, 32)[0])
    loss, grads = ms.value_and_grad(cell, None, cell.trainable_params())(x, y)
    ref_loss, ref_grads = ms.value_and_grad(reference, None, reference.trainable_params())(x, y)

    np.testing.assert_allclose(loss.asnumpy(), ref_loss.asnumpy(), rtol=1e-6)
    for grad, ref_grad in zip(grads, ref_grads):
        np.testing.assert_allclose(grad.asnumpy() / K, ref_grad.asnumpy(), rtol=1e-5, atol=1e-7)


class _CompilingFrame(nn.Cell):
    """Stands in for Cell.compile of a top cell: a Python frame whose `self` holds `wrapper`."""

    def __init__(self, wrapper):
        super().__init__()
        self.wrapper = wrapper

    def compile(self, lookup):  # pylint: disable=arguments-differ
        return lookup()


def _semi_auto_fixed_scale_model(scale):
    """(cell, the train cell Model builds) under semi-auto with FixedLossScaleManager(scale, False)."""
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    cell = GradAccumulationCell(_loss_net(), K)
    model = ms.Model(cell, optimizer=nn.SGD(cell.trainable_params(), 0.1, loss_scale=scale),
                     loss_scale_manager=ms.FixedLossScaleManager(scale, drop_overflow_update=False))
    return cell, model._train_network  # pylint: disable=protected-access


def test_parallel_modes_semi_auto_fixed_loss_scale_reaches_the_backward():
    # Model builds _TrainGradAccuStepCell(network, optimizer) for FixedLossScaleManager(S, False) under
    # semi-auto: no sens at all, while the optimizer divides by S. The cell must scale its backward by S.
    scale = 2.0 ** 10
    cell, train_network = _semi_auto_fixed_scale_model(scale)
    assert type(train_network) is _TrainGradAccuStepCell and not train_network.sense_flag
    assert _CompilingFrame(train_network).compile(lambda: cell.left_out_scale) == scale
    # Any other wrapper applies its own scale: nothing is scaled twice.
    plain = nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), 0.1), sens=scale)
    assert _CompilingFrame(plain).compile(lambda: cell.left_out_scale) == 1.0


def test_parallel_modes_semi_auto_gradient_carries_the_optimizer_loss_scale():
    # Evaluated stand-alone (the markers are inert there), inside a frame that holds the semi-auto wrapper.
    scale = 2.0 ** 10
    cell, wrapper = _semi_auto_fixed_scale_model(scale)
    ms.reset_auto_parallel_context()
    reference = _loss_net()
    x, y = (Tensor(a) for a in classification_batches(1, 32)[0])

    def gradients():
        return ms.value_and_grad(cell, None, cell.trainable_params())(x, y)

    loss, grads = _CompilingFrame(wrapper).compile(gradients)
    ref_loss, ref_grads = ms.value_and_grad(reference, None, reference.trainable_params())(x, y)
    np.testing.assert_allclose(loss.asnumpy(), ref_loss.asnumpy(), rtol=1e-6)
    for grad, ref_grad in zip(grads, ref_grads):   # sum over micro-batches, times the scale
        np.testing.assert_allclose(grad.asnumpy() / K / scale, ref_grad.asnumpy(), rtol=1e-5, atol=1e-7)


def test_parallel_modes_dynamic_loss_scale_wrapper_is_refused_with_the_fix():
    # On Ascend/GPU, Model builds nn.TrainOneStepWithLossScaleCell for a DynamicLossScaleManager; a scale that
    # changes while training cannot reach backward passes that run inside the forward: a clear error.
    cell = GradAccumulationCell(_loss_net(), K)
    opt = nn.SGD(cell.trainable_params(), 0.1)
    dynamic = nn.TrainOneStepWithLossScaleCell(cell, opt, scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 100))
    with pytest.raises(ValueError, match=r"AccumulatingTrainOneStepCell\(loss_net, optimizer, 1, micro_size=micro_size, "
                                         r"scale_sense=manager.get_update_cell\(\)\)"):
        _CompilingFrame(dynamic).compile(cell.loss_scale.check)
    fixed = nn.TrainOneStepWithLossScaleCell(cell, opt, scale_sense=nn.FixedLossScaleUpdateCell(2.0 ** 10))
    assert _CompilingFrame(fixed).compile(lambda: cell.loss_scale.value) == 2.0 ** 10
