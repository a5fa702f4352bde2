"""Where the loss scale of the micro-batch backward passes comes from, and that it reaches every one of them.

Low-precision networks here compute in float16/bfloat16 (``to_float``, or ``Model``'s ``amp_level="O2"``) with
float32 weights, and a loss small enough that unscaled float16 gradients underflow to zero.
"""
import re
import warnings

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, Tensor
from mindspore.train import FixedLossScaleManager, Model

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from ms_gradaccum.core.validation import computes_in_float16
from helpers import (assert_params_equal, assert_params_moved, assert_same_update, ce, classification_batches,
                     classification_dataset, low_precision_mlp, make_mlp, moved, params_of, reference_run, SCALE,
                     small_loss_train_cell, SmallLoss)

K = 4
BATCH = 32


def _hand_built(loss_net, net, sens):
    step = nn.TrainOneStepCell(loss_net, nn.SGD(net.trainable_params(), 1e4, loss_scale=sens), sens=sens)
    for x, y in classification_batches(2, BATCH):
        step(Tensor(x), Tensor(y))
    return params_of(net)


# MindSpore 2.10's CPU kernels have no bfloat16 MatMul, Tanh, Reshape or AddN (measured), and its GPU plugin (CUDA 11.6)
# was not seen to run these networks in bfloat16: bf16 runs on Ascend.
_BF16 = pytest.param(ms.bfloat16, marks=pytest.mark.skipif(
    ms.get_context("device_target") != "Ascend", reason="bfloat16 kernels for these networks: Ascend only"))


@pytest.mark.parametrize("dtype", [ms.float16, _BF16])
def test_loss_scale_hand_built_sens_reaches_every_micro_batch(dtype):
    ref_net = low_precision_mlp(dtype)
    initial = params_of(ref_net)
    expected = _hand_built(nn.WithLossCell(ref_net, SmallLoss()), ref_net, SCALE)
    net = low_precision_mlp(dtype)
    actual = _hand_built(GradAccumulationCell(nn.WithLossCell(net, SmallLoss()), K), net, SCALE)
    assert_same_update(actual, expected, initial)


def test_loss_scale_unscaled_micro_batches_underflow():
    # Negative control: the landed behaviour, micro-batch backward passes at scale 1 under the wrapper's sens.
    net = low_precision_mlp()
    initial = params_of(net)
    actual = _hand_built(GradAccumulationCell(nn.WithLossCell(net, SmallLoss()), K, loss_scale=1.0), net, SCALE)
    assert moved(actual, initial) < 0.5 * sum(v.size for v in initial.values())


# Under amp_level="O2" the loss itself is float16 and Model's sens is filled in its dtype: 2**16 would be inf.
MODEL_SCALE = 2.0 ** 12

# Model(amp_level="O2"/"O3") converts the whole loss network, the loss included: inside it every primitive's inputs are
# cast to float16 (measured: even after an explicit cast to float32), and GPU's SparseSoftmaxCrossEntropyWithLogits
# takes float32 only, so there the plain network fails as well. "backbone" converts only the network
# (amp.auto_mixed_precision casts its output back to float32), the form for every device.
_ON_GPU = ms.get_context("device_target") == "GPU"
_LOSS_IN_FLOAT16 = pytest.mark.skipif(_ON_GPU, reason="amp_level converts the loss too; GPU's sparse cross-entropy "
                                                      "kernel takes float32 only (the plain network fails as well)")


def _model_run(network_of, drop_overflow_update=False, amp_level="O2"):
    net = make_mlp()
    initial = params_of(net)
    backbone = ms.amp.auto_mixed_precision(net, "O2") if amp_level == "backbone" else net
    model = Model(network_of(nn.WithLossCell(backbone, SmallLoss())),
                  optimizer=nn.SGD(net.trainable_params(), 1e4, loss_scale=MODEL_SCALE),
                  amp_level="O0" if amp_level == "backbone" else amp_level,
                  loss_scale_manager=FixedLossScaleManager(MODEL_SCALE, drop_overflow_update=drop_overflow_update))
    model.train(1, classification_dataset(2, BATCH), dataset_sink_mode=False)
    return params_of(net), initial


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("amp_level", [pytest.param("O2", marks=_LOSS_IN_FLOAT16),
                                       pytest.param("O3", marks=_LOSS_IN_FLOAT16), "backbone"])
