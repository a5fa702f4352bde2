"""Mixed precision: the loss scale reaches every micro-batch backward, overflow skips the step, clipping once.

Low-precision networks here compute in float16/bfloat16 (``to_float``, or ``Model``'s ``amp_level="O2"``) with
float32 weights, and a loss small enough that unscaled float16 gradients underflow to zero.
"""
import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor
from mindspore.train import FixedLossScaleManager, Model

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from ms_gradaccum._loss_scale import wrapper_loss_scale
from helpers import (assert_params_close, assert_params_equal, assert_params_moved, classification_batches,
                     classification_dataset, make_mlp, make_optimizer, params_of, reference_run)

SCALE = 2.0 ** 16
K = 4
BATCH = 32


class _SmallLoss(nn.Cell):
    """Cross-entropy (in float32, as amp's loss wrapper computes it) times 1e-6: float16 gradients underflow."""

    def __init__(self):
        super().__init__()
        self.cross_entropy = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def construct(self, logits, label):
        return self.cross_entropy(ops.cast(logits, ms.float32), label) * 1e-6


def _low_precision_mlp(dtype=ms.float16):
    return make_mlp().to_float(dtype)


def _moved(after, before):
    return sum(int((after[n] != before[n]).sum()) for n in before)


def _update_agreement(actual, expected, initial):
    """(cosine, norm ratio) of the parameter updates, all parameters flattened together."""
    a = np.concatenate([(actual[n] - initial[n]).ravel() for n in initial]).astype(np.float64)
    e = np.concatenate([(expected[n] - initial[n]).ravel() for n in initial]).astype(np.float64)
    return float(a @ e / np.linalg.norm(a) / np.linalg.norm(e)), float(np.linalg.norm(a) / np.linalg.norm(e))


def _assert_same_update(actual, expected, initial):
    total = sum(v.size for v in initial.values())
    assert _moved(expected, initial) >= 0.99 * total  # the full batch moves (nearly) every weight
    assert _moved(actual, initial) >= 0.98 * total
    cosine, ratio = _update_agreement(actual, expected, initial)
    assert cosine > 0.999 and abs(ratio - 1) < 0.01, (cosine, ratio)


def _hand_built(loss_net, net, sens):
    step = nn.TrainOneStepCell(loss_net, nn.SGD(net.trainable_params(), 1e4, loss_scale=sens), sens=sens)
    for x, y in classification_batches(2, BATCH):
        step(Tensor(x), Tensor(y))
    return params_of(net)


# MindSpore 2.10's CPU kernels have no bfloat16 MatMul, Tanh, Reshape or AddN (measured): bf16 runs on Ascend only.
_BF16 = pytest.param(ms.bfloat16, marks=pytest.mark.skipif(
    ms.get_context("device_target") == "CPU", reason="no bfloat16 MatMul/Tanh/Reshape/AddN kernels on CPU"))


@pytest.mark.parametrize("dtype", [ms.float16, _BF16])
def test_loss_scale_hand_built_sens_reaches_every_micro_batch(dtype):
    ref_net = _low_precision_mlp(dtype)
    initial = params_of(ref_net)
    expected = _hand_built(nn.WithLossCell(ref_net, _SmallLoss()), ref_net, SCALE)
    net = _low_precision_mlp(dtype)
    actual = _hand_built(GradAccumulationCell(nn.WithLossCell(net, _SmallLoss()), K), net, SCALE)
    _assert_same_update(actual, expected, initial)


def test_loss_scale_unscaled_micro_batches_underflow():
    # Negative control: the landed behaviour, micro-batch backward passes at scale 1 under the wrapper's sens.
    net = _low_precision_mlp()
    initial = params_of(net)
    actual = _hand_built(GradAccumulationCell(nn.WithLossCell(net, _SmallLoss()), K, loss_scale=1.0), net, SCALE)
    assert _moved(actual, initial) < 0.5 * sum(v.size for v in initial.values())


# Under amp_level="O2" the loss itself is float16 and Model's sens is filled in its dtype: 2**16 would be inf.
MODEL_SCALE = 2.0 ** 12


