"""ms_gradaccum.mindone: mindone's diffusion train step (TrainOneStepWrapper) and its Transformers Trainer through the
package, against the plain full batch; each with a control showing mindone 0.5.0's own accumulation off on the same
data. mindone's models do not run on CPU, so the networks are small ones that do, inside mindone's own wrapper, EMA,
callbacks, resume function and Trainer. Skipped, saying why, without mindone."""
import os
import subprocess
import sys

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, Tensor

from helpers import (assert_params_close, assert_updates_close, ce, make_mlp, make_optimizer, max_abs_diff, params_of,
                     update_ratios, window_reference, zoo_batches, zoo_step_run)
from launch import import_without, REPO, repo_env

for _module in ("mindone.trainers.train_step", "mindone.transformers"):
    pytest.importorskip(_module, reason="mindone cannot be imported here (.ci/run installs 0.5.0)")
from mindone.trainers.callback import EvalSaveCallback, OverflowMonitor  # noqa: E402
from mindone.trainers.checkpoint import resume_train_network  # noqa: E402
from mindone.trainers.ema import EMA  # noqa: E402
from mindone.trainers.train_step import TrainOneStepWrapper as MindoneWrapper  # noqa: E402

from ms_gradaccum.mindone import TrainOneStepWrapper  # noqa: E402

pytestmark = pytest.mark.realmodels

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
# EMAs start as if resumed after 4000 updates: mindone's decay 0.9 * (1 - exp(-updates / 2000)) is then 0.78, not
# about 0, so that how many updates ran shows in the weights.
EMA_START = 4000


def _ema(decay):
    """How the tests make mindone's EMA (None: none), starting at EMA_START updates."""
    return None if decay is None else lambda net: EMA(net, ema_decay=decay, updates=EMA_START, offloading=False)


def _full_batch(batches, windows, optimizer="sgd", ema_decay=None, clip=None):
    return window_reference(batches, windows, optimizer, _ema(ema_decay), clip)


def _wrapped(cls, batches, steps, optimizer="sgd", ema_decay=None, **kwargs):
    if cls is MindoneWrapper:
        kwargs.setdefault("scale_sense", Tensor(1.0, ms.float32))   # mindone's default 1.0 fails on MindSpore 2.10
    return zoo_step_run(cls, batches, steps, optimizer, _ema(ema_decay), **kwargs)


def _global_step(optimizer):
    return int(optimizer.global_step.asnumpy().reshape(-1)[0])


def _ema_weights(ema):
    return {p.name: p.asnumpy() for p in ema.ema_weight}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_mindone_wrapper_short_batches_equal_full_batch_and_mindone_is_off(optimizer):
    """Windows of [4, 4] and [4, 2] rows: the full batches of 8 and 6 rows. mindone's own wrapper adds each batch's
    mean / K whatever its rows: off by 0.303 of an update here with SGD."""
    batches = zoo_batches([4, 4, 4, 2])
    expected, _ = _full_batch(batches, [2, 2], optimizer)
    actual, _, step, outputs = _wrapped(TrainOneStepWrapper, batches, 2, optimizer)
    assert_params_close(actual, expected, **TOLERANCE)
    loss, overflow, scale = outputs[-1]
    assert not overflow and float(scale) == 1.0 and np.isfinite(float(loss))
    assert step.pending_batches == 0 and _global_step(step.optimizer) == 2
    theirs, _, _, _ = _wrapped(MindoneWrapper, batches, 2, optimizer)
    off = max(update_ratios(theirs, expected, params_of(make_mlp())).values())
    if optimizer == "sgd":
        assert 0.25 < off < 0.35, off   # 0.303 of an update measured on these batches (the issue's: 0.209)
    assert off > 0.05, off


