"""GradAccumulationScheduler and AccumulatingTrainOneStepCell under ms.Model."""
import re
import warnings

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn
from mindspore.train import Callback, LossMonitor, Model

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell, GradAccumulationScheduler
from helpers import (assert_params_close, assert_params_equal, assert_params_moved, ce, classification_batches,
                     classification_dataset, device_sinks, make_mlp, make_optimizer, params_of, reference_run,
                     train_steps)

STEPS_PER_EPOCH = 8


def _dataset(steps=STEPS_PER_EPOCH, batch=8):
    return classification_dataset(steps, batch)



def _model(accumulate_steps=1):
    net = make_mlp()
    cell = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()),
                                        make_optimizer("sgd", net.trainable_params()), accumulate_steps)
    return net, cell, Model(cell)


class _CountUpdates(Callback):
    """Counts, per epoch, the steps (and epoch ends) after which the weights changed."""

    def __init__(self, net):
        super().__init__()
        self.net, self.previous, self.per_epoch, self.losses = net, params_of(net), [], []

    def on_train_epoch_begin(self, run_context):
        self.per_epoch.append(0)

    def on_train_step_end(self, run_context):
        self.losses.append(float(run_context.original_args().net_outputs.asnumpy()))
        self._count()

    def on_train_epoch_end(self, run_context):
        self._count()   # after the scheduler's (listed before this callback): an epoch's short last window

    def _count(self):
        current = params_of(self.net)
        if any(not np.array_equal(current[k], self.previous[k]) for k in current):
            self.per_epoch[-1] += 1
        self.previous = current


@pytest.mark.slow
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
    ([(0, 4)], TypeError,
     "the argument 'scheduling' must be a dict {epoch: accumulate_steps}, but got [(0, 4)] (list)"),
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
    loss_net = GradAccumulationCell(nn.WithLossCell(net, ce()), 2)
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


WINDOWS_WARNING = "nothing closes an epoch's last window"


@pytest.mark.slow
def test_scheduler_missing_under_model_is_warned_with_both_fixes():
    # 8 batches in windows of 3: without the scheduler, the epoch ends with 2 batches pending.
    net, cell, model = _model(accumulate_steps=3)
    with pytest.warns(UserWarning, match=WINDOWS_WARNING + r".*GradAccumulationScheduler\(\{0: 3\}\).*"
                                         r"steps_per_epoch=<batches per epoch>"):
        model.train(1, _dataset(), dataset_sink_mode=False)
    assert cell.pending_batches == STEPS_PER_EPOCH % 3 == 2
    # Silent where an epoch's last window is closed: the scheduler, steps_per_epoch, or a hand-written loop.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*" + WINDOWS_WARNING)
        _, cell, model = _model(accumulate_steps=3)
        model.train(1, _dataset(), callbacks=[GradAccumulationScheduler({0: 3})], dataset_sink_mode=False)
        assert cell.pending_batches == 0
        _, cell, model = _model(accumulate_steps=3)
        cell.set_steps_per_epoch(STEPS_PER_EPOCH)
        model.train(1, _dataset(), dataset_sink_mode=False)
        assert cell.pending_batches == 0
        _, cell, _ = _model(accumulate_steps=3)
        for x, y in _dataset().create_tuple_iterator(num_epochs=1):
            cell(x, y)
        assert cell.pending_batches == STEPS_PER_EPOCH % 3


def _batches_run(batches: int, epochs: int, sink: bool, sink_size: int) -> list:
    """The batch indices each epoch of ``Model.train`` runs, per epoch. A device that sinks runs ``sink_size`` steps per
    epoch, reading on where the last epoch stopped and repeating the dataset as needed (Model._train_dataset_sink_
    process); CPU runs the whole dataset every epoch, whatever sink_size says (FACTS)."""
    if not (sink and device_sinks()) or sink_size == -1:
        return [list(range(batches)) for _ in range(epochs)]
    stream = [i % batches for i in range(epochs * sink_size)]
    return [stream[e * sink_size:(e + 1) * sink_size] for e in range(epochs)]


def _merged(batches, indices):
    return tuple(np.concatenate(part) for part in zip(*(batches[i] for i in indices)))


