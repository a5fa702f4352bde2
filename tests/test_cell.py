"""Reference equivalence: GradAccumulationCell against plain full-batch nn.TrainOneStepCell."""

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor

from ms_gradaccum import GradAccumulationCell
from helpers import (assert_params_close, assert_params_equal, assert_params_moved, ce, classification_batches,
                     make_convnet, make_mlp, make_optimizer, max_abs_diff, params_of, reference_run, train_steps)

STEPS = 3
BATCH = 32
# fp32 summation order differs from the full batch; Adam divides by sqrt(v) and so magnifies it most.
# Measured differences are below 1e-7 for all three (README); the margins allow for other BLAS kernels.
TOLERANCE = {"sgd": dict(rtol=1e-5, atol=1e-6), "momentum": dict(rtol=1e-5, atol=1e-6),
             "adam": dict(rtol=1e-5, atol=1e-5)}



def accumulated_run(make_net, loss_fn, optimizer, batches, micro_size, wrap=lambda cell: cell):
    net = make_net()
    cell = GradAccumulationCell(wrap(nn.WithLossCell(net, loss_fn)), micro_size)
    step = nn.TrainOneStepCell(cell, make_optimizer(optimizer, net.trainable_params()))
    losses = train_steps(step, batches)
    return params_of(net), losses


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("micro_size", [1, 2, 4, 8])
def test_cell_matches_full_batch_reference(optimizer, micro_size):
    batches = classification_batches(STEPS, BATCH)
    expected, expected_losses, initial = reference_run(make_mlp, ce(), optimizer, batches)
    actual, losses = accumulated_run(make_mlp, ce(), optimizer, batches, micro_size)

    assert_params_moved(expected, initial)
    if micro_size == 1:
        assert_params_equal(actual, expected)
        assert losses == expected_losses
    else:
        assert_params_close(actual, expected, **TOLERANCE[optimizer])
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE])
def test_cell_accumulator_carries_nothing_between_steps(mode):
    # The gradient hand-over reads the accu_grads buffers in the wrapper's backward pass: it must come after
    # this step's micro-batches have rewritten them. NaN left in them before every step would show otherwise.
    batches = classification_batches(STEPS, BATCH)
    expected, _, _ = reference_run(make_mlp, ce(), "momentum", batches)
    ms.set_context(mode=mode)
    net = make_mlp()
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), 4)
    step = nn.TrainOneStepCell(cell, make_optimizer("momentum", net.trainable_params()))
    assert [b.name for b in cell.accu_grads] == [f"accu_grads.{w.name}" for w in net.trainable_params()]
    for x, y in batches:
        for buffer in cell.accu_grads:   # written in place (set_data would swap the storage under a compiled graph)
            ops.assign(buffer, Tensor(np.full(buffer.shape, np.nan, np.float32)))
        step(Tensor(x), Tensor(y))
    assert_params_close(params_of(net), expected, **TOLERANCE["momentum"])


class _Scaled(nn.Cell):
    """Multiplies the loss by a constant: inside GradAccumulationCell(.., K) with K, the 1/K is undone."""

    def __init__(self, network, factor):
        super().__init__(auto_prefix=False)
        self.network = network
        self.factor = factor

    def construct(self, *inputs):
        return self.network(*inputs) * self.factor


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_cell_without_mean_scaling_fails_reference(optimizer):
    # Negative control: summing the micro-batch gradients without dividing by K must be detected.
    batches = classification_batches(STEPS, BATCH)
    expected, _, _ = reference_run(make_mlp, ce(), optimizer, batches)
    wrong, _ = accumulated_run(make_mlp, ce(), optimizer, batches, 4, wrap=lambda c: _Scaled(c, 4.0))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(wrong, expected, **TOLERANCE[optimizer])


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_cell_single_micro_batch_fails_reference(optimizer):
    # Negative control: training on the first micro-batch only (what a broken loop would do) is detected.
    batches = classification_batches(STEPS, BATCH)
    expected, _, _ = reference_run(make_mlp, ce(), optimizer, batches)
    first_quarter = [(x[:BATCH // 4], y[:BATCH // 4]) for x, y in batches]
    wrong, _ = accumulated_run(make_mlp, ce(), optimizer, first_quarter, 1)
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(wrong, expected, **TOLERANCE[optimizer])
    assert max_abs_diff(wrong, expected) > 100 * TOLERANCE[optimizer]["atol"]


class _WeightedLoss(nn.Cell):
    """A loss cell with three inputs: data, label and a per-sample weight."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net = net
        self.ce = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="none")

    def construct(self, data, label, weight):
        return ops.mean(self.ce(self.net(data), label) * weight)


def test_cell_multi_input_loss_matches_reference():
    rng = np.random.RandomState(3)
    batches = [(x, y, rng.uniform(0.1, 2.0, BATCH).astype(np.float32))
               for x, y in classification_batches(STEPS, BATCH)]

    ref_net = make_mlp()
    initial = params_of(ref_net)
    ref_step = nn.TrainOneStepCell(_WeightedLoss(ref_net), make_optimizer("momentum", ref_net.trainable_params()))
    expected_losses = train_steps(ref_step, batches)

    net = make_mlp()
    step = nn.TrainOneStepCell(GradAccumulationCell(_WeightedLoss(net), 4),
                               make_optimizer("momentum", net.trainable_params()))
    losses = train_steps(step, batches)

    assert_params_moved(params_of(ref_net), initial)
    assert_params_close(params_of(net), params_of(ref_net), **TOLERANCE["momentum"])
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_cell_convnet_matches_reference(optimizer):
    batches = classification_batches(STEPS, 16, in_shape=(1, 8, 8))
    expected, expected_losses, initial = reference_run(make_convnet, ce(), optimizer, batches)
    actual, losses = accumulated_run(make_convnet, ce(), optimizer, batches, 4)
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, **TOLERANCE[optimizer])
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


def test_cell_pynative_matches_reference():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    batches = classification_batches(STEPS, BATCH)
    expected, expected_losses, initial = reference_run(make_mlp, ce(), "momentum", batches)
    actual, losses = accumulated_run(make_mlp, ce(), "momentum", batches, 4)
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, **TOLERANCE["momentum"])
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


def test_cell_output_is_mean_micro_batch_loss_and_gradient_is_mean_gradient():
    # The cell's own contract, without an optimizer: value = full-batch loss, d/dw = full-batch gradient.
    x, y = classification_batches(1, BATCH)[0]
    ref_loss_net = nn.WithLossCell(make_mlp(), ce())
    ref_loss, ref_grads = ms.value_and_grad(ref_loss_net, None, ref_loss_net.trainable_params())(Tensor(x), Tensor(y))
    loss_net = nn.WithLossCell(make_mlp(), ce())
    cell = GradAccumulationCell(loss_net, 8, weights=loss_net.trainable_params())
    loss, grads = ms.value_and_grad(cell, None, cell.trainable_params())(Tensor(x), Tensor(y))
    assert loss.shape == () and loss.dtype == ms.float32
    np.testing.assert_allclose(loss.asnumpy(), ref_loss.asnumpy(), rtol=1e-6)
    assert len(grads) == len(ref_grads) == 6
    for grad, ref_grad in zip(grads, ref_grads):
        np.testing.assert_allclose(grad.asnumpy(), ref_grad.asnumpy(), rtol=1e-5, atol=1e-7)