@pytest.mark.slow
def test_mindone_wrapper_epoch_last_window_applied_under_model_and_mindone_drops_it():
    """Model.train with mindone's OverflowMonitor, 2 epochs of 3 batches, K=2, steps_per_epoch=3: windows [2, 1] per
    epoch, equal to the full batches; mindone's wrapper never applies the partial windows (windows span epochs and
    the last one stays pending)."""
    import mindspore.dataset as ds
    batches = zoo_batches([4, 4, 4])
    rows = [(x[i], y[i]) for x, y in batches for i in range(len(x))]

    def dataset():
        return ds.GeneratorDataset(rows, ["x", "y"], shuffle=False).batch(4)

    expected, _ = _full_batch(batches * 2, [2, 1, 2, 1])
    net = make_mlp()
    step = TrainOneStepWrapper(nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()),
                               gradient_accumulation_steps=2, steps_per_epoch=3)
    ms.Model(step).train(2, dataset(), callbacks=[OverflowMonitor()], dataset_sink_mode=False)
    assert_params_close(params_of(net), expected, **TOLERANCE)
    assert step.pending_batches == 0 and _global_step(step.optimizer) == 4
    theirs, _, mindone_step, _ = _wrapped(MindoneWrapper, batches * 2, 2)
    dropped, _ = _full_batch(batches * 2, [2, 2, 2])
    assert max_abs_diff(theirs, dropped) < 1e-5   # mindone: 3 windows of 2 across the epochs, not 4
    assert max_abs_diff(theirs, expected) > 1e-3


@pytest.mark.slow
def test_mindone_wrapper_ema_once_per_optimizer_step_equals_full_batch_ema():
    batches = zoo_batches([4, 4, 4, 4, 4, 4])
    expected, expected_ema = _full_batch(batches, [3, 3], "momentum", ema_decay=0.9)
    actual, ema, _, _ = _wrapped(TrainOneStepWrapper, batches, 3, "momentum", ema_decay=0.9)
    assert_params_close(actual, expected, **TOLERANCE)
    assert float(ema.updates.asnumpy()) == EMA_START + 2
    assert_params_close(_ema_weights(ema), _ema_weights(expected_ema), **TOLERANCE)
    _, their_ema, _, _ = _wrapped(MindoneWrapper, batches, 3, "momentum", ema_decay=0.9)
    assert float(their_ema.updates.asnumpy()) == EMA_START + 6   # mindone: one EMA update per batch
    assert max_abs_diff(_ema_weights(their_ema), _ema_weights(expected_ema)) > 1e-3


@pytest.mark.slow
def test_mindone_wrapper_clip_grad_clips_the_window_gradient_once():
    batches = zoo_batches([4, 4, 4, 4])
    expected, _ = _full_batch(batches, [2, 2], clip=0.05)
    actual, _, _, _ = _wrapped(TrainOneStepWrapper, batches, 2, clip_grad=True, clip_norm=0.05)
    assert_params_close(actual, expected, **TOLERANCE)
    unclipped, _ = _full_batch(batches, [2, 2])
    assert max_abs_diff(unclipped, expected) > 1e-3   # the clip binds


@pytest.mark.slow
def test_mindone_wrapper_overflowing_window_skipped_exactly_or_applied_when_asked():
    """A NaN row in the second window: with a dynamic loss scale that window is skipped (weights as after the first
    window, scale halved) and the third trains as the full batch; drop_overflow_update=False applies it."""
    batches = zoo_batches([4, 4, 4, 4, 4, 4])
    batches[2][0][1, 3] = np.nan
    expected, _ = _full_batch(batches[:2] + batches[4:], [2, 2])
    manager = nn.DynamicLossScaleUpdateCell(loss_scale_value=2.0 ** 10, scale_factor=2, scale_window=100)
    actual, _, step, outputs = _wrapped(TrainOneStepWrapper, batches, 2, scale_sense=manager)
    assert [bool(out[1]) for out in outputs] == [False, False, False, True, False, False]
    assert float(outputs[3][2]) == 2.0 ** 9
    assert_params_close(actual, expected, **TOLERANCE)
    applied, _, _, _ = _wrapped(TrainOneStepWrapper, batches, 2, scale_sense=2.0 ** 10, drop_overflow_update=False)
    assert not all(np.isfinite(value).all() for value in applied.values())


