"""Every bad argument gets a clear error naming the argument, the value and what is expected."""
import re
import warnings

import numpy as np
import pytest
import mindspore as ms
from mindspore import nn, ops, Tensor

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from helpers import (_seeded, assert_params_close, assert_params_moved, ce, classification_batches, make_mlp,
                     make_optimizer, params_of, reference_run, train_steps)


def _loss_net():
    return nn.WithLossCell(make_mlp(), ce())


@pytest.mark.parametrize("micro_size, error, message", [
    (True, TypeError, "the argument 'micro_size' must be a positive int, but got True (bool)"),
    (2.0, TypeError, "the argument 'micro_size' must be a positive int, but got 2.0 (float)"),
    ("4", TypeError, "the argument 'micro_size' must be a positive int, but got '4' (str)"),
    (None, TypeError, "the argument 'micro_size' must be a positive int, but got None (NoneType)"),
    (np.bool_(True), TypeError, "the argument 'micro_size' must be a positive int, but got"),
    (0, ValueError, "the argument 'micro_size' must be a positive int, but got 0 (int)"),
    (-2, ValueError, "the argument 'micro_size' must be a positive int, but got -2 (int)"),
])
def test_validation_micro_size_rejected(micro_size, error, message):
    with pytest.raises(error, match=re.escape("For 'GradAccumulationCell', " + message)):
        GradAccumulationCell(_loss_net(), micro_size)


@pytest.mark.parametrize("network, message", [
    (None,
     "the argument 'network' must be a mindspore.nn.Cell returning a single-element loss, but got None (NoneType)"),
    (lambda x, y: x, "the argument 'network' must be a mindspore.nn.Cell returning a single-element loss, but got "
                     "<function"),
    ("net", "the argument 'network' must be a mindspore.nn.Cell returning a single-element loss, but got 'net' (str)"),
])
def test_validation_network_not_a_cell_rejected(network, message):
    with pytest.raises(TypeError, match=re.escape("For 'GradAccumulationCell', " + message)):
        GradAccumulationCell(network, 2)


def test_validation_network_without_parameters_rejected():
    with pytest.raises(ValueError, match=r"the argument 'network' must have parameters to train, but ReLU has none"):
        GradAccumulationCell(nn.ReLU(), 2)


def test_validation_network_with_no_trained_weight_when_compiled_rejected():
    # Frozen when built is allowed (it may be unfrozen before training); frozen when the graph compiles is not.
    frozen = _loss_net()
    for param in frozen.trainable_params():
        param.requires_grad = False
    cell = GradAccumulationCell(frozen, 2)
    with pytest.raises(ValueError, match=r"the network must have parameters to train when the graph compiles, but "
                                         r"none of WithLossCell's parameters has requires_grad=True"):
        ms.value_and_grad(cell, None, frozen.get_parameters())(*_data(8))


def test_validation_numpy_integer_micro_size_accepted():
    cell = GradAccumulationCell(_loss_net(), np.int64(4))
    assert cell.micro_size == 4 and type(cell.micro_size) is int


def _data(batch, classes=4):
    rng = np.random.RandomState(0)
    return Tensor(rng.randn(batch, 16).astype(np.float32)), Tensor(rng.randint(0, classes, batch).astype(np.int32))


def test_validation_batch_sizes_differ_rejected():
    cell = GradAccumulationCell(_loss_net(), 2)
    x, _ = _data(8)
    _, y = _data(6)
    expected = ("all inputs split into micro-batches must have the same batch size (axis 0), but input 0 ('data') has "
                "shape (8, 16) and input 1 ('label') has shape (6,). If input 1 ('label') is shared by the whole "
                "batch rather than one row per sample (e.g. position ids of shape (1, T)), declare it: "
                "shared_inputs=(1,).")
    with pytest.raises(ValueError, match=re.escape(expected)):
        cell(x, y)


class _PerSampleLoss(nn.Cell):
    def __init__(self):
        super().__init__()
        self.net = make_mlp()
        self.ce = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="none")

    def construct(self, x, y):
        return self.ce(self.net(x), y)


def test_validation_non_scalar_loss_rejected():
    cell = GradAccumulationCell(_PerSampleLoss(), 2)
    x, y = _data(8)
    expected = ("the argument 'network' must return a single-element loss (shape () or (1,)), but it returned shape "
                "(4,). "
                "Reduce the loss inside the network, e.g. with reduction='mean'")
    with pytest.raises(ValueError, match=re.escape(expected)):
        cell(x, y)


class _ScalarInputLoss(nn.Cell):
    def __init__(self):
        super().__init__()
        self.net = make_mlp()

    def construct(self, x, scale):
        return self.net(x).mean() * scale


def test_validation_input_without_any_batch_axis_rejected():
    # A 0-d Tensor reaches every micro-batch whole (tests/test_inputs.py); with no input to split there is no batch.
    cell = GradAccumulationCell(_ScalarInputLoss(), 2)
    with pytest.raises(ValueError, match=re.escape("no input can be split into micro_size=2 micro-batches: every "
                                                   "input is a 0-d Tensor, None, a number or declared in "
                                                   "shared_inputs=(0,)")):
        GradAccumulationCell(_ScalarInputLoss(), 2, shared_inputs=(0,))(_data(8)[0], Tensor(np.float32(2.0)))
    assert cell is not None


