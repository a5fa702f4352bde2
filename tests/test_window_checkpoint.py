"""Checkpoints written before the window state became one cell (ms_gradaccum 0.1.0, commit 171a940) load unchanged:
the same ``accu_state.*`` and ``accu_grads.*`` names, and a run resumed from one taken mid-window ends with the weights
of the uninterrupted run."""
import os

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, Parameter, Tensor

from ms_gradaccum import AccumulatingTrainOneStepCell

pytestmark = pytest.mark.lowest

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "steps_mid_window_0.1.0.ckpt")
STATE = {"accu_state.window_position", "accu_state.epoch_position", "accu_state.accumulate_steps",
         "accu_state.steps_per_epoch", "accu_state.window_loss_sum", "accu_state.window_count",
         "accu_state.window_rows", "accu_state.count_unit", "accu_state.last_window_loss"}


def _batches(count=5):
    rng = np.random.default_rng(7)
    return [(Tensor(rng.standard_normal((6, 4)).astype(np.float32)),
             Tensor(rng.standard_normal((6, 2)).astype(np.float32))) for _ in range(count)]


def _train_cell():
    """Dense(4, 2) with fixed weights, Momentum, windows of 3 batches, each batch split in 2."""
    net = nn.Dense(4, 2)
    net.weight.set_data(Tensor(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)))
    net.bias.set_data(Tensor(np.array([0.1, -0.2], np.float32)))
    optimizer = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    return net, AccumulatingTrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer, 3, micro_size=2)


def write_fixture(path=FIXTURE):
    """How the fixture was written (by the code before the change): two batches of a three-batch window."""
    ms.set_context(mode=ms.GRAPH_MODE)
    _, cell = _train_cell()
    for x, y in _batches()[:2]:
        cell(x, y)
    ms.save_checkpoint(cell, path)


@pytest.mark.slow
def test_window_checkpoint_written_before_the_window_cell_resumes_exactly():
    ms.set_context(mode=ms.GRAPH_MODE)
    batches = _batches()
    net, cell = _train_cell()
    for x, y in batches:
        cell(x, y)
    expected = {p.name: p.asnumpy().copy() for p in net.trainable_params()}

    saved = ms.load_checkpoint(FIXTURE)
    assert STATE <= set(saved), sorted(STATE - set(saved))
    assert int(saved["accu_state.window_position"].asnumpy()) == 2
    resumed_net, resumed = _train_cell()
    names = {p.name for p in resumed.get_parameters()}
    assert STATE <= names and {f"accu_grads.{p.name}" for p in resumed_net.trainable_params()} <= names
    not_loaded, _ = ms.load_param_into_net(resumed, saved, strict_load=True)
    assert not not_loaded
    assert resumed.pending_batches == 2
    for x, y in batches[2:]:
        resumed(x, y)
    for p in resumed_net.trainable_params():
        np.testing.assert_allclose(p.asnumpy(), expected[p.name], rtol=1e-6, atol=1e-7)

    # Negative control: the same weights without the window state (a fresh window) end elsewhere.
    fresh_net, fresh = _train_cell()
    ms.load_param_into_net(fresh, {k: Parameter(v) if not isinstance(v, Parameter) else v
                                   for k, v in saved.items() if not k.startswith(("accu_state", "accu_grads"))})
    for x, y in batches[2:]:
        fresh(x, y)
    assert max(float(np.abs(p.asnumpy() - expected[p.name]).max()) for p in fresh_net.trainable_params()) > 1e-4
