"""The loss contract: read from the loss network's graph on the first call (diagnostics.contract), and exact routes
for the losses zoos use that are not a row mean: a sum over rows or a mean times the batch size (reduction='sum', or
read from the graph), and a detector's ``B * numerator / max(S, 1)`` with ``S`` summed over the whole batch
(per_token_loss=True, min_count=1.0, reduction='sum'). Each against the plain full batch, with negative controls."""
import contextlib

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from ms_gradaccum.diagnostics import eager as _eager
from helpers import (assert_params_close, assert_params_moved, ce, classification_batches, make_mlp, make_optimizer,
                     params_of, train_steps, update_ratios)

K = 4


class SumLoss(nn.Cell):
    """Cross-entropy summed over the rows (``reduction='sum'``), or the mean times the rows it is given."""

    def __init__(self, net, form="sum"):
        super().__init__(auto_prefix=False)
        self.net, self.form = net, form
        self.summed = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="sum")
        self.mean = ce()

    def construct(self, x, y):
        if self.form == "sum":
            return self.summed(self.net(x), y)
        return self.mean(self.net(x), y) * x.shape[0]


class CentredLoss(nn.Cell):
    """Statistics over the batch inside the network: the logits centred on the batch's mean (rows coupled)."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net, self.mean = net, ce()

    def construct(self, x, y):
        logits = self.net(x)
        return self.mean(logits - logits.mean(axis=0, keep_dims=True), y)


class DetectorLoss(nn.Cell):
    """A detector's loss as a public zoo writes it: ``B * numerator / max(S, 1)``, where ``S`` sums target scores over
    the whole batch, computed from the predictions without gradient (an assigner's output), so ``S`` is a count."""

    def __init__(self, net, score_scale=1.0):
        super().__init__(auto_prefix=False)
        self.net, self.score_scale = net, score_scale
        self.per_row = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="none")

    def parts(self, x, y):
        logits = self.net(x)
        scores = ops.stop_gradient(ops.amax(ops.softmax(logits, -1), -1)) * self.score_scale
        return (self.per_row(logits, y) * scores).sum(), scores.sum()

    def construct(self, x, y):
        numerator, count = self.parts(x, y)
        return x.shape[0] * numerator / ops.maximum(count, 1.0)


class DetectorParts(DetectorLoss):
    """The route: the same loss as ``(numerator, S)``; the cell multiplies by the rows and floors the count at 1."""

    def construct(self, x, y):
        return self.parts(x, y)


def _train(make_loss, wrap, batches, optimizer="momentum"):
    net = make_mlp()
    loss_net = make_loss(net)
    initial = params_of(net)
    losses = train_steps(wrap(loss_net, make_optimizer(optimizer, net.trainable_params())), batches)
    return params_of(net), losses, initial


def _cell(**kwargs):
    return lambda loss_net, opt: nn.TrainOneStepCell(GradAccumulationCell(loss_net, K, **kwargs), opt)


def _steps(**kwargs):
    return lambda loss_net, opt: AccumulatingTrainOneStepCell(loss_net, opt, 1, micro_size=K, **kwargs)


WRAPS = [pytest.param(_cell, id="GradAccumulationCell"), pytest.param(_steps, id="AccumulatingTrainOneStepCell")]


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("form", ["sum", "mean_times_rows"])
@pytest.mark.parametrize("batch", [32, 30])   # 30 rows: micro-batches of 8, 8, 7, 7
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "read_from_graph"])
def test_contract_sum_route_trains_like_the_full_batch(wrap, form, batch, declared):
    # Declared (reduction='sum'), or nothing declared: the graph shows a sum (a mean times x.shape[0] too, the constant
    # confirmed to change with the rows), and the cell trains it as one.
    batches = classification_batches(3, batch)
    expected, expected_losses, initial = _train(lambda net: SumLoss(net, form), nn.TrainOneStepCell, batches, "sgd")
    actual, losses, _ = _train(lambda net: SumLoss(net, form), wrap(**({"reduction": "sum"} if declared else {})),
                               batches, "sgd")
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    # Negative control: the same loss taken as a mean (its check off) trains a quarter of the update.
    control, _, _ = _train(lambda net: SumLoss(net, form), wrap(check_loss=False), batches, "sgd")
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("score_scale", [1.0, 0.01], ids=["S>=1", "S<1"])
def test_contract_detector_route_trains_like_the_full_batch(wrap, score_scale):
    # S >= 1 and S < 1 (the floor binds): both exact through (numerator, S), min_count=1.0, reduction='sum'.
    batches = classification_batches(3, 32)
    expected, expected_losses, initial = _train(lambda net: DetectorLoss(net, score_scale), nn.TrainOneStepCell,
                                                batches, "sgd")
    actual, losses, _ = _train(lambda net: DetectorParts(net, score_scale),
                               wrap(per_token_loss=True, min_count=1.0, reduction="sum"), batches, "sgd")
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    # Negative control: without the floor (S < 1) or without the rows factor, it is not the full batch's.
    control_kwargs = dict(per_token_loss=True, reduction="sum") if score_scale < 1 else dict(per_token_loss=True,
                                                                                              min_count=1.0)
    control, _, _ = _train(lambda net: DetectorParts(net, score_scale), wrap(**control_kwargs), batches, "sgd")
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, rtol=1e-4, atol=1e-6)