class _TupleLoss(nn.Cell):
    """Returns the tuple it is told to: (loss, count, extra) or (per-sample loss, count)."""

    def __init__(self, kind):
        super().__init__()
        self.net = make_mlp()
        self.kind = kind

    def construct(self, x, y):
        per_sample = self.net(x).mean(axis=1)
        if self.kind == "three":
            return per_sample.sum(), ops.ones((), ms.float32), per_sample.mean()
        return per_sample, ops.ones((), ms.float32)


@pytest.mark.parametrize("kind, described", [("three", "a tuple of 3 element(s) with shapes ((), (), ())"),
                                             ("vector", "a tuple of 2 element(s) with shapes ((4,), ())")])
def test_validation_other_tuple_outputs_rejected_with_per_token_loss(kind, described):
    cell = GradAccumulationCell(_TupleLoss(kind), 2, per_token_loss=True)
    x, y = _data(8)
    expected = ("For 'GradAccumulationCell', with per_token_loss=True the argument 'network' must return a tuple "
                "(loss_sum, count) of two single-element Tensors (e.g. the sum of a masked token loss and the number "
                "of valid tokens), "
                f"but it returned {described}. Return (loss_sum, count), or set per_token_loss=False for a mean loss.")
    with pytest.raises(ValueError, match=re.escape(expected)):
        cell(x, y)


@pytest.mark.parametrize("value, shown", [(1, "1 (int)"), (0, "0 (int)"), ("yes", "'yes' (str)")])
def test_validation_per_token_loss_not_a_bool_rejected(value, shown):
    with pytest.raises(TypeError, match=re.escape("For 'GradAccumulationCell', the argument 'per_token_loss' must be "
                                                  "a "
                                                  f"bool, but got {shown}.")):
        GradAccumulationCell(_loss_net(), 2, per_token_loss=value)
    if value is not None:   # None is AccumulatingTrainOneStepCell's default: False, or its GradAccumulationCell's
        net = make_mlp()
        with pytest.raises(TypeError, match=re.escape(f"For 'AccumulatingTrainOneStepCell', the argument "
                                                      f"'per_token_loss' must be a bool, but got {shown}.")):
            AccumulatingTrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.1), 1,
                                         per_token_loss=value)


# --- BatchNorm: warned, with the cells named ---------------------------------------------------------------

def _bn_net():
    return nn.SequentialCell(nn.Dense(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dense(32, 4))


def test_validation_batch_norm_is_warned_once_with_names_and_fix():
    with pytest.warns(UserWarning) as record:
        GradAccumulationCell(nn.WithLossCell(_bn_net(), ce()), 4)
    messages = [str(w.message) for w in record if "batch normalisation" in str(w.message)]
    assert len(messages) == 1
    assert "1 (BatchNorm1d)" in messages[0] and "micro_size=4" in messages[0]
    assert "moving averages are updated once per part" in messages[0] and "GroupNorm or LayerNorm" in messages[0]


def test_validation_no_warning_without_batch_norm_or_when_silenced():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradAccumulationCell(nn.WithLossCell(make_mlp(), ce()), 4)
        GradAccumulationCell(nn.WithLossCell(_bn_net(), ce()), 1)          # one micro-batch: nothing differs
        warnings.filterwarnings("ignore", message=re.escape("GradAccumulationCell: the network has batch normal"))
        GradAccumulationCell(nn.WithLossCell(_bn_net(), ce()), 4)


def test_validation_batch_norm_on_moving_statistics_is_not_warned_and_trains_exactly():
    # use_batch_statistics=False normalises with the moving statistics: micro-batches change nothing.
    def moving_bn_net():
        return _seeded(nn.SequentialCell(nn.Dense(16, 32), nn.BatchNorm1d(32, use_batch_statistics=False), nn.ReLU(),
                                         nn.Dense(32, 4)), 0)

    batches = classification_batches(3, 32)
    expected, _, initial = reference_run(moving_bn_net, ce(), "momentum", batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net = moving_bn_net()
        step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(net, ce()), 4),
                                   make_optimizer("momentum", net.trainable_params()))
    train_steps(step, batches)
    assert_params_moved(expected, initial)
    assert_params_close(params_of(net), expected, rtol=1e-5, atol=1e-6)
    # Control: the same BatchNorm on batch statistics is warned.
    with pytest.warns(UserWarning, match="batch normalisation"):
        GradAccumulationCell(nn.WithLossCell(_bn_net(), ce()), 4)


def test_validation_accumulating_cell_warns_for_batch_norm_across_batches():
    net = _bn_net()
    with pytest.warns(UserWarning, match="AccumulatingTrainOneStepCell: the network has batch normalisation"):
        AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), 0.1), 4)
