"""AccumulatingTrainOneStepCell: k calls with batch b equal one full-batch step with batch k*b."""
import dataclasses

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, Tensor

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from ms_gradaccum.cells.accumulating import StepOptions
from helpers import (assert_params_close, assert_params_equal, assert_params_moved, ce, classification_batches,
                     classification_dataset, make_mlp, make_optimizer, max_abs_diff, params_of, reference_run)

TOLERANCE = dict(rtol=1e-5, atol=1e-6)



def _concat(batches):
    return np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])


def _windows(batches, sizes):
    """Group consecutive batches into windows of the given sizes, each concatenated into one batch."""
    out, start = [], 0
    for size in sizes:
        out.append(_concat(batches[start:start + size]))
        start += size
    assert start == len(batches)
    return out


def _accumulating(optimizer="sgd", accumulate_steps=4, steps_per_epoch=None, learning_rate=None):
    net = make_mlp()
    opt = make_optimizer(optimizer, net.trainable_params()) if learning_rate is None else \
        nn.SGD(net.trainable_params(), learning_rate=learning_rate)
    cell = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), opt, accumulate_steps,
                                        steps_per_epoch=steps_per_epoch)
    return net, cell


def _run(cell, net, batches):
    snapshots, losses = [], []
    for x, y in batches:
        losses.append(float(cell(Tensor(x), Tensor(y)).asnumpy()))
        snapshots.append(params_of(net))
    return snapshots, losses


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_steps_match_full_batch_reference_and_hold_weights_between_steps(optimizer):
    k, windows = 4, 3
    batches = classification_batches(k * windows, 8)
    expected, expected_losses, initial = reference_run(make_mlp, ce(), optimizer, _windows(batches, [k] * windows))
    net, cell = _accumulating(optimizer, k)
    snapshots, losses = _run(cell, net, batches)

    assert_params_moved(expected, initial)
    assert_params_close(snapshots[-1], expected, **TOLERANCE)
    for i, snapshot in enumerate(snapshots):
        previous = snapshots[i - 1] if i else initial
        if (i + 1) % k:   # inside a window: exactly unchanged
            assert_params_equal(snapshot, previous)
        else:             # window closed: the optimizer stepped
            assert max_abs_diff(snapshot, previous) > 1e-4
    # The returned loss is per batch; the mean over a window is the full-batch loss of that window.
    np.testing.assert_allclose(np.mean(np.reshape(losses, (windows, k)), axis=1), expected_losses, rtol=1e-5)
    assert cell.last_window_loss == pytest.approx(expected_losses[-1], rel=1e-5)
    assert int(cell.optimizer.global_step.asnumpy().item()) == windows and cell.pending_batches == 0


def test_steps_every_call_stepping_fails_reference():
    # Negative control: stepping every call (accumulate_steps=1) is a different trajectory.
    batches = classification_batches(8, 8)
    expected, _, _ = reference_run(make_mlp, ce(), "sgd", _windows(batches, [4, 4]))
    net, cell = _accumulating("sgd", 1)
    snapshots, _ = _run(cell, net, batches)
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(snapshots[-1], expected, **TOLERANCE)


def test_steps_accumulate_steps_1_is_bit_exact_train_one_step_cell():
    batches = classification_batches(3, 8)
    expected, _, _ = reference_run(make_mlp, ce(), "adam", batches)
    net, cell = _accumulating("adam", 1)
    snapshots, _ = _run(cell, net, batches)
    assert_params_equal(snapshots[-1], expected)


def test_steps_learning_rate_schedule_advances_per_optimizer_step():
    schedule = [0.2, 0.1, 0.05]   # a dynamic learning rate, indexed by the optimizer's step counter
    batches = classification_batches(6, 8)
    ref_net = make_mlp()
    ref_step = nn.TrainOneStepCell(nn.WithLossCell(ref_net, ce()), nn.SGD(ref_net.trainable_params(), schedule))
    for x, y in _windows(batches, [2, 2, 2]):
        ref_step(Tensor(x), Tensor(y))
    net, cell = _accumulating(accumulate_steps=2, learning_rate=schedule)
    _run(cell, net, batches)
    assert_params_close(params_of(net), params_of(ref_net), **TOLERANCE)