# --- the check ----------------------------------------------------------------------------------------------------

def _first_step(make_loss, wrap, **kwargs):
    """(weights before, weights after, the error) of one step on one batch."""
    net = make_mlp()
    loss_net = make_loss(net)
    step = wrap(**kwargs)(loss_net, make_optimizer("sgd", net.trainable_params()))
    before = params_of(net)
    x, y = classification_batches(1, 32)[0]
    try:
        step(Tensor(x), Tensor(y))
        error = None
    except ValueError as caught:
        error = str(caught)
    return before, params_of(net), error


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("make_loss, what", [
    (CentredLoss, "coupled"),
    (lambda net: DetectorLoss(net, 1.0), "normalised"),
    (lambda net: DetectorLoss(net, 0.01), "normalised"),
], ids=["batch_statistics", "count_normalised", "count_normalised_floored"])
def test_contract_check_stops_a_broken_loss_before_any_update(wrap, make_loss, what):
    before, after, error = _first_step(make_loss, wrap)
    assert error is not None, "the check did not fire"
    head = error[:300]   # the cause and the way out come first, the loss named
    if what == "coupled":   # statistics over the batch: the primitive and where it runs named
        assert "the loss of CentredLoss" in head and "couples the rows" in head and "micro_size=1" in head, error
        assert "used on each row, at Sub in the network's own construct" in error, error
    else:   # a normalisation over the batch (S from the predictions; with the floor, B times a sum)
        assert "the loss of DetectorLoss" in head and "per_token_loss=True" in head, error
    assert "ratio inf" not in error and "the cell was told" not in error, error
    assert all(np.array_equal(after[name], before[name]) for name in before), "the weights moved"


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("make_loss, kwargs", [
    (lambda net: nn.WithLossCell(net, ce()), {}),
    (lambda net: SumLoss(net, "sum"), {"reduction": "sum"}),
    (lambda net: DetectorParts(net, 0.01), {"per_token_loss": True, "min_count": 1.0, "reduction": "sum"}),
    (lambda net: nn.WithLossCell(nn.SequentialCell(net, nn.Dropout(p=0.3)), ce()), {}),
    (lambda net: SumLoss(net, "sum"), {"check_loss": False}),
], ids=["mean", "sum_route", "detector_route", "dropout", "switched_off"])
def test_contract_check_is_silent_where_the_contract_holds(wrap, make_loss, kwargs):
    before, after, error = _first_step(make_loss, wrap, **kwargs)
    assert error is None, error
    assert any(not np.array_equal(after[name], before[name]) for name in before)


@pytest.mark.slow
def test_contract_check_fires_on_batch_norm_in_training_only_as_the_construction_warning():
    # BatchNorm's per-micro-batch statistics are a documented approximation (warned at construction); the graph's rules
    # take BatchNorm as row-wise (its own case), so it does not make the network "coupled". Control: statistics over the
    # batch of one's own on the same network still stop.
    def bn_net(net):
        return nn.WithLossCell(nn.SequentialCell(nn.Dense(16, 16), nn.BatchNorm1d(16), net), ce())

    with pytest.warns(UserWarning, match="batch normalisation"):
        _, _, error = _first_step(bn_net, _cell)
    assert error is None, error
    with pytest.warns(UserWarning, match="batch normalisation"):
        _, _, error = _first_step(lambda net: CentredLoss(nn.SequentialCell(nn.Dense(16, 16), nn.BatchNorm1d(16),
                                                                            net)), _cell)
    assert error is not None and "couples the rows" in error, error


