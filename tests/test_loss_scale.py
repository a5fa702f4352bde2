"""Mixed precision: the loss scale reaches every micro-batch backward, overflow skips the step, clipping once.

Low-precision networks here compute in float16/bfloat16 (``to_float``, or ``Model``'s ``amp_level="O2"``) with
float32 weights, and a loss small enough that unscaled float16 gradients underflow to zero.
"""
import re
import warnings

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor
from mindspore.train import FixedLossScaleManager, Model

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from ms_gradaccum._validation import computes_in_float16
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


def _model_run(network_of, drop_overflow_update=False, amp_level="O2"):
    net = make_mlp()
    initial = params_of(net)
    model = Model(network_of(nn.WithLossCell(net, _SmallLoss())),
                  optimizer=nn.SGD(net.trainable_params(), 1e4, loss_scale=MODEL_SCALE), amp_level=amp_level,
                  loss_scale_manager=FixedLossScaleManager(MODEL_SCALE, drop_overflow_update=drop_overflow_update))
    model.train(1, classification_dataset(2, BATCH), dataset_sink_mode=False)
    return params_of(net), initial


@pytest.mark.parametrize("amp_level", ["O2", "O3"])
def test_loss_scale_model_amp_fixed_manager_trains_like_full_batch(amp_level):
    expected, initial = _model_run(lambda loss_net: loss_net, amp_level=amp_level)
    actual, _ = _model_run(lambda loss_net: GradAccumulationCell(loss_net, K), amp_level=amp_level)
    _assert_same_update(actual, expected, initial)
    control, _ = _model_run(lambda loss_net: GradAccumulationCell(loss_net, K, loss_scale=1.0), amp_level=amp_level)
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
    assert cell.loss_scale.value == 1.0          # no train cell on the stack

    class Probe(nn.Cell):
        def __init__(self, wrapper):
            super().__init__()
            self.wrapper = wrapper

        def compile(self):  # a frame whose `self` holds the train cell, as Cell.compile's does
            return cell.loss_scale.value

    opt = nn.SGD(cell.trainable_params(), 0.1)
    assert Probe(nn.TrainOneStepCell(cell, opt, sens=512.0)).compile() == 512.0
    assert Probe(nn.TrainOneStepCell(cell, opt)).compile() == 1.0


# --- AccumulatingTrainOneStepCell(scale_sense=..., max_grad_norm=...) -------------------------------------

def _accumulating(net, network_of=lambda loss_net: loss_net, accumulate_steps=1, optimizer="sgd", **kwargs):
    opt = nn.SGD(net.trainable_params(), 1e4) if optimizer == "sgd" else make_optimizer(optimizer, net.trainable_params())
    return AccumulatingTrainOneStepCell(network_of(nn.WithLossCell(net, _SmallLoss())), opt, accumulate_steps,
                                        **kwargs)


@pytest.mark.parametrize("micro", [False, True], ids=["window", "micro_batches"])
def test_loss_scale_accumulating_cell_scales_every_batch(micro):
    ref_net = _low_precision_mlp()
    initial = params_of(ref_net)
    expected = _hand_built(nn.WithLossCell(ref_net, _SmallLoss()), ref_net, SCALE)

    def run(scale):
        net = _low_precision_mlp()
        if micro:   # K micro-batches of each batch, one optimizer step per batch
            cell = _accumulating(net, lambda loss_net: GradAccumulationCell(loss_net, K), scale_sense=scale)
            batches = classification_batches(2, BATCH)
        else:       # K consecutive quarter batches per optimizer step
            cell = _accumulating(net, accumulate_steps=K, scale_sense=scale)
            batches = [(x[i::K], y[i::K]) for x, y in classification_batches(2, BATCH) for i in range(K)]
        for x, y in batches:
            loss, overflow, returned_scale = cell(Tensor(x), Tensor(y))
            assert not overflow and float(returned_scale.asnumpy()) == scale and loss.shape == ()
        return params_of(net)

    _assert_same_update(run(SCALE), expected, initial)
    # Negative control: the same cell at scale 1 loses most of the gradient to float16 underflow.
    assert _moved(run(1.0), initial) < 0.5 * sum(v.size for v in initial.values())


