"""ms_gradaccum.mindocr: mindocr's train step through the package, against the plain full batch, with mindocr 0.5.0's
own wrapper as the control. mindocr's package does not import on MindSpore 2.10 (it imports
mindspore.parallel._transformer, removed there), so its wrapper and EMA are loaded from their files, as mindocr's own
modules, without the package's __init__. Skipped, saying why, without mindocr."""
import importlib
import importlib.util
import sys

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, Tensor

from helpers import (ce, make_mlp, make_optimizer, max_abs_diff, params_of, update_ratios, window_reference,
                     zoo_batches, zoo_step_run)
from launch import import_without

if importlib.util.find_spec("mindocr") is None:
    pytest.skip("mindocr is not installed (.ci/run installs 0.5.0)", allow_module_level=True)

from ms_gradaccum.mindocr import TrainOneStepWrapper  # noqa: E402

pytestmark = pytest.mark.realmodels
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
EMA_START = 4000   # EMA decay 0.9 * (1 - exp(-updates / 2000)) = 0.78: how many updates ran shows in the weights


def _mindocr(name: str):
    """mindocr's own module ``mindocr.<name>``, loaded without running mindocr's package __init__ (see above): the
    packages on the way are created from their specs but not executed."""
    for package in ("mindocr", "mindocr.utils"):
        if package not in sys.modules:
            spec = importlib.util.find_spec(package)
            sys.modules[package] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"mindocr.{name}")


MindocrWrapper = _mindocr("utils.train_step_wrapper").TrainOneStepWrapper
EMA = _mindocr("utils.ema").EMA


def _ema(decay):
    """How the tests make mindocr's EMA (None: none), starting at EMA_START updates."""
    return None if decay is None else lambda net: EMA(net, ema_decay=decay, updates=EMA_START)


def _full_batch(batches, windows, optimizer="sgd", ema_decay=None, clip=None):
    return window_reference(batches, windows, optimizer, _ema(ema_decay), clip)


def _wrapped(cls, batches, steps, optimizer="sgd", ema_decay=None, **kwargs):
    return zoo_step_run(cls, batches, steps, optimizer, _ema(ema_decay), scale_sense=Tensor(1.0, ms.float32), **kwargs)


def _ema_weights(ema):
    return {p.name: p.asnumpy() for p in ema.ema_weight}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mindocr_wrapper_short_batches_equal_full_batch_and_mindocr_is_off(optimizer):
    # Windows of 3 batches of 8, 8, 5 rows: the mean over the window's 21 rows (mindocr: each batch's mean / 3).
    batches = zoo_batches([8, 8, 5, 8, 8, 5])
    expected, _ = _full_batch(batches, [3, 3], optimizer)
    initial = params_of(make_mlp())
    ours, _, step, outputs = _wrapped(TrainOneStepWrapper, batches, 3, optimizer)
    for name in expected:
        np.testing.assert_allclose(ours[name], expected[name], **TOLERANCE, err_msg=name)
    assert len(outputs[0]) == 3 and not bool(outputs[-1][1].asnumpy())   # (loss, overflow, loss scale), as mindocr's
    assert int(step.optimizer.global_step.asnumpy().reshape(-1)[0]) == 2
    # Control: mindocr's own wrapper on the same batches, measured in updates of the full-batch run.
    theirs, _, _, _ = _wrapped(MindocrWrapper, batches, 3, optimizer)
    assert max(update_ratios(theirs, expected, initial).values()) > 1e-3, "mindocr's own wrapper is not off here"
    assert max_abs_diff(theirs, expected) > 1e-5


@pytest.mark.slow
def test_mindocr_wrapper_ema_and_clip_once_per_optimizer_step():
    batches = zoo_batches([8, 8, 8, 8, 8, 8])
    clip = 0.05   # binding: the window gradients' norms are larger
    expected, full_ema = _full_batch(batches, [3, 3], ema_decay=0.9, clip=clip)
    ours, ema, _, _ = _wrapped(TrainOneStepWrapper, batches, 3, ema_decay=0.9, clip_grad=True, clip_norm=clip)
    for name in expected:
        np.testing.assert_allclose(ours[name], expected[name], **TOLERANCE, err_msg=name)
    assert float(ema.updates.asnumpy()) == EMA_START + 2
    for name, value in _ema_weights(full_ema).items():
        np.testing.assert_allclose(_ema_weights(ema)[name], value, **TOLERANCE, err_msg=name)
    # Control: mindocr's own wrapper updates its EMA on every call (6), so its EMA weights land elsewhere; it clips
    # once per window as well, so with even batches its weights are the full batch's.
    theirs, their_ema, _, _ = _wrapped(MindocrWrapper, batches, 3, ema_decay=0.9, clip_grad=True, clip_norm=clip)
    assert float(their_ema.updates.asnumpy()) == EMA_START + 6
    assert max_abs_diff(_ema_weights(their_ema), _ema_weights(full_ema)) > 1e-4
    assert max_abs_diff(theirs, expected) < 1e-5


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(gradient_accumulation_steps=0), ValueError, ["'gradient_accumulation_steps'"]),
    (dict(updates=3), ValueError, ["'updates'", "mindocr's own wrapper ignores it", "EMA(network, updates=3)"]),
    (dict(ema=object()), TypeError, ["'ema'", "ema_update()"]),
    (dict(clip_norm=0.0), ValueError, ["'clip_norm'"]),
    (dict(verbose=True), ValueError, ["'verbose'", "True", "mindocr's own wrapper stores it and prints nothing"]),
    (dict(verbose="yes"), TypeError, ["'verbose'", "'yes'"]),
])
def test_mindocr_wrapper_bad_arguments_name_the_argument(kwargs, error, words):
    net = make_mlp()
    with pytest.raises(error) as raised:
        TrainOneStepWrapper(nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()), **kwargs)
    assert all(word in str(raised.value) for word in words), str(raised.value)


@pytest.mark.slow
def test_mindocr_import_isolation():
    """The package never imports mindocr; without mindocr, ms_gradaccum.mindocr says how to install it."""
    assert "pip install mindocr==0.5.0" in import_without("ms_gradaccum.mindocr", "mindocr")