def test_loss_scale_model_amp_fixed_manager_trains_like_full_batch(amp_level):
    expected, initial = _model_run(lambda loss_net: loss_net, amp_level=amp_level)
    actual, _ = _model_run(lambda loss_net: GradAccumulationCell(loss_net, K), amp_level=amp_level)
    assert_same_update(actual, expected, initial)
    control, _ = _model_run(lambda loss_net: GradAccumulationCell(loss_net, K, loss_scale=1.0), amp_level=amp_level)
    assert moved(control, initial) < 0.5 * sum(v.size for v in initial.values())


@pytest.mark.skipif(ms.get_context("device_target") != "CPU", reason="a refusal of MindSpore's CPU backend only")
def test_loss_scale_model_refuses_dropping_manager_on_cpu():
    # MindSpore itself refuses FixedLossScaleManager(drop_overflow_update=True) on CPU; the supported way to
    # skip overflowing steps here is AccumulatingTrainOneStepCell(scale_sense=...), tested below.
    with pytest.raises(ValueError, match="are supported on device `CPU`"):
        _model_run(lambda loss_net: GradAccumulationCell(loss_net, K), drop_overflow_update=True)


@pytest.mark.slow
def test_loss_scale_functional_style_with_explicit_scale():
    initial = params_of(low_precision_mlp())
    expected = _functional_run(lambda loss_net, scaler, weights: loss_net)
    actual = _functional_run(lambda loss_net, scaler, weights: GradAccumulationCell(
            loss_net, K, loss_scale=scaler.scale_value, weights=weights))
    assert_same_update(actual, expected, initial)


@pytest.mark.slow
def test_loss_scale_fp32_training_bit_exact_whatever_the_scale_source():
    # A power-of-two sens: scaling inside and unscaling in float32 is exact, so fp32 results equal sens=1.
    batches = classification_batches(3, BATCH)
    expected, _, _ = reference_run(make_mlp, SmallLoss(), "momentum", batches)

    def run(sens, **kwargs):
        net = make_mlp()
        cell = GradAccumulationCell(nn.WithLossCell(net, SmallLoss()), 1, **kwargs)
        step = nn.TrainOneStepCell(cell, nn.Momentum(net.trainable_params(), 0.05, 0.9, loss_scale=sens), sens=sens)
        for x, y in batches:
            step(Tensor(x), Tensor(y))
        return params_of(net)

    assert_params_equal(run(1.0), expected)
    assert_params_equal(run(1024.0), expected)
    assert_params_equal(run(1024.0, loss_scale=1024.0), expected)


def test_loss_scale_read_from_the_wrapping_train_cell():
    # Bound from the root of the compile (_binding): the train cell's fixed sens; 1.0 where nothing is around.
    cell = GradAccumulationCell(nn.WithLossCell(make_mlp(), SmallLoss()), K)
    assert cell.loss_scale.value == 1.0          # nothing around it yet
    opt = nn.SGD(cell.trainable_params(), 0.1)
    assert cell.bind(nn.TrainOneStepCell(cell, opt, sens=512.0)) and cell.loss_scale.value == 512.0
    assert cell.bind(nn.TrainOneStepCell(cell, opt)) and cell.loss_scale.value == 1.0
    assert not cell.bind(nn.TrainOneStepCell(nn.WithLossCell(make_mlp(), SmallLoss()), opt, sens=512.0))
    assert cell.loss_scale.value == 1.0          # a tree without the cell binds nothing