_SCALE_STATE = ("scale_sense", "current_iterator_step", "last_overflow_iterator_step")


def _train_state(cell):
    """Everything an optimizer step may change, without the loss-scale state and the window counters."""
    return {p.name: p.asnumpy().copy() for p in cell.get_parameters()
            if p.name not in _SCALE_STATE and not p.name.startswith("accu_state.")}


def _poisoned(x, rows):
    x = x.copy()
    x[rows] = 1e5   # beyond float16's 65504: inf activations, non-finite loss and gradients
    return x


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_loss_scale_overflow_in_one_micro_batch_skips_the_step_exactly(where):
    micro = BATCH // K
    rows = {"first": [0], "middle": [2 * micro + 1], "last": [BATCH - 1]}[where]
    (x, y), (x2, y2) = classification_batches(2, BATCH)
    net = _low_precision_mlp()
    cell = _accumulating(net, lambda loss_net: GradAccumulationCell(loss_net, K), optimizer="adam",
                         scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 1000))
    cell(Tensor(x2), Tensor(y2))                      # one clean step first, so the Adam moments are non-zero
    before = _train_state(cell)
    _, overflow, scale = cell(Tensor(_poisoned(x, rows)), Tensor(y))
    assert bool(overflow) and float(scale.asnumpy()) == 2.0 ** 9      # lowered once
    assert_params_equal(_train_state(cell), before)                   # weights, moments, global_step
    assert not np.any(cell.grad_sums[0].asnumpy())                     # accumulators cleared

    _, overflow, _ = cell(Tensor(x), Tensor(y))                        # the next clean step trains ...
    twin_net = _low_precision_mlp()
    twin = _accumulating(twin_net, lambda loss_net: GradAccumulationCell(loss_net, K), optimizer="adam",
                         scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 1000))
    twin(Tensor(x2), Tensor(y2))
    twin.scale_sense.set_data(Tensor(2.0 ** 9, ms.float32))
    twin(Tensor(x), Tensor(y))
    assert not overflow
    assert_params_equal(params_of(net), params_of(twin_net))         # ... exactly as if the bad batch never came


def test_loss_scale_overflow_in_one_batch_of_a_window_skips_the_window():
    batches = classification_batches(3, 8)
    net = _low_precision_mlp()
    cell = _accumulating(net, accumulate_steps=3,
                         scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 1000))
    before = _train_state(cell)
    flags = []
    for i, (x, y) in enumerate(batches):
        _, overflow, scale = cell(Tensor(_poisoned(x, [3]) if i == 1 else x), Tensor(y))
        flags.append(bool(overflow))
    assert flags == [False, False, True] and float(scale.asnumpy()) == 2.0 ** 9
    assert_params_equal(_train_state(cell), before)
    assert cell.pending_batches == 0 and not np.any(cell.grad_sums[0].asnumpy())
    for x, y in batches:                                               # a clean window then trains
        _, overflow, _ = cell(Tensor(x), Tensor(y))
    assert not overflow
    assert_params_moved(params_of(net), {n: v for n, v in before.items() if n in params_of(net)}, min_change=0.0)


def test_loss_scale_dynamic_scale_grows_after_scale_window_clean_steps():
    net = _low_precision_mlp()
    cell = _accumulating(net, accumulate_steps=2, scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 4, 2, 2))
    scales = []
    for x, y in classification_batches(8, 8):   # 4 windows of 2 batches: the scale changes only at window ends
        scales.append(float(cell(Tensor(x), Tensor(y))[2].asnumpy()))
    assert scales == [16, 16, 16, 32, 32, 32, 32, 64]