@pytest.mark.slow
def test_mindone_wrapper_resume_mid_window_through_evalsavecallback_and_resume_train_network(tmp_path):
    """Epoch 1 of 3 batches with K=2 leaves one batch pending; mindone's EvalSaveCallback saves train_resume.ckpt,
    mindone's resume_train_network(network, optimizer, ckpt) loads it into a fresh run, which ends as the
    uninterrupted one. Control: the same checkpoint without the window state ends elsewhere."""
    import mindspore.dataset as ds
    batches = zoo_batches([4, 4, 4, 4, 4, 4])
    rows = [(x[i], y[i]) for x, y in batches for i in range(len(x))]

    def epoch(index):
        return ds.GeneratorDataset(rows[12 * index:12 * (index + 1)], ["x", "y"], shuffle=False).batch(4)

    def build():
        net = make_mlp()
        opt = make_optimizer("adam", net.trainable_params())
        return net, opt, TrainOneStepWrapper(nn.WithLossCell(net, ce()), opt, gradient_accumulation_steps=2)

    expected, _ = _full_batch(batches, [2, 2, 2], "adam")
    net, opt, step = build()
    saver = EvalSaveCallback(net, ckpt_save_dir=str(tmp_path / "ckpt"), output_dir=str(tmp_path), record_lr=False)
    with pytest.warns(UserWarning, match="never applied"):
        ms.Model(step).train(1, epoch(0), callbacks=[saver], dataset_sink_mode=False)
    assert step.pending_batches == 1
    resume = str(tmp_path / "ckpt" / "train_resume.ckpt")
    net, opt, step = build()
    resume_train_network(net, opt, resume)
    assert step.pending_batches == 1
    for x, y in batches[3:]:
        step(Tensor(x), Tensor(y))
    assert_params_close(params_of(net), expected, **TOLERANCE)
    # Control: the window's state left out of the checkpoint.
    net, opt, step = build()
    state = {k: v for k, v in ms.load_checkpoint(resume).items() if not k.startswith(("accu_grads", "accu_state"))}
    ms.load_param_into_net(net, state)
    ms.load_param_into_net(opt, state)
    for x, y in batches[3:]:
        step(Tensor(x), Tensor(y))
    assert max_abs_diff(params_of(net), expected) > 1e-4


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(updates=3), ValueError, ["'updates'", "EMA(network, updates=3)"]),
    (dict(zero_helper=object()), ValueError, ["'zero_helper'", "ZeRO"]),
    (dict(ema=object()), TypeError, ["'ema'", "mindone.trainers.ema.EMA"]),
    (dict(clip_grad="yes"), TypeError, ["'clip_grad'", "'yes'"]),
    (dict(clip_norm=0.0), ValueError, ["'clip_norm'", "0.0"]),
    (dict(gradient_accumulation_steps=0), ValueError, ["'gradient_accumulation_steps'", "0"]),
    (dict(drop_overflow_update=None), TypeError, ["'drop_overflow_update'", "None"]),
    (dict(micro_size=0), ValueError, ["'micro_size'", "0"]),
    (dict(verbose=True), ValueError, ["'verbose'", "True", "mindone's own wrapper stores it and prints nothing"]),
])
def test_mindone_wrapper_bad_arguments_name_the_argument(kwargs, error, words):
    net = make_mlp()
    with pytest.raises(error) as raised:
        TrainOneStepWrapper(nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()), **kwargs)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))
    assert "TrainOneStepWrapper" in str(raised.value)


def test_mindone_import_isolation():
    """The package never imports mindone; without mindone, ms_gradaccum.mindone says how to install it."""
    assert "pip install mindone==0.5.0" in import_without("ms_gradaccum.mindone", "mindone")


# ---- mindone.transformers.Trainer -------------------------------------------------------------------------------