class OwnTrainCell(nn.TrainOneStepCell):
    """A train cell of one's own: a subclass may change the inputs it hands the network, so the package cell cannot
    take the batch from it before the graph compiles; the graph runs the check's pass itself."""


def _in_own_train_cell(**kwargs):
    return lambda loss_net, opt: OwnTrainCell(GradAccumulationCell(loss_net, K, **kwargs), opt)


# --- where the check's pass runs ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
def test_contract_check_reads_the_graph_of_a_network_that_runs_only_in_graph_mode(wrap):
    # No eager pass: a network that refuses PyNative calls is read from its graph, a sum trained as one (exact), a
    # coupled loss stopped naming the primitive, before any update.
    batches = classification_batches(2, 32)
    expected, _, initial = _train(lambda net: SumLoss(net, "sum"), nn.TrainOneStepCell, batches, "sgd")
    actual, _, _ = _train(lambda net: GraphOnlyLoss(SumLoss(net, "sum")), wrap(), batches, "sgd")
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-4, atol=1e-6)
    before, after, error = _first_step(lambda net: GraphOnlyLoss(CentredLoss(net)), wrap)
    assert error is not None and "couples the rows" in error and "at Sub" in error, error
    assert all(np.array_equal(after[name], before[name]) for name in before), "the weights moved"