def test_loss_scale_fixed_update_cell_skips_without_lowering():
    (x, y), = classification_batches(1, BATCH)
    cell = _accumulating(_low_precision_mlp(), scale_sense=nn.FixedLossScaleUpdateCell(2.0 ** 10))
    before = _train_state(cell)
    _, overflow, scale = cell(Tensor(_poisoned(x, [0])), Tensor(y))
    assert bool(overflow) and float(scale.asnumpy()) == 2.0 ** 10
    assert_params_equal(_train_state(cell), before)


def test_loss_scale_plain_tensor_scale_skips_overflowing_steps():
    (x, y), = classification_batches(1, BATCH)
    cell = _accumulating(_low_precision_mlp(), scale_sense=Tensor(2.0 ** 10, ms.float32))
    before = _train_state(cell)
    assert bool(cell(Tensor(_poisoned(x, [0])), Tensor(y))[1])
    assert_params_equal(_train_state(cell), before)


def test_loss_scale_resume_from_checkpoint_keeps_the_scale(tmp_path):
    batches = classification_batches(6, 8)
    poisoned = [(_poisoned(x, [0]) if i == 1 else x, y) for i, (x, y) in enumerate(batches)]

    def fresh():
        net = _low_precision_mlp()
        return net, _accumulating(net, accumulate_steps=2, optimizer="adam",
                                  scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 2))

    net, cell = fresh()
    for x, y in poisoned:
        cell(Tensor(x), Tensor(y))
    first_net, first = fresh()
    for x, y in poisoned[:3]:
        first(Tensor(x), Tensor(y))
    assert float(first.scale_sense.asnumpy()) == 2.0 ** 9                # lowered by the poisoned window
    path = str(tmp_path / "scaled.ckpt")
    ms.save_checkpoint(first, path)
    resumed_net, resumed = fresh()
    not_loaded, _ = ms.load_param_into_net(resumed, ms.load_checkpoint(path))
    assert not_loaded == [] and float(resumed.scale_sense.asnumpy()) == 2.0 ** 9
    for x, y in poisoned[3:]:
        resumed(Tensor(x), Tensor(y))
    assert float(resumed.scale_sense.asnumpy()) == float(cell.scale_sense.asnumpy()) == 2.0 ** 10  # regrown
    assert_params_equal(params_of(resumed_net), params_of(net))


# --- clipping ---------------------------------------------------------------------------------------------

class _ClippedStep(nn.TrainOneStepCell):
    """The reference: full-batch gradient, ops.clip_by_global_norm once, then the optimizer."""

    def __init__(self, network, optimizer, max_norm):
        super().__init__(network, optimizer)
        self.max_norm = max_norm

    def construct(self, *inputs):
        loss, grads = ms.value_and_grad(self.network, None, self.weights)(*inputs)
        return ops.depend(loss, self.optimizer(ops.clip_by_global_norm(grads, self.max_norm)))


MAX_NORM = 0.05


def _ce():
    return nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


