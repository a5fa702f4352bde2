"""Exact at any batch: (loss_sum, count) networks, batches not divisible by micro_size, BatchNorm warned."""
import re
import warnings

import numpy as np
import mindspore as ms
import mindspore.dataset as ds
import pytest
from mindspore import nn, Tensor
from mindspore.train import Model

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from helpers import (RecordLoss, TokenLoss, assert_params_close, assert_params_equal, assert_params_moved,
                     classification_batches, make_mlp, make_optimizer, make_token_net, params_of, reference_run,
                     token_batches, train_steps)

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
# Four micro-batches of 4 samples with 1, 6, 2 and 5 valid tokens per sample: very uneven token counts.
VALID = [1] * 4 + [6] * 4 + [2] * 4 + [5] * 4
K = 4


def _token_reference(optimizer, batches):
    net = make_token_net()
    step = nn.TrainOneStepCell(TokenLoss(net, "mean"), make_optimizer(optimizer, net.trainable_params()))
    losses = train_steps(step, batches)
    return params_of(net), losses


def _run_cell(optimizer, batches, mode="sum_count", micro_size=K):
    net = make_token_net()
    step = nn.TrainOneStepCell(GradAccumulationCell(TokenLoss(net, mode), micro_size),
                               make_optimizer(optimizer, net.trainable_params()))
    losses = train_steps(step, batches)
    return params_of(net), losses


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_tokens_cell_matches_global_token_mean(optimizer):
    batches = token_batches(3, VALID)
    expected, expected_losses = _token_reference(optimizer, batches)
    actual, losses = _run_cell(optimizer, batches)
    assert_params_moved(expected, params_of(make_token_net()))
    assert_params_close(actual, expected, **TOLERANCE)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)   # what LossMonitor prints: the token mean


def test_tokens_mean_of_micro_batch_means_fails_reference():
    # Negative control: the Transformers bug (#34191), each micro-batch normalised by its own token count.
    batches = token_batches(3, VALID)
    expected, _ = _token_reference("sgd", batches)
    control, _ = _run_cell("sgd", batches, mode="mean")
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, **TOLERANCE)


def test_tokens_ragged_batch_with_token_counts():
    # 14 samples in 4 micro-batches (4, 4, 3, 3 samples): the split and the token counts are both uneven.
    batches = token_batches(2, VALID[:14])
    expected, expected_losses = _token_reference("momentum", batches)
    actual, losses = _run_cell("momentum", batches)
    assert_params_close(actual, expected, **TOLERANCE)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


@pytest.mark.parametrize("micro", [False, True], ids=["window", "micro_batches"])
def test_tokens_accumulating_cell_divides_by_the_window_count(micro):
    dense, sparse = token_batches(2, VALID), token_batches(2, [1] * 16, seed=5)
    batches = [dense[0], sparse[0], sparse[1], dense[1]]   # 2 windows of 2 batches with different token counts
    windows = [tuple(np.concatenate([a, b]) for a, b in zip(batches[i], batches[i + 1])) for i in (0, 2)]
    expected, expected_losses = _token_reference("adam", windows)

    def run(mode):
        net = make_token_net()
        loss_net = TokenLoss(net, mode)
        network = GradAccumulationCell(loss_net, K) if micro else loss_net
        cell = AccumulatingTrainOneStepCell(network, make_optimizer("adam", net.trainable_params()), 2)
        for batch in batches:
            cell(*(Tensor(a) for a in batch))
        return params_of(net), cell

    actual, cell = run("sum_count")
    assert_params_close(actual, expected, **TOLERANCE)
    assert cell.last_window_loss == pytest.approx(expected_losses[-1], rel=1e-5)
    control, _ = run("mean")
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, **TOLERANCE)


def test_tokens_flush_divides_a_partial_window_by_its_count():
    batches = token_batches(3, VALID)
    expected, _ = _token_reference("sgd", [tuple(np.concatenate(parts) for parts in zip(*batches))])
    net = make_token_net()
    cell = AccumulatingTrainOneStepCell(TokenLoss(net), make_optimizer("sgd", net.trainable_params()), 4)
    for batch in batches:
        cell(*(Tensor(a) for a in batch))
    assert cell.flush() is True
    assert_params_close(params_of(net), expected, **TOLERANCE)


# --- batches not divisible by micro_size ---------------------------------------------------------------

def _ce():
    return nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


