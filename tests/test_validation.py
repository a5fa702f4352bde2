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


def test_validation_weights_required_where_no_optimizer_is_around():
    # A functional loop (or a call of the cell itself) in graph mode: nothing says which weights are differentiated
    # (graph mode differentiates a frozen weight it is given), so the cell asks, with the one-line fix; given, it
    # trains (the negative control of the refusal).
    loss_net = _loss_net()
    weights = list(loss_net.get_parameters())
    frozen = weights[0]
    frozen.requires_grad = False
    cell = GradAccumulationCell(loss_net, 2)
    with pytest.raises(ValueError, match=r"the argument 'weights' is required where no optimizer is around the cell "
                                         r".* has parameters with requires_grad=False \(" + re.escape(frozen.name) +
                                         r"; 1 in all\), but it is None.* GradAccumulationCell\(WithLossCell\("
                                         r"\.\.\.\), micro_size, weights=optimizer\.parameters\)"):
        ms.value_and_grad(cell, None, list(loss_net.get_parameters()))(*_data(8))
    given = GradAccumulationCell(loss_net, 2, weights=weights)
    _, grads = ms.value_and_grad(given, None, weights)(*_data(8))
    assert len(grads) == len(weights) and all(g.asnumpy().any() for g in grads[1:])


def test_validation_pynative_follows_requires_grad_as_pynative_does():
    # PyNative mode differentiates the weights with requires_grad=True only, whatever value_and_grad is given (and
    # nothing hands the cell its surroundings there): the cell accumulates those, and matches the plain gradient,
    # the frozen weight's zero included (0.3.0 refused it here as in graph mode, reading the stack).
    ms.set_context(mode=ms.PYNATIVE_MODE)
    loss_net = _loss_net()
    weights = list(loss_net.get_parameters())
    weights[0].requires_grad = False
    _, expected = ms.value_and_grad(loss_net, None, weights)(*_data(8))
    _, grads = ms.value_and_grad(GradAccumulationCell(loss_net, 2), None, weights)(*_data(8))
    assert not expected[0].asnumpy().any() and all(g.asnumpy().any() for g in expected[1:])
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-6)


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
                "shape (8, 16) and input 1 ('label') has shape (6,). Every split input must hold one row per sample "
                "along axis 0; an input shared by the whole batch is declared in shared_inputs.")
    with pytest.raises(ValueError, match=re.escape(expected)):
        cell(x, y)
    # Per-row labels are not advised to be shared; a time-major input (T, B, F) is advised its batch axis, and an
    # input with axis 0 of 1 (position ids) to be declared shared.
    with pytest.raises(ValueError, match=r"If the batch axis of input 0 \('data'\) is axis 1 \(a time-major sequence "
                                         r"of shape \(T, B, \.\.\.\)\), give it batch-major") as caught:
        cell(Tensor(np.zeros((5, 8, 16), np.float32)), Tensor(np.zeros(8, np.int32)))
    assert "shared_inputs" not in str(caught.value)
    with pytest.raises(ValueError, match=r"If input 1 \('label'\) is shared by the whole batch .*shared_inputs=\(1,\)"):
        cell(x, Tensor(np.zeros((1, 8), np.int32)))


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
    assert "only with batch_norm='frozen'" in messages[0] and "GroupNorm or LayerNorm" in messages[0]


def test_validation_no_warning_without_batch_norm_or_when_silenced():
    # Dropout is not warned about (its masks under accumulation differ, equal in distribution), as the docstring says;
    # BatchNorm is (the control, below).
    assert "random draws (dropout, noise) differ, equal in distribution, and are not" in " ".join(
        GradAccumulationCell.__doc__.split())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradAccumulationCell(nn.WithLossCell(make_mlp(), ce()), 4)
        GradAccumulationCell(nn.WithLossCell(nn.SequentialCell(make_mlp(), nn.Dropout(p=0.3)), ce()), 4)
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


# --- mistakes a user makes, each answered with the package's own message (and a control that the right form trains) ---

def _step(kind, loss_net, optimizer, **kwargs):
    if kind == "GradAccumulationCell":
        return nn.TrainOneStepCell(GradAccumulationCell(loss_net, 4, **kwargs), optimizer)
    return AccumulatingTrainOneStepCell(loss_net, optimizer, 1, micro_size=4, **kwargs)


CELLS = ["GradAccumulationCell", "AccumulatingTrainOneStepCell"]


