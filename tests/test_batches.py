"""Batches of any size: split as evenly as possible and weighted by rows; windows of batches of different sizes."""
import numpy as np
import mindspore as ms
import mindspore.dataset as ds
import pytest
from mindspore import nn, Tensor
from mindspore.train import Model

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from helpers import (assert_params_close, assert_params_moved, ce, classification_batches, make_mlp, make_optimizer,
                     params_of, RecordLoss, reference_run, train_steps)

TOLERANCE = dict(rtol=1e-5, atol=1e-6)



@pytest.mark.slow
@pytest.mark.parametrize("batch, micro_size", [(30, 4), (3, 4), (1, 8), (7, 3)])
def test_batches_any_batch_size_matches_full_batch(batch, micro_size):
    batches = classification_batches(3, batch)
    expected, expected_losses, _ = reference_run(make_mlp, ce(), "momentum", batches)
    net = make_mlp()
    step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(net, ce()), micro_size),
                               make_optimizer("momentum", net.trainable_params()))
    losses = train_steps(step, batches)
    assert_params_close(params_of(net), expected, **TOLERANCE)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    if batch > 1:   # Negative control: dropping the remainder rows (a naive split) is a different update.
        dropped, _, _ = reference_run(make_mlp, ce(), "momentum",
                                      [(x[:batch // micro_size * micro_size or 1],
                                        y[:batch // micro_size * micro_size or 1]) for x, y in batches])
        with pytest.raises(AssertionError, match="differs from the reference"):
            assert_params_close(dropped, expected, **TOLERANCE)


def test_batches_equal_micro_batch_weights_would_fail_reference():
    # Negative control for row weighting: 30 rows as 8, 8, 7, 7 with the micro-batch means averaged equally.
    (x, y), = classification_batches(1, 30)
    expected, _, _ = reference_run(make_mlp, ce(), "sgd", [(x, y)])
    net = make_mlp()
    opt = make_optimizer("sgd", net.trainable_params())
    grads = None
    for start, stop in ((0, 8), (8, 16), (16, 23), (23, 30)):
        _, g = ms.value_and_grad(nn.WithLossCell(net, ce()), None, opt.parameters)(Tensor(x[start:stop]),
                                                                                   Tensor(y[start:stop]))
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


@pytest.mark.slow
def test_batches_model_epoch_with_short_last_batch_equals_plain_training():
    (x, y), = classification_batches(1, 3 * 32 + 30)   # batches of 32, 32, 32 and a short 30

    def train(network_of):
        net = make_mlp()
        dataset = ds.GeneratorDataset(_Rows(x, y), ["data", "label"], shuffle=False).batch(32, drop_remainder=False)
        record = RecordLoss()
        Model(network_of(nn.WithLossCell(net, ce())), optimizer=make_optimizer("adam", net.trainable_params())).train(
            1, dataset, callbacks=[record], dataset_sink_mode=False)
        return params_of(net), record.losses

    expected, expected_losses = train(lambda loss_net: loss_net)
    actual, losses = train(lambda loss_net: GradAccumulationCell(loss_net, 4))
    assert len(losses) == 4
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("micro_size", [1, 4])
def test_batches_window_with_a_short_batch_is_the_concatenated_full_batch(micro_size):
    # Windows of 2 batches of 32 and 20 rows: the full batch of their 52 rows, each row weighted equally (the
    # mean of the two batch means would weight the short batch's rows 1.6x).
    full = classification_batches(2, 32)
    batches = [full[0], (full[1][0][:20], full[1][1][:20])] * 2
    windows = [tuple(np.concatenate(parts) for parts in zip(batches[i], batches[i + 1])) for i in (0, 2)]
    expected, expected_losses, initial = reference_run(make_mlp, ce(), "momentum", windows)
    net = make_mlp()
    cell = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), make_optimizer("momentum", net.trainable_params()),
                                        2, micro_size=micro_size)
    train_steps(cell, batches)
    assert_params_moved(expected, initial)
    assert_params_close(params_of(net), expected, **TOLERANCE)
    assert cell.last_window_loss == pytest.approx(expected_losses[-1], rel=1e-5)
    # Negative control: the mean of the batch means.
    control_net = make_mlp()
    opt = make_optimizer("momentum", control_net.trainable_params())
    loss_net = nn.WithLossCell(control_net, ce())
    for i in (0, 2):
        grads = [ms.value_and_grad(loss_net, None, opt.parameters)(Tensor(x), Tensor(y))[1]
                 for x, y in batches[i:i + 2]]
        opt(tuple((a + b) / 2 for a, b in zip(*grads)))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(params_of(control_net), expected, **TOLERANCE)