@pytest.mark.parametrize("batch, micro_size", [(30, 4), (3, 4), (1, 8), (7, 3)])
def test_tokens_any_batch_size_matches_full_batch(batch, micro_size):
    batches = classification_batches(3, batch)
    expected, expected_losses, _ = reference_run(make_mlp, _ce(), "momentum", batches)
    net = make_mlp()
    step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(net, _ce()), micro_size),
                               make_optimizer("momentum", net.trainable_params()))
    losses = train_steps(step, batches)
    assert_params_close(params_of(net), expected, **TOLERANCE)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    if batch > 1:   # Negative control: dropping the remainder rows (a naive split) is a different update.
        dropped, _, _ = reference_run(make_mlp, _ce(), "momentum",
                                      [(x[:batch // micro_size * micro_size or 1], y[:batch // micro_size * micro_size or 1])
                                       for x, y in batches])
        with pytest.raises(AssertionError, match="differs from the reference"):
            assert_params_close(dropped, expected, **TOLERANCE)


def test_tokens_equal_micro_batch_weights_would_fail_reference():
    # Negative control for row weighting: 30 rows as 8, 8, 7, 7 with the micro-batch means averaged equally.
    (x, y), = classification_batches(1, 30)
    expected, _, _ = reference_run(make_mlp, _ce(), "sgd", [(x, y)])
    net = make_mlp()
    opt = make_optimizer("sgd", net.trainable_params())
    grads = None
    for start, stop in ((0, 8), (8, 16), (16, 23), (23, 30)):
        _, g = ms.value_and_grad(nn.WithLossCell(net, _ce()), None, opt.parameters)(Tensor(x[start:stop]), Tensor(y[start:stop]))
        grads = g if grads is None else tuple(a + b for a, b in zip(grads, g))
    opt(tuple(g / 4 for g in grads))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(params_of(net), expected, **TOLERANCE)


class _Rows:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __getitem__(self, index):
        return np.asarray(self.x[index]), np.asarray(self.y[index])

    def __len__(self):
        return len(self.x)


def test_tokens_model_epoch_with_short_last_batch_equals_plain_training():
    (x, y), = classification_batches(1, 3 * 32 + 30)   # batches of 32, 32, 32 and a short 30

    def train(network_of):
        net = make_mlp()
        dataset = ds.GeneratorDataset(_Rows(x, y), ["data", "label"], shuffle=False).batch(32, drop_remainder=False)
        record = RecordLoss()
        Model(network_of(nn.WithLossCell(net, _ce())), optimizer=make_optimizer("adam", net.trainable_params())).train(
            1, dataset, callbacks=[record], dataset_sink_mode=False)
        return params_of(net), record.losses

    expected, expected_losses = train(lambda loss_net: loss_net)
    actual, losses = train(lambda loss_net: GradAccumulationCell(loss_net, 4))
    assert len(losses) == 4
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


# --- BatchNorm -----------------------------------------------------------------------------------------

def _bn_net():
    return nn.SequentialCell(nn.Dense(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dense(32, 4))


def test_tokens_batch_norm_is_warned_once_with_names_and_fix():
    with pytest.warns(UserWarning) as record:
        GradAccumulationCell(nn.WithLossCell(_bn_net(), _ce()), 4)
    messages = [str(w.message) for w in record if "batch normalisation" in str(w.message)]
    assert len(messages) == 1
    assert "1 (BatchNorm1d)" in messages[0] and "micro_size=4" in messages[0]
    assert "moving averages are updated once per part" in messages[0] and "GroupNorm or LayerNorm" in messages[0]


def test_tokens_no_warning_without_batch_norm_or_when_silenced():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradAccumulationCell(nn.WithLossCell(make_mlp(), _ce()), 4)
        GradAccumulationCell(nn.WithLossCell(_bn_net(), _ce()), 1)          # one micro-batch: nothing differs
        warnings.filterwarnings("ignore", message=re.escape("GradAccumulationCell: the network has batch normal"))
        GradAccumulationCell(nn.WithLossCell(_bn_net(), _ce()), 4)


def test_tokens_accumulating_cell_warns_for_batch_norm_across_batches():
    net = _bn_net()
    with pytest.warns(UserWarning, match="AccumulatingTrainOneStepCell: the network has batch normalisation"):
        AccumulatingTrainOneStepCell(nn.WithLossCell(net, _ce()), nn.SGD(net.trainable_params(), 0.1), 4)