@pytest.mark.slow
@pytest.mark.parametrize("sink_size", [3, 4, -1])
def test_scheduler_windows_follow_the_batches_run_whatever_sink_size_says(sink_size):
    # Windows of 4 that close at each epoch's end, over the batches each epoch really runs: on CPU
    # (dataset_sink_mode=True, sink_size=3 still runs all 6 batches while callbacks are told 3) 4 + 2 per epoch; on a
    # device that sinks, sink_size batches per epoch. The reference is the full batch of each window.
    batches, epochs, steps = classification_batches(6, 8), 2, 4
    per_epoch = _batches_run(len(batches), epochs, True, sink_size)
    # The prediction of what runs is checked first: the plain network under the same sink settings trains exactly
    # like plain steps over the predicted batches.
    ref_net = make_mlp()
    Model(nn.WithLossCell(ref_net, ce()), optimizer=make_optimizer("sgd", ref_net.trainable_params())).train(
        epochs, _dataset(6), dataset_sink_mode=True, sink_size=sink_size)
    plain_steps, _, initial = reference_run(make_mlp, ce(), "sgd", [batches[i] for run in per_epoch for i in run])
    assert_params_close(params_of(ref_net), plain_steps, rtol=1e-5, atol=1e-6)
    windows = [run[i:i + steps] for run in per_epoch for i in range(0, len(run), steps)]
    expected, _, _ = reference_run(make_mlp, ce(), "sgd", [_merged(batches, window) for window in windows])

    def run(**train_kwargs):
        net, cell, model = _model()
        model.train(epochs, _dataset(6), callbacks=[GradAccumulationScheduler({0: steps})], **train_kwargs)
        return params_of(net), cell

    sunk, cell = run(dataset_sink_mode=True, sink_size=sink_size)
    assert_params_moved(expected, initial)
    assert_params_close(sunk, expected, rtol=1e-5, atol=1e-6)
    assert int(cell.optimizer.global_step.asnumpy().item()) == len(windows) and cell.pending_batches == 0
    if not device_sinks():   # the same batches as without sink mode: the same bits
        assert_params_equal(sunk, run(dataset_sink_mode=False)[0])
    # Negative control: windows closed every 3 batches (a scheduler trusting the announced epoch length) differ.
    net, cell, _ = _model(accumulate_steps=4)
    cell.set_steps_per_epoch(3)
    train_steps(cell, batches * 2)
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(params_of(net), _windows_of_six_batches(batches), rtol=1e-5, atol=1e-6)


def _windows_of_six_batches(batches):
    """Full-batch training over windows 4 + 2 of six batches, twice: what CPU runs for every sink_size above."""
    windows = [_merged(batches, range(4)), _merged(batches, range(4, 6))] * 2
    expected, _, _ = reference_run(make_mlp, ce(), "sgd", windows)
    return expected


@pytest.mark.slow
def test_scheduler_epoch_stopped_early_applies_what_it_ran():
    class StopAfter(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == 5:
                run_context.request_stop()

    batches = classification_batches(8, 8)
    expected, _, _ = reference_run(make_mlp, ce(), "sgd", [
        tuple(np.concatenate(part) for part in zip(*batches[:4])),
        tuple(np.concatenate(part) for part in zip(*batches[4:5]))])
    net, cell, model = _model()
    model.train(1, _dataset(), callbacks=[GradAccumulationScheduler({0: 4}), StopAfter()], dataset_sink_mode=False)
    assert_params_close(params_of(net), expected, rtol=1e-5, atol=1e-6)
    assert cell.pending_batches == 0


def test_scheduler_warns_when_the_learning_rate_list_is_paced_per_batch():
    # 2 epochs of 8 batches, windows of 4 then 2: 2 + 4 = 6 optimizer steps. A list of 16 entries (one per batch) would
    # run the schedule 2.7x slow: warned once, naming both lengths and how to build it; one of 6 entries is not.
    net = make_mlp()
    per_batch = list(np.linspace(0.1, 0.01, 2 * STEPS_PER_EPOCH).astype(np.float32))
    cell = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), per_batch), 1)
    with pytest.warns(UserWarning, match=r"16 entries, one per batch \(2 epochs x 8 batches\).*6 optimizer steps.*"
                                         r"one entry per optimizer step") as caught:
        Model(cell).train(2, _dataset(), callbacks=[GradAccumulationScheduler({0: 4, 1: 2})], dataset_sink_mode=False)
    assert sum("one per batch" in str(w.message) for w in caught) == 1
    assert int(cell.optimizer.global_step.asnumpy().reshape(-1)[0]) == 6   # the list's 7th to 16th entries never used
    net = make_mlp()
    per_step = list(np.linspace(0.1, 0.01, 6).astype(np.float32))
    cell = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), per_step), 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*one per batch.*")
        Model(cell).train(2, _dataset(), callbacks=[GradAccumulationScheduler({0: 4, 1: 2})], dataset_sink_mode=False)
