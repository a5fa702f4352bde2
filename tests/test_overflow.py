"""Overflow: a non-finite gradient in any micro-batch or batch of a window skips the optimizer step exactly, and the
loss scale follows (lowered once, regrown after clean steps, restored from checkpoints)."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, Tensor

from ms_gradaccum import GradAccumulationCell
from helpers import (assert_params_equal, assert_params_moved, classification_batches, low_precision_mlp, params_of,
                     small_loss_train_cell)

K = 4
BATCH = 32


_SCALE_STATE = ("scale_sense", "current_iterator_step", "last_overflow_iterator_step")


def _train_state(cell):
    """Everything an optimizer step may change, without the loss-scale state and the window counters."""
    return {p.name: p.asnumpy().copy() for p in cell.get_parameters()
            if p.name not in _SCALE_STATE and not p.name.startswith("accu_state.")}


def _poisoned(x, rows):
    x = x.copy()
    x[rows] = 1e5   # beyond float16's 65504: inf activations, non-finite loss and gradients
    return x


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_overflow_in_one_micro_batch_skips_the_step_exactly(where):
    micro = BATCH // K
    rows = {"first": [0], "middle": [2 * micro + 1], "last": [BATCH - 1]}[where]
    (x, y), (x2, y2) = classification_batches(2, BATCH)
    net = low_precision_mlp()
    cell = small_loss_train_cell(net, lambda loss_net: GradAccumulationCell(loss_net, K), optimizer="adam",
                         scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 1000))
    cell(Tensor(x2), Tensor(y2))                      # one clean step first, so the Adam moments are non-zero
    before = _train_state(cell)
    _, overflow, scale = cell(Tensor(_poisoned(x, rows)), Tensor(y))
    assert bool(overflow) and float(scale.asnumpy()) == 2.0 ** 9      # lowered once
    assert_params_equal(_train_state(cell), before)                   # weights, moments, global_step
    assert not np.any(cell.grad_sums[0].asnumpy())                     # accumulators cleared

    _, overflow, _ = cell(Tensor(x), Tensor(y))                        # the next clean step trains ...
    twin_net = low_precision_mlp()
    twin = small_loss_train_cell(twin_net, lambda loss_net: GradAccumulationCell(loss_net, K), optimizer="adam",
                         scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 1000))
    twin(Tensor(x2), Tensor(y2))
    twin.scale_sense.set_data(Tensor(2.0 ** 9, ms.float32))
    twin(Tensor(x), Tensor(y))
    assert not overflow
    assert_params_equal(params_of(net), params_of(twin_net))         # ... exactly as if the bad batch never came


def test_overflow_in_one_batch_of_a_window_skips_the_window():
    batches = classification_batches(3, 8)
    net = low_precision_mlp()
    cell = small_loss_train_cell(net, accumulate_steps=3,
                         scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 1000))
    before = _train_state(cell)
    flags = []
    for i, (x, y) in enumerate(batches):
        _, overflow, scale = cell(Tensor(_poisoned(x, [3]) if i == 1 else x), Tensor(y))
        flags.append(bool(overflow))
    assert flags == [False, False, True] and float(scale.asnumpy()) == 2.0 ** 9
    assert_params_equal(_train_state(cell), before)
    assert cell.pending_batches == 0 and not np.any(cell.grad_sums[0].asnumpy())
    for x, y in batches:                                               # a clean window then trains
        _, overflow, _ = cell(Tensor(x), Tensor(y))
    assert not overflow
    assert_params_moved(params_of(net), {n: v for n, v in before.items() if n in params_of(net)}, min_change=0.0)


def test_overflow_dynamic_scale_grows_after_scale_window_clean_steps():
    net = low_precision_mlp()
    cell = small_loss_train_cell(net, accumulate_steps=2, scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 4, 2, 2))
    scales = []
    for x, y in classification_batches(8, 8):   # 4 windows of 2 batches: the scale changes only at window ends
        scales.append(float(cell(Tensor(x), Tensor(y))[2].asnumpy()))
    assert scales == [16, 16, 16, 32, 32, 32, 32, 64]


def test_overflow_fixed_update_cell_skips_without_lowering():
    (x, y), = classification_batches(1, BATCH)
    cell = small_loss_train_cell(low_precision_mlp(), scale_sense=nn.FixedLossScaleUpdateCell(2.0 ** 10))
    before = _train_state(cell)
    _, overflow, scale = cell(Tensor(_poisoned(x, [0])), Tensor(y))
    assert bool(overflow) and float(scale.asnumpy()) == 2.0 ** 10
    assert_params_equal(_train_state(cell), before)


def test_overflow_plain_tensor_scale_skips_overflowing_steps():
    (x, y), = classification_batches(1, BATCH)
    cell = small_loss_train_cell(low_precision_mlp(), scale_sense=Tensor(2.0 ** 10, ms.float32))
    before = _train_state(cell)
    assert bool(cell(Tensor(_poisoned(x, [0])), Tensor(y))[1])
    assert_params_equal(_train_state(cell), before)


@pytest.mark.slow
def test_overflow_resume_from_checkpoint_keeps_the_scale(tmp_path):
    batches = classification_batches(6, 8)
    poisoned = [(_poisoned(x, [0]) if i == 1 else x, y) for i, (x, y) in enumerate(batches)]

    def fresh():
        net = low_precision_mlp()
        return net, small_loss_train_cell(net, accumulate_steps=2, optimizer="adam",
                                  scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 2))

    net, cell = fresh()
    for x, y in poisoned:
        cell(Tensor(x), Tensor(y))
    first_net, first = fresh()
    for x, y in poisoned[:3]:
        first(Tensor(x), Tensor(y))
    assert float(first.scale_sense.asnumpy()) == 2.0 ** 9                # lowered by the poisoned window
    path = str(tmp_path / "scaled.ckpt")
    ms.save_checkpoint(first, path)
    resumed_net, resumed = fresh()
    not_loaded, _ = ms.load_param_into_net(resumed, ms.load_checkpoint(path))
    assert not_loaded == [] and float(resumed.scale_sense.asnumpy()) == 2.0 ** 9
    for x, y in poisoned[3:]:
        resumed(Tensor(x), Tensor(y))
    assert float(resumed.scale_sense.asnumpy()) == float(cell.scale_sense.asnumpy()) == 2.0 ** 10  # regrown
    assert_params_equal(params_of(resumed_net), params_of(net))