@pytest.mark.parametrize("kind", CELLS)
def test_validation_optimizer_over_another_networks_parameters_is_refused(kind):
    net, other = make_mlp(0), make_mlp(1)
    x, y = (Tensor(a) for a in classification_batches(1, 16)[0])
    message = re.escape(f"For '{kind}', the optimizer must update the network's parameters, but none of the 6 "
                        f"parameter(s) of SGD (") + r".* is one of WithLossCell's\. It would train nothing\."
    values = lambda: [param.asnumpy().copy() for param in net.get_parameters()]   # noqa: E731 (names change when wrapped)
    before = values()
    with pytest.raises(ValueError, match=message):   # AccumulatingTrainOneStepCell: at construction, before any step
        _step(kind, nn.WithLossCell(net, ce()), make_optimizer("sgd", other.trainable_params()))(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(values(), before))
    # Control: the same cell over the network's own parameters trains.
    _step(kind, nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()))(x, y)
    assert all(np.abs(a - b).max() > 1e-6 for a, b in zip(values(), before))


@pytest.mark.parametrize("kind", CELLS)
def test_validation_numpy_inputs_are_refused_naming_the_input(kind):
    net = make_mlp()
    x, y = classification_batches(1, 16)[0]
    step = _step(kind, nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()))
    with pytest.raises(TypeError, match=re.escape(
            f"For '{kind}', every input to split must be a mindspore.Tensor, but input 0 is a numpy.ndarray of shape "
            f"(16, 16). Pass mindspore.Tensor(array)")):
        step(x, Tensor(y))
    before = params_of(net)
    step(Tensor(x), Tensor(y))   # control: as Tensors it trains
    assert_params_moved(params_of(net), before)


class _CorrectCount(nn.Cell):
    """A 'loss' that is an integer: the number of correct predictions."""

    def __init__(self, cast: bool = False):
        super().__init__()
        self.net, self.cast, self.ce = make_mlp(), cast, ce()

    def construct(self, x, y):
        if self.cast:
            return self.ce(self.net(x), y)
        return (self.net(x).argmax(-1) == y).astype(ms.int32).sum()


@pytest.mark.parametrize("kind", CELLS)
def test_validation_integer_loss_is_refused_naming_its_dtype(kind):
    loss_net = _CorrectCount()
    x, y = (Tensor(a) for a in classification_batches(1, 16)[0])
    step = _step(kind, loss_net, make_optimizer("sgd", loss_net.trainable_params()))
    with pytest.raises(TypeError, match=re.escape(
            f"For '{kind}', the argument 'network' must return a floating-point loss (float16, bfloat16, float32 or "
            f"float64), but it returned Int")):
        step(x, y)
    # Control: the same network returning its float loss trains (and the check about reductions stays silent).
    loss_net = _CorrectCount(cast=True)
    step = _step(kind, loss_net, make_optimizer("sgd", loss_net.trainable_params()))
    before = params_of(loss_net)
    step(x, y)
    assert_params_moved(params_of(loss_net), before)


class _ClassScaled(nn.Cell):
    """Logits scaled by one weight per class: with 16 classes and a batch of 16, the weights' axis 0 equals the
    batch size, so the cell cannot tell them from a batched input unless they are declared shared."""

    def __init__(self):
        super().__init__()
        self.net = _seeded(nn.Dense(16, 16), 0)
        self.ce = ce()

    def construct(self, x, class_weights, y):
        return self.ce(self.net(x) * class_weights, y)


@pytest.mark.parametrize("kind", CELLS)
def test_validation_undeclared_shared_input_gets_the_shared_inputs_advice(kind):
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((16, 16)).astype(np.float32))
    w = Tensor(np.linspace(0.5, 1.5, 16).astype(np.float32))
    y = Tensor(rng.integers(0, 16, 16).astype(np.int32))
    loss_net = _ClassScaled()
    with pytest.raises(ValueError) as caught:
        _step(kind, loss_net, make_optimizer("sgd", loss_net.trainable_params()))(x, w, y)
    head = str(caught.value).split("C++ Call Stack")[0]
    assert f"For '{kind}', the error above was raised by the network running on" in head, head
    assert "input 1 ('class_weights')" in head and "declare it (e.g. shared_inputs=(1,))" in head, head
    # Control: declared, it trains exactly as the full batch.
    loss_net, reference = _ClassScaled(), _ClassScaled()
    step = _step(kind, loss_net, make_optimizer("sgd", loss_net.trainable_params()), shared_inputs=(1,))
    initial = [param.asnumpy().copy() for param in loss_net.get_parameters()]
    step(x, w, y)
    nn.TrainOneStepCell(reference, make_optimizer("sgd", reference.trainable_params()))(x, w, y)
    for actual, expected, start in zip(loss_net.get_parameters(), reference.get_parameters(), initial):
        np.testing.assert_allclose(actual.asnumpy(), expected.asnumpy(), rtol=1e-5, atol=1e-6)
        assert np.abs(actual.asnumpy() - start).max() > 1e-4