@pytest.mark.slow
@pytest.mark.parametrize("micro", [False, True], ids=["window", "micro_batches"])
def test_loss_scale_accumulating_cell_scales_every_batch(micro):
    ref_net = low_precision_mlp()
    initial = params_of(ref_net)
    expected = _hand_built(nn.WithLossCell(ref_net, SmallLoss()), ref_net, SCALE)

    def run(scale):
        net = low_precision_mlp()
        if micro:   # K micro-batches of each batch, one optimizer step per batch
            cell = small_loss_train_cell(net, lambda loss_net: GradAccumulationCell(loss_net, K), scale_sense=scale)
            batches = classification_batches(2, BATCH)
        else:       # K consecutive quarter batches per optimizer step
            cell = small_loss_train_cell(net, accumulate_steps=K, scale_sense=scale)
            batches = [(x[i::K], y[i::K]) for x, y in classification_batches(2, BATCH) for i in range(K)]
        for x, y in batches:
            loss, overflow, returned_scale = cell(Tensor(x), Tensor(y))
            assert not overflow and float(returned_scale.asnumpy()) == scale and loss.shape == ()
        return params_of(net)

    assert_same_update(run(SCALE), expected, initial)
    # Negative control: the same cell at scale 1 loses most of the gradient to float16 underflow.
    assert moved(run(1.0), initial) < 0.5 * sum(v.size for v in initial.values())


def test_loss_scale_model_with_accumulating_cell_and_loss_monitor(capsys):
    net = low_precision_mlp()
    cell = small_loss_train_cell(net, lambda loss_net: GradAccumulationCell(loss_net, K),
                         scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 12, 2, 1000), max_grad_norm=1.0)
    initial = params_of(net)
    Model(cell).train(1, classification_dataset(2, BATCH), callbacks=[ms.train.LossMonitor(1)],
                      dataset_sink_mode=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if "loss is" in line]
    assert len(lines) == 2
    assert_params_moved(params_of(net), initial, min_change=0.0)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(scale_sense=True), TypeError, "the argument 'scale_sense' must be a positive finite float"),
    (dict(scale_sense="1024"), TypeError, "the argument 'scale_sense' must be a positive finite float"),
    (dict(scale_sense=0.0), ValueError, "the argument 'scale_sense' must be a positive finite float"),
    (dict(scale_sense=-8), ValueError,
     "the argument 'scale_sense' must be a positive finite float, a scalar Tensor, "
     "nn.DynamicLossScaleUpdateCell or nn.FixedLossScaleUpdateCell, but got -8 (int)"),
    (dict(scale_sense=float("inf")), ValueError, "the argument 'scale_sense' must be a positive finite float"),
    (dict(scale_sense=Tensor(np.ones(2, np.float32))), ValueError,
     "the argument 'scale_sense' must be a scalar Tensor (shape () or (1,))"),
    (dict(scale_sense=nn.ReLU()), TypeError, "the argument 'scale_sense' must be a positive finite float, a scalar "
     "Tensor, nn.DynamicLossScaleUpdateCell or nn.FixedLossScaleUpdateCell, but got ReLU() (ReLU)"),
    (dict(max_grad_norm=0), ValueError, "the argument 'max_grad_norm' must be None or a positive float, but got 0"),
    (dict(max_grad_norm=-1.0), ValueError, "the argument 'max_grad_norm' must be None or a positive float"),
    (dict(max_grad_norm=True), TypeError,
     "the argument 'max_grad_norm' must be None or a positive float, but got True"),
    (dict(max_grad_norm="1"), TypeError, "the argument 'max_grad_norm' must be None or a positive float, but got '1'"),
])
def test_loss_scale_bad_arguments_rejected(kwargs, error, message):
    net = make_mlp()
    with pytest.raises(error, match=re.escape("For 'AccumulatingTrainOneStepCell', " + message)):
        AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), 0.1), 1, **kwargs)


def test_loss_scale_optimizer_loss_scale_with_scale_sense_rejected():
    net = make_mlp()
    with pytest.raises(ValueError, match="the optimizer's loss_scale must be 1.0 when 'scale_sense' is given"):
        AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), 0.1, loss_scale=8.0),
                                     1, scale_sense=8.0)