class LabelsNotMinusOne(nn.Cell):
    """``ops.cross_entropy`` leaving out the labels that are -1: a mean over a count taken from the labels."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net = net

    def construct(self, x, y):
        return ops.cross_entropy(self.net(x), y, ignore_index=-1)


@pytest.mark.slow
def test_contract_check_reads_the_compiled_step_where_the_batch_does_not_reach_the_cell_beforehand():
    # A train cell of one's own (it may change the inputs it hands the network): the batch reaches the package cell only
    # inside the graph, so the contract is read from the compiled step's graph, before it runs. A coupled loss stops
    # (at every call) with no weight moved; a sum and a mean over labels other than -1 train as what they are, exactly
    # like the full batch (the step compiled again for that kind); control: with the check off, the row mean is off.
    net = make_mlp()
    step = _in_own_train_cell()(CentredLoss(net), make_optimizer("sgd", net.trainable_params()))
    before = params_of(net)
    x, y = classification_batches(1, 32)[0]
    for _ in range(2):
        with pytest.raises(ValueError, match="couples the rows"):
            step(Tensor(x), Tensor(y))
    assert all(np.array_equal(value, before[name]) for name, value in params_of(net).items()), "the weights moved"
    batches = classification_batches(3, 32)
    for _, y in batches[1:]:
        y[:5], y[10:12] = -1, -1   # irregular from step 2: the counts differ between micro-batches
    for make_loss in (lambda net: SumLoss(net, "sum"), LabelsNotMinusOne):
        expected, _, initial = _train(make_loss, nn.TrainOneStepCell, batches, "momentum")
        actual, _, _ = _train(make_loss, _in_own_train_cell(), batches, "momentum")
        assert_params_moved(expected, initial)
        assert_params_close(actual, expected, rtol=1e-4, atol=1e-6)
    wrong, _, _ = _train(LabelsNotMinusOne, _in_own_train_cell(check_loss=False), batches, "momentum")
    assert max(update_ratios(wrong, expected, initial).values()) > 1e-2   # control: the row mean is off


class GraphOnlyLoss(nn.Cell):
    """Wraps a loss network that does not run eagerly (as one written only for graph mode): PyNative calls fail."""

    def __init__(self, loss_net):
        super().__init__(auto_prefix=False)
        self.loss_net = loss_net

    def __call__(self, *args, **kwargs):
        if ms.get_context("mode") == ms.PYNATIVE_MODE:
            raise RuntimeError("this network runs in graph mode only")
        return super().__call__(*args, **kwargs)

    def construct(self, x, y):
        return self.loss_net(x, y)


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("wrap", WRAPS)
def test_contract_check_runs_on_the_first_batch_the_step_is_compiled_or_called_with(wrap):
    # The contract is read before a graph compiles: step.compile() on one batch reads it for that batch's layout, and a
    # loss that breaks it stops there, before anything compiles or trains; one that keeps it trains on another batch.
    net = make_mlp()
    step = wrap()(nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()))
    (x, y), (x2, y2) = classification_batches(2, 32)
    step.compile(Tensor(x), Tensor(y))
    before = params_of(net)
    step(Tensor(x2 * 3.0), Tensor(y2))
    assert any(not np.array_equal(value, before[name]) for name, value in params_of(net).items())
    # Control: the check is on in this flow: a coupled loss stops at the compile, and at every call until it is fixed.
    net = make_mlp()
    before = params_of(net)
    step = wrap()(CentredLoss(net), make_optimizer("sgd", net.trainable_params()))
    for run in (step.compile, step):
        with pytest.raises(ValueError, match="couples the rows"):
            run(Tensor(x), Tensor(y))
    assert all(np.array_equal(value, before[name]) for name, value in params_of(net).items()), "the weights moved"


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
def test_contract_check_in_pynative_mode(wrap):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    before, after, error = _first_step(CentredLoss, wrap)
    assert error is not None and "couples the rows" in error, error
    assert all(np.array_equal(after[name], before[name]) for name in before), "the weights moved"
    before, after, error = _first_step(lambda net: nn.WithLossCell(net, ce()), wrap)
    assert error is None, error
    assert any(not np.array_equal(after[name], before[name]) for name in before)


@pytest.mark.slow
def test_contract_check_leaves_batch_norm_moving_statistics_as_they_were():
    # The check's pass is not a training step: with it and without it (check_loss=False), one step leaves the same
    # moving statistics and weights. (Its noise tolerance for BatchNorm: the test above.)
    def run(check_loss):
        net = nn.SequentialCell(nn.Dense(16, 16), nn.BatchNorm1d(16), make_mlp())
        for param in net.get_parameters():   # the same start for both runs
            param.set_data(Tensor(np.full(param.shape, 0.01 * (hash(param.name) % 7), np.float32)))
        step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(net, ce()), K, check_loss=check_loss),
                                   make_optimizer("sgd", net.trainable_params()))
        step.set_train()   # BatchNorm on batch statistics, updating its moving ones
        x, y = classification_batches(1, 32)[0]
        step(Tensor(x), Tensor(y))
        return {p.name: p.asnumpy().copy() for p in net.get_parameters()}

    with pytest.warns(UserWarning, match="batch normalisation"):
        checked, unchecked = run(True), run(False)
    assert any("moving_mean" in name for name in checked)
    for name, value in checked.items():
        np.testing.assert_array_equal(value, unchecked[name], err_msg=name)


class SharedAttention(nn.Cell):
    """One ``nn.MultiheadAttention`` used for cross-attention, then for self-attention: its ``__call__`` records whether
    key is value and query is key, and graph mode compiles its ``construct`` for what the last call recorded."""

    def __init__(self):
        super().__init__()
        self.memory = nn.Dense(8, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Dense(8, 1)
        self.loss = nn.MSELoss()
        for index, param in enumerate(self.trainable_params()):
            param.set_data(Tensor(np.random.RandomState(index).randn(*param.shape).astype(np.float32) * 0.3))

    def construct(self, x, y):
        hidden = self.attention(x, self.memory(x), self.memory(x))[0]
        hidden = self.attention(hidden, hidden, hidden)[0]
        return self.loss(self.head(hidden).squeeze(-1), y)


def _attention_run(wrap, optimizer):
    net = SharedAttention()
    initial = params_of(net)
    rng = np.random.RandomState(0)
    batches = [(rng.randn(8, 5, 8).astype(np.float32), rng.randn(8, 5).astype(np.float32)) for _ in range(2)]
    train_steps(wrap(net, make_optimizer(optimizer, net.trainable_params())), batches)
    return params_of(net), initial, (net.attention.k_is_v, net.attention.q_is_k)


@pytest.mark.slow
@pytest.mark.parametrize("wrap, optimizer", [(_cell, "adam"), (_steps, "momentum")],
                         ids=["GradAccumulationCell-adam", "AccumulatingTrainOneStepCell-momentum"])
def test_contract_check_leaves_what_a_cell_s_own_call_set_as_it_was(wrap, optimizer, monkeypatch):
    # An eager pass calls nn.MultiheadAttention's own __call__; left as the pass's last call set them, its flags would
    # compile the cross-attention as self-attention. The graph is read without a pass; the cells train as the plain
    # full batch does.
    expected, initial, _ = _attention_run(nn.TrainOneStepCell, optimizer)
    actual, _, flags = _attention_run(wrap(), optimizer)
    assert flags == (False, False)   # as graph mode leaves them
    assert_params_moved(actual, initial)
    assert_params_close(actual, expected, rtol=1e-4, atol=1e-5)

    # Negative control: where the graph leaves the contract undecided before the compile (the route semi-auto parallel
    # takes: the network read, and run, stand-alone first), the eager comparison runs the network; without putting the
    # flags back, the same network trains otherwise than the full batch, silently (the comparison of eager passes with
    # each other cannot see that the graph compiled another branch).
    from ms_gradaccum.diagnostics import calls, contract   # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(calls, "parallel_pass_in_force", lambda: True)
    monkeypatch.setattr(contract.LossContract, "read_graph", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(_eager, "call_state_kept", lambda network: contextlib.nullcontext())
    wrong, _, flags = _attention_run(wrap(), optimizer)
    assert flags == (True, True)
    assert max(np.abs(wrong[name] - expected[name]).max() for name in expected) > 1e-3


class SharedAttentionFixedBatch(SharedAttention):
    """:class:`SharedAttention` built for a batch of 8 (a reshape to it): it fails on every micro-batch."""

    def construct(self, x, y):
        hidden = self.attention(x, self.memory(x), self.memory(x))[0]
        hidden = self.attention(hidden, hidden, hidden)[0]
        return self.loss(self.head(hidden).reshape(8, 5), y)


@pytest.mark.parametrize("check_loss", [True, False])
def test_contract_error_path_leaves_what_a_cell_s_own_call_set_as_it_was(check_loss, monkeypatch):
    # The error on a micro-batch is found by an eager pass: the check's (check_loss=True), or the error decoration's
    # tries after the compile failed (check_loss=False). Both run the network through one function, which puts back
    # what nn.MultiheadAttention's __call__ recorded: after the error its flags are as graph mode leaves them.
    rng = np.random.RandomState(0)
    x, y = Tensor(rng.randn(8, 5, 8).astype(np.float32)), Tensor(rng.randn(8, 5).astype(np.float32))

    def flags_after_the_error():
        net = SharedAttentionFixedBatch()
        step = nn.TrainOneStepCell(GradAccumulationCell(net, K, check_loss=check_loss),
                                   make_optimizer("sgd", net.trainable_params()))
        with pytest.raises(ValueError) as caught:
            step(x, y)
        assert "raised by the network running on" in str(caught.value).split("C++ Call Stack")[0], str(caught.value)
        return net.attention.k_is_v, net.attention.q_is_k

    assert flags_after_the_error() == (False, False)
    # Negative control: without putting them back, the error path leaves the last eager call's flags.
    monkeypatch.setattr(_eager, "call_state_kept", lambda network: contextlib.nullcontext())
    assert flags_after_the_error() == (True, True)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"reduction": "max"}, ValueError, r"the argument 'reduction' must be 'mean' \(a mean over the rows it is given\) "
                                       r"or 'sum'"),
    ({"reduction": 1}, TypeError, r"the argument 'reduction' must be 'mean'"),
    ({"min_count": -1.0}, ValueError, r"the argument 'min_count' must be a finite float >= 0"),
    ({"min_count": True}, TypeError, r"the argument 'min_count' must be a finite float >= 0"),
    ({"min_count": 1.0}, ValueError, r"'min_count' must be a finite float >= 0 .* with per_token_loss=True"),
    ({"check_loss": 1}, TypeError, r"the argument 'check_loss' must be a bool, but got 1 \(int\)"),
])
def test_contract_bad_arguments_are_refused(kwargs, error, match):
    net = make_mlp()
    with pytest.raises(error, match=match):
        GradAccumulationCell(nn.WithLossCell(net, ce()), K, **kwargs)
    with pytest.raises(error, match=match):
        AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()), 1,
                                     **kwargs)


# --- errors the network raises inside the micro-batch graph -------------------------------------------------------

class FixedBatchWeights(nn.Cell):
    """A loss built for a fixed batch size (per-row weights of the batch's rows), as zoo configs build CTC losses."""

    def __init__(self, net, batch):
        super().__init__(auto_prefix=False)
        self.net, self.weights = net, Tensor(np.ones(batch, np.float32))
        self.per_row = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="none")

    def construct(self, x, y):
        return (self.per_row(self.net(x), y) * self.weights).mean()


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
def test_contract_network_errors_on_a_micro_batch_say_where_they_happened(wrap):
    net = make_mlp()
    step = wrap()(FixedBatchWeights(net, 30), make_optimizer("sgd", net.trainable_params()))
    x, y = classification_batches(1, 30)[0]
    with pytest.raises(ValueError) as caught:
        step(Tensor(x), Tensor(y))
    message = str(caught.value)
    # The check's eager pass meets the error first, on the first micro-batch (it runs on the whole batch, so the split
    # is the cause); the context comes right after MindSpore's first line, before its stacks.
    assert "the error above was raised by the network running on a micro-batch, not on the whole batch: micro_size=4 " \
           "splits the batch of 30 rows into micro-batches of 8 and 7 rows (input 0 (x) (30, 16) -> (8 and 7, 16), " \
           "input 1 (y) (30,) -> (8 and 7,))" in message.split("C++ Call Stack")[0], message[-800:]
    assert "must be built for the micro-batch's rows (8 and 7), not the batch's (30); then pass check_loss=False" \
        in message
    # Built for the micro-batch, it trains, the check on: the contract is read from the graph of a micro-batch, and no
    # pass runs on two micro-batches together (as the probe's comparison did, which such a network refused).
    net = make_mlp()
    x, y = classification_batches(1, 32)[0]
    step = wrap()(FixedBatchWeights(net, 8), make_optimizer("sgd", net.trainable_params()))
    before = params_of(net)
    step(Tensor(x), Tensor(y))
    assert any(not np.array_equal(value, before[name]) for name, value in params_of(net).items())