@pytest.mark.parametrize("micro", [False, True], ids=["window", "micro_batches"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_loss_scale_clipping_once_per_step_matches_full_batch(micro, optimizer):
    batches = classification_batches(3, BATCH)
    ref_net = make_mlp()
    initial = params_of(ref_net)
    ref = _ClippedStep(nn.WithLossCell(ref_net, _ce()), make_optimizer(optimizer, ref_net.trainable_params()), MAX_NORM)
    for x, y in batches:
        ref(Tensor(x), Tensor(y))

    def run(max_grad_norm):
        net = make_mlp()
        loss_net = nn.WithLossCell(net, _ce())
        opt = make_optimizer(optimizer, net.trainable_params())
        if micro:
            cell = AccumulatingTrainOneStepCell(GradAccumulationCell(loss_net, K), opt, 1, max_grad_norm=max_grad_norm)
            feed = batches
        else:
            cell = AccumulatingTrainOneStepCell(loss_net, opt, K, max_grad_norm=max_grad_norm)
            feed = [(x[i::K], y[i::K]) for x, y in batches for i in range(K)]
        for x, y in feed:
            cell(Tensor(x), Tensor(y))
        return params_of(net)

    assert_params_moved(params_of(ref_net), initial)
    assert_params_close(run(MAX_NORM), params_of(ref_net), rtol=1e-5, atol=1e-6)
    # Negative control: without clipping the update differs (clipping is active at this max_grad_norm).
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(run(None), params_of(ref_net), rtol=1e-5, atol=1e-6)


def test_loss_scale_clipping_each_micro_batch_is_not_the_same():
    # Negative control for "once per step": clipping every quarter batch then averaging differs.
    batches = classification_batches(2, BATCH)
    ref_net = make_mlp()
    ref = _ClippedStep(nn.WithLossCell(ref_net, _ce()), nn.SGD(ref_net.trainable_params(), 0.1), MAX_NORM)
    for x, y in batches:
        ref(Tensor(x), Tensor(y))
    net = make_mlp()
    per_batch = _ClippedStep(nn.WithLossCell(net, _ce()), nn.SGD(net.trainable_params(), 0.1 / K), MAX_NORM)
    for x, y in batches:
        for i in range(K):
            per_batch(Tensor(x[i::K]), Tensor(y[i::K]))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(params_of(net), params_of(ref_net), rtol=1e-5, atol=1e-6)


def test_loss_scale_model_with_accumulating_cell_and_loss_monitor(capsys):
    net = _low_precision_mlp()
    cell = _accumulating(net, lambda loss_net: GradAccumulationCell(loss_net, K),
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
    (dict(scale_sense=-8), ValueError, "the argument 'scale_sense' must be a positive finite float, a scalar Tensor, "
                                       "nn.DynamicLossScaleUpdateCell or nn.FixedLossScaleUpdateCell, but got -8 (int)"),
    (dict(scale_sense=float("inf")), ValueError, "the argument 'scale_sense' must be a positive finite float"),
    (dict(scale_sense=Tensor(np.ones(2, np.float32))), ValueError,
     "the argument 'scale_sense' must be a scalar Tensor (shape () or (1,))"),
    (dict(scale_sense=nn.ReLU()), TypeError, "the argument 'scale_sense' must be a positive finite float, a scalar "
     "Tensor, nn.DynamicLossScaleUpdateCell or nn.FixedLossScaleUpdateCell, but got ReLU() (ReLU)"),
    (dict(max_grad_norm=0), ValueError, "the argument 'max_grad_norm' must be None or a positive float, but got 0"),
    (dict(max_grad_norm=-1.0), ValueError, "the argument 'max_grad_norm' must be None or a positive float"),
    (dict(max_grad_norm=True), TypeError, "the argument 'max_grad_norm' must be None or a positive float, but got True"),
    (dict(max_grad_norm="1"), TypeError, "the argument 'max_grad_norm' must be None or a positive float, but got '1'"),
])
def test_loss_scale_bad_arguments_rejected(kwargs, error, message):
    net = make_mlp()
    with pytest.raises(error, match=re.escape("For 'AccumulatingTrainOneStepCell', " + message)):
        AccumulatingTrainOneStepCell(nn.WithLossCell(net, _ce()), nn.SGD(net.trainable_params(), 0.1), 1, **kwargs)


def test_loss_scale_optimizer_loss_scale_with_scale_sense_rejected():
    net = make_mlp()
    with pytest.raises(ValueError, match="the optimizer's loss_scale must be 1.0 when 'scale_sense' is given"):
        AccumulatingTrainOneStepCell(nn.WithLossCell(net, _ce()), nn.SGD(net.trainable_params(), 0.1, loss_scale=8.0),
                                     1, scale_sense=8.0)


@pytest.mark.parametrize("loss_scale, error, message", [
    (True, TypeError, "the argument 'loss_scale' must be None, a positive finite float, or a scalar Tensor or Parameter, but got True (bool)"),
    (0, ValueError, "the argument 'loss_scale' must be None, a positive finite float"),
    (float("nan"), ValueError, "the argument 'loss_scale' must be None, a positive finite float"),
])
def test_loss_scale_bad_cell_loss_scale_rejected(loss_scale, error, message):
    with pytest.raises(error, match=re.escape("For 'GradAccumulationCell', " + message)):
        GradAccumulationCell(nn.WithLossCell(make_mlp(), _ce()), 2, loss_scale=loss_scale)


def test_loss_scale_nested_grad_accumulation_cell_rejected():
    net = make_mlp()
    nested = nn.SequentialCell([GradAccumulationCell(nn.WithLossCell(net, _ce()), 2)])
    with pytest.raises(ValueError, match="a GradAccumulationCell must be the 'network' itself"):
        AccumulatingTrainOneStepCell(nested, nn.SGD(net.trainable_params(), 0.1), 1)


# --- float16 without a loss scale is warned -----------------------------------------------------------------------

def _functional_run(network_of):
    """MindSpore's functional mixed-precision recipe: value_and_grad of scaler.scale(loss), then unscale."""
    scaler = ms.amp.StaticLossScaler(SCALE)
    net = _low_precision_mlp()
    loss_net = network_of(nn.WithLossCell(net, _SmallLoss()), scaler)

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


@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE])
def test_loss_scale_float16_without_a_scale_warns_once_with_the_fix(mode):
    ms.set_context(mode=mode)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        actual = _functional_run(lambda loss_net, scaler: GradAccumulationCell(loss_net, K))
    messages = _float16_warnings(record)
    assert len(messages) == 1, messages
    assert messages[0].startswith("GradAccumulationCell: the network computes in float16, but no loss scale reaches "
                                  "its micro-batch backward passes")
    assert "GradAccumulationCell(loss_net, micro_size, loss_scale=scaler.scale_value)" in messages[0]
    # What it warns about: the micro-batch gradients underflowed, so (nearly) nothing moved.
    initial = params_of(_low_precision_mlp())
    assert _moved(actual, initial) < 0.5 * sum(v.size for v in initial.values())