TRAINER_TOOL = os.path.join(REPO, "tests", "tools", "mindone_trainer.py")


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """One process: mindone's Trainer at K=1 on batches of 4 rows (the full batch), this package's Trainer at K=2 on
    batches of 2, mindone's at K=1 on batches of 2 (control), for SGD and AdamW; 10 rows, 2 epochs."""
    out = tmp_path_factory.mktemp("mindone_trainer")
    done = subprocess.run([sys.executable, TRAINER_TOOL, str(out)], env=repo_env(GLOG_v="3"), capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_mindone_trainer_accumulation_equals_full_batch_with_last_short_window(trainer_runs, optim):
    out, _ = trainer_runs
    full = dict(np.load(out / f"full_{optim}.npz"))
    ours = dict(np.load(out / f"ours_{optim}.npz"))
    plain = dict(np.load(out / f"plain_{optim}.npz"))
    names = [key[len("param:"):] for key in full if key.startswith("param:")]
    assert names

    def weights(result, prefix="param:"):
        return {name: result[prefix + name] for name in names}

    # Within 1e-3 of each parameter's own update (AdamW's normalisation magnifies float32 summation order: 1e-4
    # measured; SGD 1.4e-5); the control, without accumulation, is off by more than its update.
    assert_updates_close(weights(ours), weights(full), weights(full, "initial:"), fraction=1e-3)
    assert max(update_ratios(weights(plain), weights(full), weights(full, "initial:")).values()) > 0.5
    # mindone's own counting (3 optimizer steps an epoch: 4 + 4 + 2 rows) and logged losses, as for the full batch.
    assert int(ours["global_step"]) == int(full["global_step"]) == 6
    np.testing.assert_allclose(ours["logged_loss"], full["logged_loss"], rtol=1e-4)
    # The arguments are the user's again after train().
    assert tuple(ours["args_after"]) == (2, 2)


@pytest.mark.slow
def test_mindone_trainer_checkpoints_hold_the_trained_weights(trainer_runs):
    out, _ = trainer_runs
    ours = dict(np.load(out / "ours_sgd.npz"))
    saved = dict(np.load(out / "ours_sgd_checkpoint.npz"))
    assert sorted(saved) == sorted(key for key in ours if key.startswith("param:"))
    for key, value in saved.items():
        np.testing.assert_array_equal(value, ours[key])


@pytest.mark.slow
def test_mindone_trainer_own_accumulation_does_not_compile(trainer_runs):
    """The control, measured: mindone 0.5.0's Trainer with gradient_accumulation_steps=2 and no ZeRO."""
    _, output = trainer_runs
    assert "MINDONE_K2: AttributeError" in output and "accumulated_grads" in output, output[-3000:]


@pytest.mark.slow
def test_mindone_trainer_token_losses_exact_when_declared_and_refused_when_not(trainer_runs):
    """Rows with ignored labels: micro-batches of 2 rows count 1, 2, 0, 2, 1, 1 tokens. With per_token_loss=True and
    the model returning (loss_sum, count), the full batch's token mean exactly; the loss kind left undeclared is
    refused before training (a row-weighted token mean was 1.5e-3 off here, and the first-step check passed it)."""
    out, output = trainer_runs
    full, ours = dict(np.load(out / "full_tokens.npz")), dict(np.load(out / "ours_tokens.npz"))
    names = [key for key in full if key.startswith("param:")]
    assert max(float(np.abs(ours[key] - full[key]).max()) for key in names) < 1e-6
    np.testing.assert_allclose(ours["logged_loss"], full["logged_loss"], rtol=1e-4)
    assert "UNDECLARED: ValueError" in output and "per_token_loss=False" in output, output[-3000:]


@pytest.mark.slow
def test_mindone_trainer_refuses_zero3(trainer_runs):
    _, output = trainer_runs
    assert "ZERO3: ValueError" in output and "use_zero3" in output, output[-2000:]


@pytest.mark.slow
def test_mindone_sample_trains_and_matches_full_batch(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "sample_code", "mindone_diffusion", "train.py"),
                           "--output_path", str(tmp_path), "--check"], env=repo_env(GLOG_v="3"),
                          capture_output=True, text=True, timeout=600, check=False, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "matches the full batch" in done.stdout, done.stdout[-2000:]
    assert (tmp_path / "ckpt").is_dir()