def test_contract_other_compile_errors_are_left_as_they_are():
    # Control: the same network error in a plain train cell gets no micro-batch note.
    net = make_mlp()
    step = nn.TrainOneStepCell(FixedBatchWeights(net, 30), make_optimizer("sgd", net.trainable_params()))
    x, y = classification_batches(1, 32)[0]
    with pytest.raises(ValueError) as caught:
        step(Tensor(x), Tensor(y))
    assert "micro-batch" not in str(caught.value)


class FixedBatchReshape(nn.Cell):
    """A loss that reshapes the network's output to the batch's rows, written for a batch of 32."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net, self.loss = net, nn.MSELoss()

    def construct(self, x, y):
        return self.loss(self.net(x).reshape(32, 4), y)


class GraphSyntaxError(nn.Cell):
    """A loss whose construct graph mode cannot parse (try/except): not an error of the micro-batch."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net, self.loss = net, ce()

    def construct(self, x, y):
        try:
            out = self.net(x)
        except ValueError:
            out = x
        return self.loss(out, y)


@pytest.mark.parametrize("wrap", WRAPS)
def test_contract_reshape_errors_on_a_micro_batch_say_where_they_happened_and_syntax_errors_do_not(wrap):
    # MindSpore's Reshape error names shapes only ({8, 4} vs {32, 4}) and its traceback is cut before the package's
    # frames: the micro-batch note comes from the package's own mark and an eager run of one micro-batch.
    net = make_mlp()
    x, _ = classification_batches(1, 32)[0]
    y = np.zeros((32, 4), np.float32)
    with pytest.raises(ValueError) as caught:
        step = wrap(check_loss=False)(FixedBatchReshape(net), make_optimizer("sgd", net.trainable_params()))
        step(Tensor(x), Tensor(y))
    message = str(caught.value)
    assert "For primitive[Reshape]" in message and "raised by the network running on a micro-batch, not on the " \
        "whole batch: micro_size=4 splits the batch of 32 rows into micro-batches of 8 rows" in message, message[-800:]
    # Control: a graph-only syntax error from the network is MindSpore's alone (no fixed-batch hint).
    x, y = classification_batches(1, 32)[0]
    with pytest.raises(Exception) as caught:
        wrap()(GraphSyntaxError(net), make_optimizer("sgd", net.trainable_params()))(Tensor(x), Tensor(y))
    assert "Try" in str(caught.value) and "micro-batch" not in str(caught.value), str(caught.value)[-800:]