@pytest.mark.parametrize("loss_scale, error, message", [
    (True, TypeError, "the argument 'loss_scale' must be None, a positive finite float, or a scalar Tensor or "
                      "Parameter, but got True (bool)"),
    (0, ValueError, "the argument 'loss_scale' must be None, a positive finite float"),
    (float("nan"), ValueError, "the argument 'loss_scale' must be None, a positive finite float"),
])
def test_loss_scale_bad_cell_loss_scale_rejected(loss_scale, error, message):
    with pytest.raises(error, match=re.escape("For 'GradAccumulationCell', " + message)):
        GradAccumulationCell(nn.WithLossCell(make_mlp(), ce()), 2, loss_scale=loss_scale)


# --- float16 without a loss scale is warned -----------------------------------------------------------------------

def _functional_run(network_of):
    """MindSpore's functional mixed-precision recipe: value_and_grad of scaler.scale(loss), then unscale (`network_of`
    gets the loss network, the scaler and the differentiated weights)."""
    scaler = ms.amp.StaticLossScaler(SCALE)
    net = low_precision_mlp()
    loss_net = network_of(nn.WithLossCell(net, SmallLoss()), scaler, net.trainable_params())

    def scaled_loss(x, y):
        return scaler.scale(loss_net(x, y))

    grad_fn = ms.value_and_grad(scaled_loss, None, net.trainable_params())
    opt = nn.SGD(net.trainable_params(), 1e4)
    for x, y in classification_batches(2, BATCH):
        _, grads = grad_fn(Tensor(x), Tensor(y))
        opt(scaler.unscale(grads))
    return params_of(net)


def _float16_warnings(record):
    return [str(w.message) for w in record if "computes in float16" in str(w.message)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE])
def test_loss_scale_float16_without_a_scale_warns_once_with_the_fix(mode):
    ms.set_context(mode=mode)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        actual = _functional_run(lambda loss_net, scaler, weights: GradAccumulationCell(loss_net, K, weights=weights))
    messages = _float16_warnings(record)
    assert len(messages) == 1, messages
    assert messages[0].startswith("GradAccumulationCell: the network computes in float16, but no loss scale reaches "
                                  "its micro-batch backward passes")
    assert "GradAccumulationCell(loss_net, micro_size, loss_scale=scaler.scale_value)" in messages[0]
    # What it warns about: the micro-batch gradients underflowed, so (nearly) nothing moved.
    initial = params_of(low_precision_mlp())
    assert moved(actual, initial) < 0.5 * sum(v.size for v in initial.values())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["loss_scale", "float32", "wrapper_sens", "accumulating_scale_sense"])
def test_loss_scale_no_float16_warning_when_a_scale_arrives_or_float32(case):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if case == "loss_scale":
            _functional_run(lambda loss_net, scaler, weights: GradAccumulationCell(
            loss_net, K, loss_scale=scaler.scale_value, weights=weights))
        elif case == "float32":
            net = make_mlp()
            _hand_built(GradAccumulationCell(nn.WithLossCell(net, SmallLoss()), K), net, 1.0)
        elif case == "wrapper_sens":
            net = low_precision_mlp()
            _hand_built(GradAccumulationCell(nn.WithLossCell(net, SmallLoss()), K), net, SCALE)
        else:
            net = low_precision_mlp()
            cell = small_loss_train_cell(net, lambda loss_net: GradAccumulationCell(loss_net, K), scale_sense=SCALE)
            cell(*(Tensor(a) for a in classification_batches(1, BATCH)[0]))
    assert not _float16_warnings(record)


def test_loss_scale_accumulating_cell_float16_without_scale_sense_warns():
    net = low_precision_mlp()
    cell = small_loss_train_cell(net, lambda loss_net: GradAccumulationCell(loss_net, K))
    with pytest.warns(UserWarning, match=r"AccumulatingTrainOneStepCell: the network computes in float16.*"
                                         r"scale_sense=nn.DynamicLossScaleUpdateCell"):
        cell(*(Tensor(a) for a in classification_batches(1, BATCH)[0]))


def test_loss_scale_float16_detection():
    assert computes_in_float16(make_mlp().to_float(ms.float16))
    assert computes_in_float16(ms.amp.auto_mixed_precision(make_mlp(), "O2"))
    assert not computes_in_float16(make_mlp())
    assert not computes_in_float16(make_mlp().to_float(ms.bfloat16))   # bfloat16 has float32's range: no underflow
