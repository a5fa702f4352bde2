"""GradAccumulationScheduler and AccumulatingTrainOneStepCell under ms.Model."""
import re

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn
from mindspore.train import Callback, LossMonitor, Model

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell, GradAccumulationScheduler
from helpers import classification_batches, classification_dataset, make_mlp, make_optimizer, params_of

STEPS_PER_EPOCH = 8


def _dataset(steps=STEPS_PER_EPOCH, batch=8):
    return classification_dataset(steps, batch)


def _model(accumulate_steps=1):
    net = make_mlp()
    cell = AccumulatingTrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")),
                                        make_optimizer("sgd", net.trainable_params()), accumulate_steps)
    return net, cell, Model(cell)


class _CountUpdates(Callback):
    """Counts, per epoch, the steps after which the weights changed."""

    def __init__(self, net):
        super().__init__()
        self.net, self.previous, self.per_epoch, self.losses = net, params_of(net), [], []

    def on_train_epoch_begin(self, run_context):
        self.per_epoch.append(0)

    def on_train_step_end(self, run_context):
        self.losses.append(float(run_context.original_args().net_outputs.asnumpy()))
        current = params_of(self.net)
        if any(not np.array_equal(current[k], self.previous[k]) for k in current):
            self.per_epoch[-1] += 1
        self.previous = current


def test_scheduler_updates_at_exactly_the_scheduled_boundaries():
    net, cell, model = _model()
    counter = _CountUpdates(net)
    scheduler = GradAccumulationScheduler({0: 4, 2: 3, 3: 1})
    model.train(4, _dataset(), callbacks=[scheduler, counter], dataset_sink_mode=False)
    # 8 batches per epoch: windows of 4 -> 2 steps; of 3 -> 3, 3, 2 (last one short) -> 3 steps; of 1 -> 8.
    assert counter.per_epoch == [2, 2, 3, 8]
    assert len(cell.compile_cache) == 1, cell.compile_cache  # three schedule changes, one compiled graph
    assert int(cell.optimizer.global_step.asnumpy().item()) == 15
    assert cell.pending_batches == 0
    x, y = classification_batches(1, 4)[0]
    cell(ms.Tensor(x), ms.Tensor(y))
    assert len(cell.compile_cache) == 2  # control: a new batch shape does recompile, and it is seen


def test_scheduler_without_epoch_zero_uses_one_until_first_key_and_copies_the_dict():
    scheduling = {2: 4}
    scheduler = GradAccumulationScheduler(scheduling)
    assert scheduling == {2: 4}
    assert scheduler.scheduling == {0: 1, 2: 4}
    assert [scheduler.accumulate_steps_for(e) for e in range(4)] == [1, 1, 4, 4]


@pytest.mark.parametrize("scheduling, error, message", [
    ([(0, 4)], TypeError, "the argument 'scheduling' must be a dict {epoch: accumulate_steps}, but got [(0, 4)] (list)"),
    ({}, ValueError, "the argument 'scheduling' must be a non-empty dict"),
    ({-1: 4}, ValueError, "every key of 'scheduling' must be a zero-based epoch (int >= 0), but got -1 (int)"),
    ({1.0: 4}, TypeError, "every key of 'scheduling' must be a zero-based epoch (int >= 0), but got 1.0 (float)"),
    ({True: 4}, TypeError, "every key of 'scheduling' must be a zero-based epoch (int >= 0), but got True (bool)"),
    ({0: 0}, ValueError, "the accumulate_steps of epoch 0 in 'scheduling' must be an int >= 1, but got 0 (int)"),
    ({0: "4"}, TypeError, "the accumulate_steps of epoch 0 in 'scheduling' must be an int >= 1, but got '4' (str)"),
])
def test_scheduler_bad_schedules_rejected(scheduling, error, message):
    with pytest.raises(error, match=re.escape("For 'GradAccumulationScheduler', " + message)):
        GradAccumulationScheduler(scheduling)


def test_scheduler_needs_an_accumulating_cell():
    net = make_mlp()
    loss_net = GradAccumulationCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")), 2)
    model = Model(loss_net, optimizer=make_optimizer("sgd", net.trainable_params()))
    with pytest.raises(TypeError, match="Model's train network must be or contain an AccumulatingTrainOneStepCell, "
                                        "but got TrainOneStepCell"):
        model.train(1, _dataset(), callbacks=[GradAccumulationScheduler({0: 2})], dataset_sink_mode=False)


def test_scheduler_model_loss_monitor_prints_per_batch_loss_and_window_mean_is_available(capsys):
    net, cell, model = _model(accumulate_steps=4)
    counter = _CountUpdates(net)
    model.train(1, _dataset(), callbacks=[counter, LossMonitor(1)], dataset_sink_mode=False)
    printed = [float(v) for v in re.findall(r"loss is ([-0-9.e]+)", capsys.readouterr().out)]
    np.testing.assert_allclose(printed, counter.losses, rtol=1e-6)
    assert counter.per_epoch == [2]
    assert cell.last_window_loss == pytest.approx(np.mean(counter.losses[4:]), rel=1e-5)