# --- losses normalised by their data, beyond the first step (the rows of issue 60's table) ---------------------------

class MaskedMean(nn.Cell):
    """A hand-written masked mean: ``(loss * mask).sum() / mask.sum()``."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net, self.per_row = net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="none")

    def construct(self, x, y, mask):
        return (self.per_row(self.net(x), y) * mask).sum() / mask.sum()


class SampleWeightedMean(MaskedMean):
    """A sample-weighted mean: ``(weight * loss).sum() / weight.sum()``, weights in [0.1, 2]."""


def _masked_batches(steps, ragged_from, empty=False, weights=False, batch=32, seed=5):
    """(x, y, mask): all ones before step `ragged_from`, ragged after (a valid row in every micro-batch); with `empty`,
    no valid row in the second micro-batch of the first step; with `weights`, sample weights in [0.1, 2] instead."""
    rng = np.random.RandomState(seed)
    batches = []
    for step, (x, y) in enumerate(classification_batches(steps, batch, seed=seed)):
        if weights:
            mask = rng.uniform(0.1, 2.0, batch).astype(np.float32)
        else:
            mask = np.ones(batch, np.float32)
            if step >= ragged_from:
                mask = (rng.rand(batch) < np.linspace(0.1, 0.95, batch)).astype(np.float32)
                mask[::batch // K] = 1.0
        if empty and step == 0:
            mask[batch // K:2 * batch // K] = 0.0
        batches.append((x, y, mask))
    return batches


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
def test_contract_masked_mean_is_counted_through_its_mask_even_when_it_is_all_ones_on_step_1(wrap):
    # All ones on step 1 (a row mean there, by value), ragged from step 2: the graph shows a sum over a count of input
    # 2, which the cell takes per micro-batch on every step: exact. Control: with the check off it trains on, away
    # from the full batch.
    batches = _masked_batches(3, ragged_from=1)
    assert (batches[0][2] == 1).all()
    expected, _, initial = _train(MaskedMean, nn.TrainOneStepCell, batches)
    actual, _, _ = _train(MaskedMean, wrap(), batches)
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-4, atol=1e-6)
    control, _, _ = _train(MaskedMean, wrap(check_loss=False), batches)
    assert max(update_ratios(control, expected, initial).values()) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
def test_contract_masked_mean_with_an_empty_micro_batch_trains_exactly_or_stops_naming_it(wrap):
    # No valid row in micro-batch 1 of the first step: its mean is 0/0, the full batch's is finite. Read from the
    # graph, the mean over the mask's sum is counted per micro-batch and the empty one adds nothing: exact, as the
    # full batch. Declared a row mean (the check off), the engine's own check stops the step before any update,
    # naming the micro-batch, its rows and the route; declared (loss_sum, count), it trains exactly too.
    batches = _masked_batches(2, ragged_from=5, empty=True)
    expected, losses, initial = _train(MaskedMean, nn.TrainOneStepCell, batches)
    assert np.isfinite(losses).all()
    assert_params_moved(expected, initial)
    actual, _, _ = _train(MaskedMean, wrap(), batches)
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    net = make_mlp()
    before = params_of(net)
    step = wrap(check_loss=False)(MaskedMean(net), make_optimizer("momentum", net.trainable_params()))
    with pytest.raises(ValueError, match=r"micro-batch 1 \(rows 8 to 15 of the batch of 32, micro_size=4\) "
                                         r"returned a non-finite loss or count .* per_token_loss=True"):
        step(*(Tensor(a) for a in batches[0]))
    assert all(np.array_equal(value, before[name]) for name, value in params_of(net).items()), "the weights moved"

    class MaskedParts(MaskedMean):
        def construct(self, x, y, mask):
            return (self.per_row(self.net(x), y) * mask).sum(), mask.sum()

    actual, _, _ = _train(MaskedParts, wrap(per_token_loss=True), batches)
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)


def _zero_head(net):
    """`net` with its last layer zero: every row's loss is log(classes) until training moves it (the issue's "per-row
    losses alike at initialisation")."""
    head = net[-1]
    ops.assign(head.weight, ops.zeros_like(head.weight))
    ops.assign(head.bias, ops.zeros_like(head.bias))
    return net