@pytest.mark.parametrize("case", ["loss_scale", "float32", "wrapper_sens", "accumulating_scale_sense"])
def test_loss_scale_no_float16_warning_when_a_scale_arrives_or_float32(case):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if case == "loss_scale":
            _functional_run(lambda loss_net, scaler: GradAccumulationCell(loss_net, K, loss_scale=scaler.scale_value))
        elif case == "float32":
            net = make_mlp()
            _hand_built(GradAccumulationCell(nn.WithLossCell(net, _SmallLoss()), K), net, 1.0)
        elif case == "wrapper_sens":
            net = _low_precision_mlp()
            _hand_built(GradAccumulationCell(nn.WithLossCell(net, _SmallLoss()), K), net, SCALE)
        else:
            net = _low_precision_mlp()
            cell = _accumulating(net, lambda loss_net: GradAccumulationCell(loss_net, K), scale_sense=SCALE)
            cell(*(Tensor(a) for a in classification_batches(1, BATCH)[0]))
    assert not _float16_warnings(record)


def test_loss_scale_accumulating_cell_float16_without_scale_sense_warns():
    net = _low_precision_mlp()
    cell = _accumulating(net, lambda loss_net: GradAccumulationCell(loss_net, K))
    with pytest.warns(UserWarning, match=r"AccumulatingTrainOneStepCell: the network computes in float16.*"
                                         r"scale_sense=nn.DynamicLossScaleUpdateCell"):
        cell(*(Tensor(a) for a in classification_batches(1, BATCH)[0]))


def test_loss_scale_float16_detection():
    assert computes_in_float16(make_mlp().to_float(ms.float16))
    assert computes_in_float16(ms.amp.auto_mixed_precision(make_mlp(), "O2"))
    assert not computes_in_float16(make_mlp())
    assert not computes_in_float16(make_mlp().to_float(ms.bfloat16))   # bfloat16 has float32's range: no underflow