class _FixedBatchReshape(nn.Cell):
    """A loss network built for a batch of `rows` (the issue's: reshape(16, 3) of the logits and reshape(16) of y)."""

    def __init__(self, rows: int = 16):
        super().__init__()
        self.net, self.ce, self.rows = _seeded(nn.Dense(4, 3), 0), nn.CrossEntropyLoss(), rows

    def construct(self, x, y):
        return self.ce(self.net(x).reshape(self.rows, 3), y.reshape(self.rows))


def test_validation_fixed_batch_reshape_gets_the_micro_batch_context_in_graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    x, y = Tensor(rng.standard_normal((16, 4)).astype(np.float32)), Tensor(rng.integers(0, 3, 16).astype(np.int32))
    loss_net = _FixedBatchReshape()
    step = nn.TrainOneStepCell(GradAccumulationCell(loss_net, 4), nn.SGD(loss_net.trainable_params(), 0.1))
    with pytest.raises(ValueError) as caught:
        step(x, y)
    message = str(caught.value)
    head = message.split("C++ Call Stack")[0]   # before MindSpore's stacks: where a reader looks
    assert "For 'GradAccumulationCell', the error above was raised by the network running on" in head, message[-3000:]
    assert "micro_size=4 splits the batch of 16 rows into micro-batches of 4 rows" in head
    assert "must be built for the micro-batch's rows (4), not the batch's (16); then pass check_loss=False" in head
    # With the check off, the graph's own compile says the same (the micro-batch's graph fails on the reshape)...
    loss_net = _FixedBatchReshape()
    step = nn.TrainOneStepCell(GradAccumulationCell(loss_net, 4, check_loss=False),
                               nn.SGD(loss_net.trainable_params(), 0.1))
    with pytest.raises(ValueError, match="Reshape|reshape") as caught:
        step(x, y)
    assert "raised by the network running on a micro-batch, not on the whole batch" in \
        str(caught.value).split("C++ Call Stack")[0]
    # ... and, built for the micro-batch's rows as the message says, it trains.
    loss_net = _FixedBatchReshape(rows=4)
    step = nn.TrainOneStepCell(GradAccumulationCell(loss_net, 4, check_loss=False),
                               nn.SGD(loss_net.trainable_params(), 0.1))
    before = params_of(loss_net)
    step(x, y)
    assert_params_moved(params_of(loss_net), before)


def test_validation_fixed_batch_reshape_under_a_train_cell_of_ones_own_gets_the_context_of_the_compiled_layout():
    # A subclass of nn.TrainOneStepCell may change its inputs: the batch is not read from its call, the layout is the
    # one the engine's compile recorded (its CompileRecord), and the context comes where MindSpore's traceback runs
    # through the engine's call of the network.
    class OwnStep(nn.TrainOneStepCell):
        pass

    rng = np.random.default_rng(0)
    x, y = Tensor(rng.standard_normal((16, 4)).astype(np.float32)), Tensor(rng.integers(0, 3, 16).astype(np.int32))
    loss_net = _FixedBatchReshape()
    cell = GradAccumulationCell(loss_net, 4, check_loss=False)
    step = OwnStep(cell, nn.SGD(loss_net.trainable_params(), 0.1))
    with pytest.raises(ValueError, match="Reshape|reshape") as caught:
        step(x, y)
    head = str(caught.value).split("C++ Call Stack")[0]
    assert "raised by the network running on a micro-batch, not on the whole batch: micro_size=4 splits the batch " \
           "of 16 rows into micro-batches of 4 rows (input 0 (x) (16, 4) -> (4, 4)" in head, head[-2000:]
    assert cell.engine.scaled_loss.record.layout is not None


@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE], ids=["graph", "pynative"])
def test_validation_error_the_plain_step_raises_too_gets_no_micro_batch_paragraph(mode):
    # int64 labels into nn.CrossEntropyLoss: MindSpore refuses them for the full batch as well, so its message stands
    # alone (nothing about the split, check_loss=False or shared_inputs). Control: the plain step raises the same.
    ms.set_context(mode=mode)
    rng = np.random.default_rng(0)
    x, y = Tensor(rng.standard_normal((32, 16)).astype(np.float32)), Tensor(rng.integers(0, 4, 32).astype(np.int64))

    def message(wrap):
        net = _seeded(nn.Dense(16, 4), 0)
        step = nn.TrainOneStepCell(wrap(nn.WithLossCell(net, nn.CrossEntropyLoss())), nn.SGD(net.trainable_params()))
        with pytest.raises(TypeError) as caught:
            step(x, y)
        return str(caught.value)

    accumulated, plain = message(lambda loss_net: GradAccumulationCell(loss_net, 4)), message(lambda loss_net: loss_net)
    for text in (accumulated, plain):
        assert "For 'CrossEntropyLoss', the 'labels' should be Int32, but got 'mindspore.int64'" in text, text[-2000:]
    head = accumulated.split("C++ Call Stack")[0]
    assert not any(word in head for word in ("micro-batch", "check_loss", "shared_inputs")), head