@pytest.mark.slow
def test_contract_sample_weighted_mean_with_alike_losses_trains_exactly():
    # Per-row losses alike at initialisation (a zero last layer): a sample-weighted mean's loss values combine on step
    # 1 whatever it is. Its graph shows a sum over the weights' sum (input 2): counted per micro-batch, exact on every
    # step, as the public check reports. Control: check_loss=False trains on, off.
    from ms_gradaccum import check_loss_contract   # pylint: disable=import-outside-toplevel
    from ms_gradaccum.core.input_count import InputCountMean   # pylint: disable=import-outside-toplevel
    batches = _masked_batches(7, ragged_from=0, weights=True, seed=11)
    report = check_loss_contract(SampleWeightedMean(_zero_head(make_mlp())), tuple(Tensor(a) for a in batches[0]), K)
    assert isinstance(report.kind, InputCountMean) and report.kind.position == 2 and report.count_input == 2
    assert report.read_from_graph and report.rows_compared == 0, report

    def zero_headed(loss_net_of):
        return lambda net: loss_net_of(_zero_head(net))

    expected, _, initial = _train(zero_headed(SampleWeightedMean), nn.TrainOneStepCell, batches)
    actual, _, _ = _train(zero_headed(SampleWeightedMean), _cell(), batches)
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-4, atol=1e-6)
    control, _, _ = _train(zero_headed(SampleWeightedMean), _cell(check_loss=False), batches)
    assert max(update_ratios(control, expected, initial).values()) > 0.1


