"""GradAccumulationCell under ms.Model: routing, LossMonitor, dataset sink, checkpoints."""
import os
import re

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn
from mindspore.train import CheckpointConfig, LossMonitor, Model, ModelCheckpoint
from mindspore.train.amp import _is_grad_accumulation

from ms_gradaccum import GradAccumulationCell
from helpers import (assert_params_close, assert_params_moved, ce, classification_dataset, device_sinks, make_mlp,
                     make_optimizer, params_of, RecordLoss)

BATCH = 32
STEPS = 4


def _dataset(steps=STEPS, batch=BATCH):
    return classification_dataset(steps, batch)



def _train_with_model(loss_network, net, optimizer="momentum", sink=False, callbacks=()):
    record = RecordLoss()
    model = Model(loss_network, optimizer=make_optimizer(optimizer, net.trainable_params()))
    model.train(1, _dataset(), callbacks=[record, *callbacks], dataset_sink_mode=sink)
    return model, record.losses


def test_model_routes_cell_into_plain_train_one_step_cell():
    # mindspore.train.amp routes cells *named* GradAccumulationCell into _TrainGradAccuStepCell.
    cell = GradAccumulationCell(nn.WithLossCell(make_mlp(), ce()), 4)
    assert type(cell).__name__ == "GradAccumulationCell"
    assert not _is_grad_accumulation(cell)
    assert _is_grad_accumulation(nn.GradAccumulationCell(nn.WithLossCell(make_mlp(), ce()), 4))

    model = Model(cell, optimizer=make_optimizer("sgd", cell.trainable_params()))
    assert type(model._train_network) is nn.TrainOneStepCell  # pylint: disable=protected-access


def test_model_subclass_named_like_mindspore_cell_still_trains():
    class GradAccumulation(GradAccumulationCell):  # the other routed name
        pass
    assert not _is_grad_accumulation(GradAccumulation(nn.WithLossCell(make_mlp(), ce()), 2))


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("sink", [False, True])
def test_model_train_matches_reference_and_loss_monitor_prints_full_batch_loss(sink, capsys):
    ref_net = make_mlp()
    initial = params_of(ref_net)
    _, expected_losses = _train_with_model(nn.WithLossCell(ref_net, ce()), ref_net, sink=sink)

    net = make_mlp()
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), 4)
    capsys.readouterr()
    _, losses = _train_with_model(cell, net, sink=sink, callbacks=[LossMonitor(1)])
    printed = [float(v) for v in re.findall(r"loss is ([-0-9.e]+)", capsys.readouterr().out)]

    assert_params_moved(params_of(ref_net), initial)
    assert_params_close(params_of(net), params_of(ref_net), rtol=1e-5, atol=1e-6)
    # Against the plain network under the same sink settings: a device that sinks reports once per sunk epoch (the
    # last step's loss), CPU every step.
    assert len(losses) == len(printed) == len(expected_losses) == (1 if sink and device_sinks() else STEPS)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    np.testing.assert_allclose(printed, expected_losses, rtol=1e-4)


def test_model_mindspore_own_cell_trains_nothing_outside_parallel():
    # The trap this package exists to avoid, kept as a control: if MindSpore ever fixes it, this tells us.
    net = make_mlp()
    initial = params_of(net)
    mindspore_cell = nn.GradAccumulationCell(nn.WithLossCell(net, ce()), 4)
    _, losses = _train_with_model(mindspore_cell, net, optimizer="sgd")
    for name, value in params_of(net).items():
        np.testing.assert_array_equal(value, initial[name], err_msg=name)
    ref_net = make_mlp()
    _, full_batch_losses = _train_with_model(nn.WithLossCell(ref_net, ce()), ref_net, optimizer="sgd")
    # It reports the SUM of the 4 micro-batch losses of untrained weights.
    assert losses[0] == pytest.approx(4 * full_batch_losses[0], rel=1e-4)


