"""Networks with cells of their own ``bprop`` (MindFormers' loss cells, straight-through estimators): trained exactly
like the plain full batch, in graph and PyNative mode; the one form MindSpore cannot compile nested gets a clear error."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor
from mindspore.ops import functional as F

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from ms_gradaccum._internals import bprops_calling_zeros_like
from helpers import (assert_params_close, assert_params_moved, classification_batches, make_mlp, make_optimizer,
                     params_of, train_steps)

K = 4
ZERO_FORMS = ("label_times_zero", "primitive", "zeros")   # what the label's gradient is made with in the bprop
ZEROS_LIKE = ops.ZerosLike()


class LogSoftmaxCustom(nn.Cell):
    """MindFormers' pattern: the loss's own backward, and a gradient for the integer label (made as `zero_form` says)."""

    def __init__(self, zero_form: str):
        super().__init__()
        self.zero_form = zero_form

    def construct(self, logits, label):
        return ops.log_softmax(logits, -1), label

    def bprop(self, logits, label, out, dout):
        d = dout[0] - ops.softmax(logits, -1) * dout[0].sum(-1, keepdims=True)
        if self.zero_form == "primitive":
            return d, ZEROS_LIKE(label)
        if self.zero_form == "zeros":
            return d, ops.zeros(label.shape, label.dtype)
        return d, label * 0


class StraightThrough(nn.Cell):
    """Rounds in the forward pass; its bprop passes the gradient through (autodiff would give 0): a gradient that only
    the custom bprop gives, so a path that ignored it could not match."""

    def construct(self, x):
        return ops.round(x * 4) / 4

    def bprop(self, x, out, dout):
        return (dout,)


class CustomLoss(nn.Cell):
    def __init__(self, net, zero_form="label_times_zero"):
        super().__init__()
        self.net = net
        self.straight_through = StraightThrough()
        self.log_softmax = LogSoftmaxCustom(zero_form)

    def construct(self, x, y):
        logp, y = self.log_softmax(self.net(self.straight_through(x)), y)
        return -(logp * ops.one_hot(y, 4, Tensor(1.0), Tensor(0.0))).sum(-1).mean()


def _train(wrap, optimizer, batches, zero_form="label_times_zero"):
    """(final weights, losses, initial weights) of the network trained through `wrap(loss_net, optimizer)`."""
    net = make_mlp()
    loss_net = CustomLoss(net, zero_form)
    initial = params_of(net)
    losses = train_steps(wrap(loss_net, make_optimizer(optimizer, net.trainable_params())), batches)
    return params_of(net), losses, initial


def _accumulating(loss_net, optimizer):
    return nn.TrainOneStepCell(GradAccumulationCell(loss_net, K), optimizer)


@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE], ids=["graph", "pynative"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("zero_form", ZERO_FORMS)
def test_bprop_cells_train_like_the_full_batch(mode, optimizer, zero_form):
    ms.set_context(mode=mode)
    batches = classification_batches(3, 32)
    expected, expected_losses, initial = _train(nn.TrainOneStepCell, optimizer, batches, zero_form)
    actual, losses, _ = _train(_accumulating, optimizer, batches, zero_form)
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    # Negative control: one micro-batch's gradient (a quarter of each batch) is not the full batch's.
    control, _, _ = _train(nn.TrainOneStepCell, optimizer, [(x[:32 // K], y[:32 // K]) for x, y in batches], zero_form)
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, rtol=1e-5, atol=1e-6)


def test_bprop_straight_through_gradient_is_the_custom_one():
    # Without the custom bprop the first layer would get no gradient at all (round has none): the accumulation path
    # must move it exactly as the plain network does.
    batches = classification_batches(2, 32)
    expected, _, initial = _train(nn.TrainOneStepCell, "sgd", batches)
    actual, _, _ = _train(_accumulating, "sgd", batches)
    first = next(name for name in initial if name.endswith("0.weight"))
    assert float(np.abs(expected[first] - initial[first]).max()) > 1e-4
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)


# --- the one form MindSpore cannot compile nested: a bprop that calls mindspore.ops.zeros_like ------------------------

class ZerosLikeFunction(nn.Cell):
    def construct(self, logits, label):
        return ops.log_softmax(logits, -1), label

    def bprop(self, logits, label, out, dout):
        return dout[0] - ops.softmax(logits, -1) * dout[0].sum(-1, keepdims=True), F.zeros_like(label)


class ZerosLikeLoss(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.log_softmax = ZerosLikeFunction()

    def construct(self, x, y):
        logp, y = self.log_softmax(self.net(x), y)
        return -(logp * ops.one_hot(y, 4, Tensor(1.0), Tensor(0.0))).sum(-1).mean()


def _zeros_like_run(wrap, batches):
    net = make_mlp()
    step = wrap(ZerosLikeLoss(net), make_optimizer("momentum", net.trainable_params()))
    train_steps(step, batches)
    return params_of(net)


def test_bprop_calling_zeros_like_is_refused_in_graph_mode_with_what_works():
    batches = classification_batches(3, 32)
    with pytest.raises(RuntimeError, match=r"For 'GradAccumulationCell', the argument 'network' holds cells whose bprop "
                                           r"calls mindspore.ops.zeros_like: log_softmax \(ZerosLikeFunction\)\. .*"
                                           r"AccumulatingTrainOneStepCell\(loss_net, optimizer, 1, micro_size=4\)"):
        _zeros_like_run(_accumulating, batches)
    expected = _zeros_like_run(nn.TrainOneStepCell, batches)
    # What the message offers: AccumulatingTrainOneStepCell in graph mode, and PyNative mode, both exact.
    actual = _zeros_like_run(lambda loss_net, opt: AccumulatingTrainOneStepCell(loss_net, opt, 1, micro_size=K),
                             batches)
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    assert_params_close(_zeros_like_run(_accumulating, batches), expected, rtol=1e-5, atol=1e-6)


def test_bprop_zeros_like_detection_finds_the_function_however_it_is_named():
    from mindspore.ops import zeros_like   # pylint: disable=import-outside-toplevel

    class Bare(nn.Cell):
        def bprop(self, x, out, dout):
            return (zeros_like(x),)

    class ThroughOps(nn.Cell):
        def bprop(self, x, out, dout):
            return (ops.zeros_like(x),)

    net = nn.SequentialCell(Bare(), ThroughOps(), ZerosLikeFunction(), LogSoftmaxCustom("primitive"),
                            StraightThrough(), nn.Dense(2, 2))
    assert bprops_calling_zeros_like(net) == ["0 (Bare)", "1 (ThroughOps)", "2 (ZerosLikeFunction)"]