def test_contract_public_check_on_a_batch_of_ones_choosing():
    # check_loss_contract reads the contract as the cells do and reports what the graph showed: a row mean; a masked
    # mean counted through its mask (input 2), whatever its masks hold; a coupled loss stopped with the route in its
    # own arguments; nothing is trained.
    from ms_gradaccum import LossContractReport, RowMean, check_loss_contract   # pylint: disable=C0415
    uniform, _ = _masked_batches(2, ragged_from=1)
    net = make_mlp()
    before = [param.asnumpy().copy() for param in net.trainable_params()]
    x, y, _ = uniform
    report = check_loss_contract(nn.WithLossCell(net, ce()), (Tensor(x), Tensor(y)), K)
    assert isinstance(report, LossContractReport) and report.kind == RowMean() and report.rows == (8, 8, 8, 8)
    assert report.separable is True and report.read_from_graph and report.ignore_labels is None
    assert report.count_input is None and not report.random and report.primitives > 5
    report = check_loss_contract(MaskedMean(net), tuple(Tensor(a) for a in uniform), K)
    assert report.count_input == 2 and "of input 2" in report.kind.description, report
    with pytest.raises(ValueError) as caught:
        check_loss_contract(CentredLoss(net), (Tensor(x), Tensor(y)), K)
    message = str(caught.value)
    assert "couples the rows" in message and "at Sub" in message, message
    assert "check_loss=" not in message and "per_token_loss" not in message, message   # its own arguments only
    # A network that draws random values: read from the graph all the same, the draws named.
    dropped = nn.WithLossCell(nn.SequentialCell(nn.Dropout(p=0.3), net), ce())
    dropped.set_train()   # dropout draws only in training
    report = check_loss_contract(dropped, (Tensor(x), Tensor(y)), K)
    assert report.random and report.random_primitives == ("Dropout",) and report.kind == RowMean()
    assert all(np.array_equal(param.asnumpy(), value) for param, value in zip(net.trainable_params(), before))


def test_contract_public_check_counts_a_recognised_loss_and_compares_a_declared_kind():
    # nn.CrossEntropyLoss(ignore_index=-100) with ignored labels spread unevenly: recognised and counted (exact), as
    # the cells do without a declaration; declared a row mean, the graph shows it is a mean over those labels.
    from ms_gradaccum import RowMean, check_loss_contract   # pylint: disable=C0415
    x, y = classification_batches(1, 32)[0]
    y = y.copy()
    y[8:14] = -100   # 6 of micro-batch 1's 8 labels ignored
    loss_net = nn.WithLossCell(make_mlp(), nn.CrossEntropyLoss(ignore_index=-100))
    report = check_loss_contract(loss_net, (Tensor(x), Tensor(y)), K)
    assert type(report.kind).__name__ == "CountedMean" and report.read_from_graph
    assert report.separable is True
    with pytest.raises(ValueError, match=r"is a mean over the labels of input 1 that are not -100, but .*"
                                         r"kind=ms_gradaccum.TokenMean.*Read from the loss network's graph"):
        check_loss_contract(loss_net, (Tensor(x), Tensor(y)), K, kind=RowMean())


@pytest.mark.parametrize("args, error, match", [
    (dict(micro_size=1), ValueError, r"For 'check_loss_contract', the argument 'micro_size' must be at least 2, but "
                                     r"got 1"),
    (dict(micro_size=0), ValueError, r"For 'check_loss_contract', the argument 'micro_size' must be a positive int"),
    (dict(inputs=None), TypeError, r"For 'check_loss_contract', the argument 'inputs' must be a non-empty tuple"),
    (dict(kind="mean"), TypeError, r"For 'check_loss_contract', the argument 'kind' must be None or an "
                                   r"ms_gradaccum.LossKind"),
])
def test_contract_public_check_refuses_bad_arguments(args, error, match):
    from ms_gradaccum import check_loss_contract   # pylint: disable=C0415
    x, y = classification_batches(1, 32)[0]
    given = dict(loss_net=nn.WithLossCell(make_mlp(), ce()), inputs=(Tensor(x), Tensor(y)), micro_size=K)
    given.update(args)
    with pytest.raises(error, match=match):
        check_loss_contract(**given)