def test_steps_last_short_window_of_epoch_weighted_by_its_batches():
    # 5 batches per epoch, windows of 2: [2, 2, 1] each epoch, the short one applied at the epoch's end as
    # the mean of its single batch (not that batch's gradient / 2, Lightning #19987).
    batches = classification_batches(10, 8)
    sizes = [2, 2, 1, 2, 2, 1]
    expected, _, _ = reference_run(make_mlp, ce(), "momentum", _windows(batches, sizes))
    net, cell = _accumulating("momentum", 2, steps_per_epoch=5)
    snapshots, _ = _run(cell, net, batches)
    assert_params_close(snapshots[-1], expected, **TOLERANCE)
    assert int(cell.optimizer.global_step.asnumpy().item()) == len(sizes) and cell.pending_batches == 0


def test_steps_epoch_shorter_than_window_still_trains_once_per_epoch():
    # Lightning #21808: 3 batches per epoch, accumulate_steps 8: one step of the 3 batches' mean per epoch.
    batches = classification_batches(6, 8)
    expected, _, initial = reference_run(make_mlp, ce(), "sgd", _windows(batches, [3, 3]))
    net, cell = _accumulating("sgd", 8, steps_per_epoch=3)
    snapshots, _ = _run(cell, net, batches)
    assert_params_moved(snapshots[-1], initial)
    assert_params_close(snapshots[-1], expected, **TOLERANCE)


def test_steps_under_scaled_last_window_is_detected():
    # Negative control for the test above: dividing the short window's sum by accumulate_steps is wrong.
    batches = classification_batches(6, 8)
    net, cell = _accumulating("sgd", 8, steps_per_epoch=3)
    snapshots, _ = _run(cell, net, batches)
    under_net = make_mlp()
    under = nn.TrainOneStepCell(nn.WithLossCell(under_net, ce()),
                                nn.SGD(under_net.trainable_params(), learning_rate=0.1 * 3 / 8))
    for x, y in _windows(batches, [3, 3]):
        under(Tensor(x), Tensor(y))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(snapshots[-1], params_of(under_net), **TOLERANCE)


@pytest.mark.slow
def test_steps_flush_applies_pending_partial_window():
    batches = classification_batches(6, 8)
    expected, _, _ = reference_run(make_mlp, ce(), "sgd", _windows(batches, [4, 2]))
    net, cell = _accumulating("sgd", 4)
    _run(cell, net, batches)
    assert cell.pending_batches == 2
    assert cell.flush() is True
    assert cell.pending_batches == 0 and cell.flush() is False
    assert_params_close(params_of(net), expected, **TOLERANCE)


def _train_state(cell):
    return {p.name: p.asnumpy().copy() for p in cell.get_parameters()}


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("stop_after", [5, 6, 7])
def test_steps_resume_mid_window_equals_uninterrupted_run(tmp_path, stop_after):
    batches = classification_batches(10, 8)
    net, cell = _accumulating("adam", 4)
    uninterrupted, _ = _run(cell, net, batches)

    first_net, first = _accumulating("adam", 4)
    _run(first, first_net, batches[:stop_after])
    assert first.pending_batches == stop_after % 4
    path = str(tmp_path / "mid_window.ckpt")
    ms.save_checkpoint(first, path)

    resumed_net, resumed = _accumulating("adam", 4)
    not_loaded, _ = ms.load_param_into_net(resumed, ms.load_checkpoint(path))
    assert not_loaded == []
    assert resumed.pending_batches == stop_after % 4
    snapshots, _ = _run(resumed, resumed_net, batches[stop_after:])
    assert_params_equal(snapshots[-1], uninterrupted[-1])

    # Negative control: resuming with the weights and optimizer state but without the buffers is not equal.
    lossy_net, lossy = _accumulating("adam", 4)
    checkpoint = {k: v for k, v in ms.load_checkpoint(path).items() if not k.startswith(("accu_grads.", "accu_state."))}
    ms.load_param_into_net(lossy, checkpoint)
    lossy_snapshots, _ = _run(lossy, lossy_net, batches[stop_after:])
    assert max_abs_diff(lossy_snapshots[-1], uninterrupted[-1]) > 1e-5


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(accumulate_steps=0), ValueError, "the argument 'accumulate_steps' must be a positive int, but got 0 (int)"),
    (dict(accumulate_steps=True), TypeError, "the argument 'accumulate_steps' must be a positive int, but got True"),
    (dict(accumulate_steps=2.5), TypeError, "the argument 'accumulate_steps' must be a positive int, but got 2.5"),
    (dict(steps_per_epoch=0), ValueError, "the argument 'steps_per_epoch' must be a positive int, but got 0 (int)"),
    (dict(optimizer="sgd"), TypeError, "the argument 'optimizer' must be a mindspore.nn.Optimizer, but got 'sgd'"),
    (dict(network=None), TypeError,
     "the argument 'network' must be a mindspore.nn.Cell returning a single-element loss"),
])
def test_steps_bad_arguments_rejected(kwargs, error, message):
    net = make_mlp()
    arguments = dict(network=nn.WithLossCell(net, ce()), optimizer=nn.SGD(net.trainable_params(), 0.1),
                     accumulate_steps=2, steps_per_epoch=None)
    arguments.update(kwargs)
    pattern = "For 'AccumulatingTrainOneStepCell', " + message.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(error, match=pattern):
        AccumulatingTrainOneStepCell(**arguments)


