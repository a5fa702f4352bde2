"""Networks with cells of their own ``bprop`` (MindFormers' loss cells, straight-through estimators): trained exactly
like the plain full batch, in graph and PyNative mode, also when a bprop calls mindspore.ops.zeros_like (which MindSpore
cannot compile nested unless autodiff gets a zeros_like of its own: ms_gradaccum/_mindspore/patches.py); where that
cannot be arranged, the
cells name the bprops that call it."""
import os
import subprocess
import sys

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from ms_gradaccum._mindspore.bprops import bprops_calling_zeros_like
from ms_gradaccum.cells import grad_accumulation as _cell
from launch import REPO, repo_env
from helpers import (assert_params_close, assert_params_moved, classification_batches, make_mlp, make_optimizer,
                     params_of, train_steps, ZerosLikeFunction, ZerosLikeLoss)

K = 4
ZERO_FORMS = ("label_times_zero", "primitive", "zeros")   # what the label's gradient is made with in the bprop
ZEROS_LIKE = ops.ZerosLike()


class LogSoftmaxCustom(nn.Cell):
    """MindFormers' pattern: the loss's own backward, and a gradient for the integer label (made as `zero_form`
    says)."""

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


@pytest.mark.slow
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


# --- a bprop that calls mindspore.ops.zeros_like (MindFormers' loss cells) --------------------------------------------

def _zeros_like_run(wrap, batches, optimizer="momentum"):
    net = make_mlp()
    step = wrap(ZerosLikeLoss(net), make_optimizer(optimizer, net.trainable_params()))
    train_steps(step, batches)
    return params_of(net)


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("cell", ["GradAccumulationCell", "AccumulatingTrainOneStepCell"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_bprop_calling_zeros_like_trains_like_the_full_batch_in_graph_mode(cell, optimizer):
    batches = classification_batches(3, 32)
    net = make_mlp()
    loss_net = ZerosLikeLoss(net)   # names the MLP's weights net.*
    initial = params_of(net)
    train_steps(nn.TrainOneStepCell(loss_net, make_optimizer(optimizer, net.trainable_params())), batches)
    expected = params_of(net)
    wrap = _accumulating if cell == "GradAccumulationCell" else \
        (lambda loss_net, opt: AccumulatingTrainOneStepCell(loss_net, opt, 1, micro_size=K))
    actual = _zeros_like_run(wrap, batches, optimizer)
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    # Negative control: one micro-batch's gradient.
    control = _zeros_like_run(nn.TrainOneStepCell, [(x[:32 // K], y[:32 // K]) for x, y in batches], optimizer)
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, rtol=1e-5, atol=1e-6)


def test_bprop_calling_zeros_like_refused_where_the_way_around_cannot_be_applied(monkeypatch):
    # A MindSpore laid out otherwise than the versions checked: the cell names the bprops that call the function.
    monkeypatch.setattr(_cell.AUTODIFF_ZEROS_LIKE, "install", lambda: False)
    batches = classification_batches(3, 32)
    with pytest.raises(RuntimeError, match=r"For 'GradAccumulationCell', the argument 'network' holds cells whose "
                                           r"bprop "
                                           r"calls mindspore.ops.zeros_like: log_softmax \(ZerosLikeFunction\)\. .*"
                                           r"AccumulatingTrainOneStepCell\(loss_net, optimizer, 1, micro_size=4\)"):
        _zeros_like_run(_accumulating, batches)
    # PyNative mode (no nested compile) trains it there too.
    ms.set_context(mode=ms.PYNATIVE_MODE)
    assert_params_close(_zeros_like_run(_accumulating, batches), _zeros_like_run(nn.TrainOneStepCell, batches),
                        rtol=1e-5, atol=1e-6)


def test_bprop_zeros_like_detection_finds_calls_not_names_nor_folded_branches():
    from mindspore.ops import zeros_like   # pylint: disable=import-outside-toplevel

    class Bare(nn.Cell):
        def bprop(self, x, out, dout):
            return (zeros_like(x),)

    class ThroughOps(nn.Cell):
        def bprop(self, x, out, dout):
            return (ops.zeros_like(x),)

    class UntakenBranch(nn.Cell):
        """Calls it only under a flag that is off: MindSpore folds the branch away when it compiles."""

        def __init__(self, flag):
            super().__init__()
            self.flag = flag

        def bprop(self, x, out, dout):
            if self.flag:
                return (ops.zeros_like(x),)
            return (dout,)

    class NamesOnly(nn.Cell):
        def bprop(self, x, out, dout):
            unused = ops.zeros_like   # named, never called
            return (dout,) if unused is not None else (dout,)

    net = nn.SequentialCell(Bare(), ThroughOps(), ZerosLikeFunction(), LogSoftmaxCustom("primitive"),
                            StraightThrough(), UntakenBranch(False), UntakenBranch(True), NamesOnly(), nn.Dense(2, 2))
    assert bprops_calling_zeros_like(net) == ["0 (Bare)", "1 (ThroughOps)", "2 (ZerosLikeFunction)",
                                              "6 (UntakenBranch)"]


@pytest.mark.slow
@pytest.mark.lowest
def test_bprop_way_around_changes_nothing_other_graphs_compute():
    # In a fresh process: importing the package leaves MindSpore as it is; a plain train cell trained before and after
    # a GradAccumulationCell has compiled (which applies the way around) ends bit-identical.
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "tools", "autodiff_zeros_like.py")],
                          env=repo_env(GLOG_v="3"), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["after import"] == "mindspore.ops.functional"
    assert lines["after GradAccumulationCell"] == "ms_gradaccum._autodiff_functional"
    assert lines["plain before vs after"] == "bit-identical"