def _model_run(network_of, drop_overflow_update=False):
    net = make_mlp()
    initial = params_of(net)
    model = Model(network_of(nn.WithLossCell(net, _SmallLoss())),
                  optimizer=nn.SGD(net.trainable_params(), 1e4, loss_scale=MODEL_SCALE), amp_level="O2",
                  loss_scale_manager=FixedLossScaleManager(MODEL_SCALE, drop_overflow_update=drop_overflow_update))
    model.train(1, classification_dataset(2, BATCH), dataset_sink_mode=False)
    return params_of(net), initial


def test_loss_scale_model_amp_o2_fixed_manager_trains_like_full_batch():
    expected, initial = _model_run(lambda loss_net: loss_net)
    actual, _ = _model_run(lambda loss_net: GradAccumulationCell(loss_net, K))
    _assert_same_update(actual, expected, initial)
    control, _ = _model_run(lambda loss_net: GradAccumulationCell(loss_net, K, loss_scale=1.0))
    assert _moved(control, initial) < 0.5 * sum(v.size for v in initial.values())


def test_loss_scale_model_refuses_dropping_manager_on_cpu():
    # MindSpore itself refuses FixedLossScaleManager(drop_overflow_update=True) on CPU; the supported way to
    # skip overflowing steps here is AccumulatingTrainOneStepCell(scale_sense=...), tested below.
    with pytest.raises(ValueError, match="are supported on device `CPU`"):
        _model_run(lambda loss_net: GradAccumulationCell(loss_net, K), drop_overflow_update=True)


def test_loss_scale_functional_style_with_explicit_scale():
    scaler = ms.amp.StaticLossScaler(SCALE)

    def run(make_loss_net):
        net = _low_precision_mlp()
        loss_net = make_loss_net(net)

        def scaled_loss(x, y):
            return scaler.scale(loss_net(x, y))

        grad_fn = ms.value_and_grad(scaled_loss, None, net.trainable_params())
        opt = nn.SGD(net.trainable_params(), 1e4)
        for x, y in classification_batches(2, BATCH):
            _, grads = grad_fn(Tensor(x), Tensor(y))
            opt(scaler.unscale(grads))
        return params_of(net)

    initial = params_of(_low_precision_mlp())
    expected = run(lambda net: nn.WithLossCell(net, _SmallLoss()))
    actual = run(lambda net: GradAccumulationCell(nn.WithLossCell(net, _SmallLoss()), K,
                                                  loss_scale=scaler.scale_value))
    _assert_same_update(actual, expected, initial)


def test_loss_scale_fp32_training_bit_exact_whatever_the_scale_source():
    # A power-of-two sens: scaling inside and unscaling in float32 is exact, so fp32 results equal sens=1.
    batches = classification_batches(3, BATCH)
    expected, _, _ = reference_run(make_mlp, _SmallLoss(), "momentum", batches)

    def run(sens, **kwargs):
        net = make_mlp()
        cell = GradAccumulationCell(nn.WithLossCell(net, _SmallLoss()), 1, **kwargs)
        step = nn.TrainOneStepCell(cell, nn.Momentum(net.trainable_params(), 0.05, 0.9, loss_scale=sens), sens=sens)
        for x, y in batches:
            step(Tensor(x), Tensor(y))
        return params_of(net)

    assert_params_equal(run(1.0), expected)
    assert_params_equal(run(1024.0), expected)
    assert_params_equal(run(1024.0, loss_scale=1024.0), expected)


def test_loss_scale_read_from_the_wrapping_train_cell():
    cell = GradAccumulationCell(nn.WithLossCell(make_mlp(), _SmallLoss()), K)
    assert wrapper_loss_scale(cell.key) == 1.0          # no train cell on the stack

    class Probe(nn.Cell):
        def __init__(self, wrapper):
            super().__init__()
            self.wrapper = wrapper

        def compile(self):  # a frame whose `self` holds the train cell, as Cell.compile's does
            return wrapper_loss_scale(cell.key)

    opt = nn.SGD(cell.trainable_params(), 0.1)
    assert Probe(nn.TrainOneStepCell(cell, opt, sens=512.0)).compile() == 512.0
    assert Probe(nn.TrainOneStepCell(cell, opt)).compile() == 1.0