def test_steps_pynative_micro_batches_and_window_match_full_batch_reference():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    batches = classification_batches(8, 8)
    expected, _, initial = reference_run(make_mlp, ce(), "adam", _windows(batches, [2, 2, 2, 2]))
    net = make_mlp()
    cell = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), make_optimizer("adam", net.trainable_params()),
                                        2, micro_size=4)
    snapshots, _ = _run(cell, net, batches)
    assert_params_moved(expected, initial)
    assert_params_close(snapshots[-1], expected, rtol=1e-5, atol=1e-5)


def test_steps_train_cell_given_to_model_with_an_optimizer_is_refused():
    # Model(cell, optimizer=opt) would wrap this train cell in a second one, which applies a zero update on top.
    net, cell = _accumulating("momentum", 2)
    model = ms.Model(cell, optimizer=make_optimizer("momentum", net.trainable_params()))
    initial = params_of(net)
    with pytest.raises(ValueError, match=r"wrapped in another cell that holds an optimizer too \(Model\(cell, "
                                         r"optimizer=...\) builds one\)"):
        model.train(1, classification_dataset(2, 8), dataset_sink_mode=False)
    assert_params_equal(params_of(net), initial)


def test_loss_scale_nested_grad_accumulationcell_rejected():
    net = make_mlp()
    nested = nn.SequentialCell([GradAccumulationCell(nn.WithLossCell(net, ce()), 2)])
    with pytest.raises(ValueError, match="a GradAccumulationCell must be the 'network' itself"):
        AccumulatingTrainOneStepCell(nested, nn.SGD(net.trainable_params(), 0.1), 1)


@pytest.mark.realmodels
@pytest.mark.parametrize("module, name", [("ms_gradaccum.mindformers", "GradAccumulationWrapper"),
                                          ("ms_gradaccum.mindone", "TrainOneStepWrapper"),
                                          ("ms_gradaccum.adapters.mindone.transformers", "TrainerStep"),
                                          ("ms_gradaccum.mindcv", "TrainStep"),
                                          ("ms_gradaccum.mindocr", "TrainOneStepWrapper")])
def test_steps_adapters_use_only_the_public_hooks(module, name):
    """The zoo adapters change the train step through the documented hooks only: none defines a member whose name
    starts with one underscore (an override of, or an addition beside, the package's private machinery), nor does a
    base they share below AccumulatingTrainOneStepCell (adapters.zoo_step)."""
    adapter = getattr(pytest.importorskip(module), name)
    assert issubclass(adapter, AccumulatingTrainOneStepCell)
    members = {}
    for cls in adapter.__mro__[:adapter.__mro__.index(AccumulatingTrainOneStepCell)]:
        members.update({member: cls.__name__ for member in vars(cls) if member not in members})
    private = [member for member in members if member.startswith("_") and not member.startswith("__")]
    assert private == [], f"{name} defines {private}"
    hooks = {"transform_gradients", "after_optimizer_step", "construct", "changes_gradients"}
    assert hooks & set(members), f"{name} uses none of the hooks: the check would pass on any class"
    # Its options are passed in (StepOptions), not set on the class.
    options = {field.name for field in dataclasses.fields(StepOptions)}
    assert not options & set(members), f"{name} sets {options & set(members)} on the class"