@pytest.mark.slow
@pytest.mark.lowest
def test_model_checkpoint_loads_into_bare_network_and_resumes_exactly(tmp_path):
    net = make_mlp()
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), 4)
    checkpoint = ModelCheckpoint(prefix="mlp", directory=str(tmp_path),
                                 config=CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10))
    model, _ = _train_with_model(cell, net, optimizer="adam", callbacks=[checkpoint])
    # What the README says to save without the accumulator.
    ms.save_checkpoint(model.train_network, str(tmp_path / "without_accumulator.ckpt"),
                       choice_func=lambda name: not name.startswith("accu_grads."))
    without = ms.load_checkpoint(str(tmp_path / "without_accumulator.ckpt"))
    assert set(params_of(net)) <= set(without) and not [k for k in without if k.startswith("accu_grads.")]

    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".ckpt") and f.startswith("mlp"))
    assert files == ["mlp-1_2.ckpt", "mlp-1_4.ckpt"]
    saved = ms.load_checkpoint(str(tmp_path / files[-1]))

    # The network's weights, the optimizer's own state, and the accumulator: one accu_grads.<weight> per weight.
    optimizer_state = {k for k in saved if k.startswith(("moment1.", "moment2.")) or k in
                       {"global_step", "beta1_power", "beta2_power", "learning_rate", "weight_decay"}}
    accumulator = {f"accu_grads.{name}" for name in params_of(net)}
    assert set(saved) - optimizer_state == set(params_of(net)) | accumulator, sorted(saved)

    bare = make_mlp(seed=123)
    param_not_loaded, _ = ms.load_param_into_net(bare, saved)
    assert param_not_loaded == []
    assert_params_close(params_of(bare), params_of(net), rtol=0, atol=0)

    # Resumed from the middle (step 2 of 4), with or without the accumulator's saved content (it is rewritten
    # by every step's first micro-batch): bit-identical to the uninterrupted run.
    for keep_accumulator in (True, False):
        middle = ms.load_checkpoint(str(tmp_path / files[0]))   # afresh: loading shares its Parameters' data
        resumed = make_mlp(seed=123)
        resumed_cell = GradAccumulationCell(nn.WithLossCell(resumed, ce()), 4)
        optimizer = make_optimizer("adam", resumed.trainable_params())
        state = {k: v for k, v in middle.items() if keep_accumulator or not k.startswith("accu_grads.")}
        ms.load_param_into_net(resumed_cell, state)
        ms.load_param_into_net(optimizer, state)
        Model(resumed_cell, optimizer=optimizer).train(1, _dataset().skip(2), dataset_sink_mode=False)
        assert_params_close(params_of(resumed), params_of(net), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE], ids=["graph", "pynative"])
def test_model_loss_fn_style_is_refused_with_the_form_that_works(mode):
    # Model(cell, loss_fn=...) builds a WithLossCell around the cell: it would get the data without its labels.
    ms.set_context(mode=mode)
    net = make_mlp()
    initial = params_of(net)
    model = Model(GradAccumulationCell(net, 4), loss_fn=ce(), optimizer=make_optimizer("sgd", net.trainable_params()))
    # Graph mode binds the cell from the tree it compiles and names the wrapper; PyNative mode hands over no tree, and
    # the backbone's output says it (0.3.0 read the wrapper from the stack there too): the same fix either way.
    fix = r"Model\(GradAccumulationCell\(nn.WithLossCell\(network, loss_fn\), micro_size\), optimizer=...\)"
    message = (r"For 'GradAccumulationCell', the loss must be computed inside the cell, but it is the backbone of "
               r"WithLossCell, .* Put the loss inside: " + fix if mode == ms.GRAPH_MODE else
               r"For 'GradAccumulationCell', the argument 'network' must return a single-element loss .* returned "
               r"shape \(8, 4\).* the backbone of a cell that computes the loss of its output \(Model\(cell, "
               r"loss_fn=...\) builds one\), it gets the data without its labels: put the loss inside, " + fix)
    with pytest.raises(ValueError, match=message):
        model.train(1, _dataset(), dataset_sink_mode=False)
    with pytest.raises(ValueError, match=message):   # the same built by hand
        nn.TrainOneStepCell(nn.WithLossCell(GradAccumulationCell(net, 4), ce()),
                            make_optimizer("sgd", net.trainable_params()))(*next(_dataset().create_tuple_iterator()))
    assert all(np.array_equal(value, initial[name]) for name, value in params_of(net).items())
    # The refusal leaves the process able to train: in PyNative mode the error used to leave MindSpore's gradient
    # recording open, and a gradient computed next in graph mode failed with an unrelated shape error (AddN).
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)   # built with its parallel part
    probe = GradAccumulationCell(nn.WithLossCell(make_mlp(), ce()), 4)
    ms.reset_auto_parallel_context()
    x, y = next(_dataset().create_tuple_iterator())
    loss, _ = ms.value_and_grad(probe.parallel_pass_part, None, probe.trainable_params())(x, y)
    assert np.isfinite(loss.asnumpy())
    # And the form the message names trains exactly like the full batch.
    ms.set_context(mode=mode)
    ref_net = make_mlp()
    _, expected_losses = _train_with_model(nn.WithLossCell(ref_net, ce()), ref_net)
    _, losses = _train_with_model(GradAccumulationCell(nn.WithLossCell(net, ce()), 4), net)
    assert_params_moved(params_of(ref_net), initial)
    assert_params_close(params_of(net), params_of(ref_net), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
