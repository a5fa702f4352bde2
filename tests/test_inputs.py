"""What a loss network may take and return besides batched Tensors and a scalar loss: single-element losses of shape
(1,) (MindFormers' models), and inputs that are not split (None, Python numbers, 0-d Tensors, and Tensors shared by
the batch, declared with shared_inputs); each trained exactly like the plain full batch."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from helpers import (assert_params_close, assert_params_moved, ce, classification_batches, make_mlp, make_optimizer,
                     params_of)

K = 4
MODES = [pytest.param(ms.GRAPH_MODE, id="graph"), pytest.param(ms.PYNATIVE_MODE, id="pynative")]


def _cells():
    return {
        "GradAccumulationCell": lambda loss_net, opt, **kw: nn.TrainOneStepCell(GradAccumulationCell(loss_net, K, **kw),
                                                                                opt),
        "AccumulatingTrainOneStepCell": lambda loss_net, opt, **kw: AccumulatingTrainOneStepCell(
            loss_net, opt, 1, micro_size=K, **kw),
    }


CELLS = sorted(_cells())


class VectorLoss(nn.Cell):
    """Returns its mean loss with shape (1,), in `dtype`, as MindFormers' models do."""

    def __init__(self, net, dtype=ms.float32):
        super().__init__()
        self.net, self.ce, self.dtype = net, ce(), dtype

    def construct(self, x, y):
        return ops.cast(self.ce(self.net(x), y), self.dtype).reshape((1,))


def _run(wrap, make_loss_net, batches, optimizer="momentum", **kwargs):
    net = make_mlp()
    loss_net = make_loss_net(net)
    initial = params_of(net)
    step = wrap(loss_net, make_optimizer(optimizer, net.trainable_params()), **kwargs)
    outputs = [step(*(Tensor(a) if isinstance(a, np.ndarray) else a for a in batch)) for batch in batches]
    return params_of(net), outputs, initial


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("dtype", [ms.float32, ms.float16], ids=["float32", "float16"])
def test_inputs_single_element_loss_trains_exactly_and_keeps_its_shape(mode, cell, dtype):
    ms.set_context(mode=mode)
    batches = classification_batches(3, 32)
    make = lambda net: VectorLoss(net, dtype)   # noqa: E731
    expected, expected_losses, initial = _run(nn.TrainOneStepCell, make, batches)
    actual, losses, _ = _run(_cells()[cell], make, batches)
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert all(loss.shape == (1,) for loss in losses + expected_losses)   # the network's shape, as MindSpore's cells
    np.testing.assert_allclose([float(v.asnumpy()[0]) for v in losses],
                               [float(v.asnumpy()[0]) for v in expected_losses],
                               rtol=2e-3 if dtype == ms.float16 else 1e-5)


class SharedInputsLoss(nn.Cell):
    """A loss network with inputs that are not one row per sample: a bias shared by the batch (1, F), a 0-d Tensor,
    a Python number and an optional input that may be None."""

    def __init__(self, net):
        super().__init__()
        self.net, self.ce = net, ce()

    def construct(self, x, shift, y, temperature, scale, extra=None):
        logits = self.net(x + shift) / temperature * scale
        if extra is not None:
            logits = logits + extra
        return self.ce(logits, y)


def _shared_batches():
    rng = np.random.RandomState(5)
    return [(x, rng.randn(1, 16).astype(np.float32), y, Tensor(np.float32(1.5)), 0.5, None)
            for x, y in classification_batches(3, 32)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell", CELLS)
def test_inputs_shared_none_numbers_and_0d_reach_every_micro_batch(mode, cell):
    ms.set_context(mode=mode)
    batches = _shared_batches()
    expected, _, initial = _run(nn.TrainOneStepCell, SharedInputsLoss, batches)
    actual, _, _ = _run(_cells()[cell], SharedInputsLoss, batches, shared_inputs=(1,))
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    # Negative control: the shared input left out (zeros) trains differently, so it was used.
    control, _, _ = _run(_cells()[cell], SharedInputsLoss, [(b[0], np.zeros_like(b[1])) + b[2:] for b in batches],
                         shared_inputs=(1,))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, rtol=1e-5, atol=1e-6)


def test_inputs_undeclared_shared_tensor_is_named_with_the_fix():
    cell = GradAccumulationCell(SharedInputsLoss(make_mlp()), K)
    step = nn.TrainOneStepCell(cell, make_optimizer("sgd", cell.trainable_params()))
    x, shift, y, temperature, scale, extra = _shared_batches()[0]
    with pytest.raises(ValueError, match=r"but input 0 \('x'\) has shape \(32, 16\) and input 1 \('shift'\) has shape "
                                         r"\(1, 16\)\. If input 1 \('shift'\) is shared by the whole batch .* declare "
                                         r"it: shared_inputs=\(1,\)"):
        step(Tensor(x), Tensor(shift), Tensor(y), temperature, scale, extra)


def test_inputs_shared_index_out_of_range_is_refused_when_the_graph_compiles():
    cell = GradAccumulationCell(SharedInputsLoss(make_mlp()), K, shared_inputs=(1, 7))
    step = nn.TrainOneStepCell(cell, make_optimizer("sgd", cell.trainable_params()))
    x, shift, y, temperature, scale, extra = _shared_batches()[0]
    with pytest.raises(ValueError, match=r"the argument 'shared_inputs' names input 7, but the network was called with "
                                         r"6 input\(s\)"):
        step(Tensor(x), Tensor(shift), Tensor(y), temperature, scale, extra)


@pytest.mark.parametrize("value, error, message", [
    (True, TypeError, r"the argument 'shared_inputs' must be a tuple of input indices .*, but got True \(bool\)"),
    ("1", TypeError, r"the argument 'shared_inputs' must be a tuple of input indices .*, but got '1' \(str\)"),
    ((-1,), ValueError, r"every index in 'shared_inputs' must be an int >= 0, but got -1 \(int\)"),
    ((1.0,), TypeError, r"every index in 'shared_inputs' must be an int >= 0, but got 1.0 \(float\)"),
    ((1, 1), ValueError, r"the argument 'shared_inputs' must be a tuple of input indices .*, each once, but got"),
])
@pytest.mark.parametrize("cell", CELLS)
def test_inputs_bad_shared_inputs_rejected(cell, value, error, message):
    net = make_mlp()
    with pytest.raises(error, match=message):
        _cells()[cell](nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()), shared_inputs=value)


def test_inputs_a_single_index_is_one_index_and_the_same_given_twice_is_refused():
    assert GradAccumulationCell(nn.WithLossCell(make_mlp(), ce()), K, shared_inputs=1).shared_inputs == (1,)
    inner = GradAccumulationCell(nn.WithLossCell(make_mlp(), ce()), K, shared_inputs=(1,))
    with pytest.raises(ValueError, match=r"the argument 'shared_inputs' is \(2,\) but the GradAccumulationCell given "
                                         r"as 'network' has shared_inputs=\(1,\)"):
        AccumulatingTrainOneStepCell(inner, make_optimizer("sgd", inner.trainable_params()), 1, shared_inputs=(2,))


def test_inputs_shared_inputs_refused_under_semi_auto():
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    try:
        with pytest.raises(ValueError, match=r"shared_inputs=\(1,\) is not supported under semi-auto/auto parallel"):
            GradAccumulationCell(SharedInputsLoss(make_mlp()), K, shared_inputs=(1,))
    finally:
        ms.reset_auto_parallel_context()
