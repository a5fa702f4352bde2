"""BatchNorm under accumulation (core.batch_norm): 'per_step' moves the moving statistics once per optimizer step as the
full batch does (the first BatchNorm layer exactly), 'frozen' trains exactly, 'micro' is the per-micro-batch control;
the warning, the bad values, a window of batches, checkpoints, PyNative mode."""
import re
import warnings

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn

from helpers import _seeded, ce, make_bn_mlp, make_optimizer, params_of, assert_params_close, assert_params_moved
from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell

ROWS, MICRO = 30, 4   # an uneven split: 8, 8, 7, 7


_dense_bn = make_bn_mlp


def _conv_bn(momentum: float = 0.9, seed: int = 0) -> nn.Cell:
    return _seeded(nn.SequentialCell(nn.Conv2d(3, 4, 3, pad_mode="valid", has_bias=True),
                                     nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Flatten(),
                                     nn.Dense(4 * 4 * 4, 3)), seed)


def _batches(conv: bool, steps: int = 3, rows: int = ROWS, seed: int = 0) -> list:
    rng = np.random.RandomState(seed)
    shape = (3, 6, 6) if conv else (5,)
    # Shifted and scaled, so that the statistics are far from the moving ones' start (0 and 1).
    return [(ms.Tensor((rng.randn(rows, *shape) * (1.5 + step) + 0.7 * step).astype(np.float32)),
             ms.Tensor(rng.randint(0, 3, rows).astype(np.int32))) for step in range(steps)]


def _first_bn(net: nn.Cell) -> nn.Cell:
    return [cell for _, cell in net.cells_and_names() if isinstance(cell, (nn.BatchNorm1d, nn.BatchNorm2d))][0]


def _moving(net: nn.Cell) -> tuple:
    bn = _first_bn(net)
    return bn.moving_mean.asnumpy().copy(), bn.moving_variance.asnumpy().copy()


def _twin_runs(make_net, batches, make_step, lr: float = 0.0) -> tuple:
    """The first BatchNorm layer's moving statistics after every step: the plain full batch in training mode, and the
    accumulating step `make_step(loss_net, optimizer)` on twin weights."""
    reference, candidate = make_net(), make_net()
    plain = nn.TrainOneStepCell(nn.WithLossCell(reference, ce()), nn.SGD(reference.trainable_params(), lr))
    plain.set_train()
    step = make_step(nn.WithLossCell(candidate, ce()), nn.SGD(candidate.trainable_params(), lr))
    step.set_train()
    expected, actual = [], []
    for x, y in batches:
        plain(x, y)
        step(x, y)
        expected.append(_moving(reference))
        actual.append(_moving(candidate))
    return expected, actual, reference, candidate


def _gap(expected, actual) -> float:
    """The largest difference of the moving statistics over all steps, relative to their size."""
    return max(float(np.abs(e - a).max() / max(1.0, np.abs(e).max()))
               for pair_e, pair_a in zip(expected, actual) for e, a in zip(pair_e, pair_a))


def _grad_accumulation(batch_norm):
    def make(loss_net, optimizer):
        return nn.TrainOneStepCell(GradAccumulationCell(loss_net, MICRO, batch_norm=batch_norm), optimizer)
    return make


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("conv", [False, True], ids=["BatchNorm1d", "BatchNorm2d"])
@pytest.mark.parametrize("momentum", [0.9, 0.99])
def test_batch_norm_per_step_moves_the_moving_statistics_as_the_full_batch(conv, momentum):
    make_net = (lambda: _conv_bn(momentum)) if conv else (lambda: _dense_bn(momentum))
    batches = _batches(conv)
    expected, actual, _, _ = _twin_runs(make_net, batches, _grad_accumulation("per_step"))
    start = _moving(make_net())
    assert all(float(np.abs(e[0] - start[0]).max()) > 1e-3 for e in expected)   # they moved, every step
    assert _gap(expected, actual) < 2e-6, _gap(expected, actual)
    # Control: each micro-batch updating them (today's libraries) is far off, and so from the first step on.
    expected, actual, _, _ = _twin_runs(make_net, batches, _grad_accumulation("micro"))
    assert _gap(expected[:1], actual[:1]) > 1e-2


def test_batch_norm_per_step_in_pynative_mode():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        expected, actual, _, _ = _twin_runs(_conv_bn, _batches(True, steps=2), _grad_accumulation("per_step"))
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    assert _gap(expected, actual) < 2e-6, _gap(expected, actual)


def test_batch_norm_per_step_under_model():
    # Model.train puts the network in training mode; the statistics move once per batch (its step).
    batches = _batches(False, steps=3, rows=24)
    data = [(x.asnumpy(), y.asnumpy()) for x, y in batches]
    reference, candidate = _dense_bn(), _dense_bn()
    for net, cell in ((reference, nn.WithLossCell(reference, ce())),
                      (candidate, GradAccumulationCell(nn.WithLossCell(candidate, ce()), 3, batch_norm="per_step"))):
        dataset = ms.dataset.GeneratorDataset(lambda: iter(data), ["x", "y"], shuffle=False)
        ms.Model(cell, optimizer=nn.SGD(net.trainable_params(), 0.0)).train(1, dataset, dataset_sink_mode=False)
    assert float(np.abs(_moving(reference)[0] - _moving(_dense_bn())[0]).max()) > 0.05   # they moved
    for e, a in zip(_moving(reference), _moving(candidate)):
        assert float(np.abs(e - a).max()) < 2e-6


def test_batch_norm_window_of_batches_moves_them_once_as_the_batches_together():
    # accumulate_steps=2 (micro_size 2 each): one step on the two batches concatenated.
    first, second = _batches(True, steps=2, rows=12, seed=3)
    together = [(ms.ops.concat([first[0], second[0]]), ms.ops.concat([first[1], second[1]]))]
    reference, candidate = _conv_bn(), _conv_bn()
    plain = nn.TrainOneStepCell(nn.WithLossCell(reference, ce()), nn.SGD(reference.trainable_params(), 0.0))
    plain.set_train()
    plain(*together[0])
    step = AccumulatingTrainOneStepCell(nn.WithLossCell(candidate, ce()), nn.SGD(candidate.trainable_params(), 0.0),
                                        2, micro_size=2, batch_norm="per_step")
    step.set_train()
    start = _moving(candidate)
    step(*first)
    for e, a in zip(start, _moving(candidate)):   # the window is open: nothing moved yet
        assert float(np.abs(e - a).max()) == 0.0
    step(*second)
    for e, a in zip(_moving(reference), _moving(candidate)):
        assert float(np.abs(e - a).max()) < 2e-6


@pytest.mark.slow
def test_batch_norm_window_resumed_from_a_checkpoint_mid_window(tmp_path):
    first, second = _batches(False, steps=2, rows=12, seed=4)

    def build():
        net = _dense_bn()
        step = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), 0.1), 2,
                                            micro_size=3, batch_norm="per_step")
        step.set_train()
        return net, step

    net, step = build()
    step(*first)
    path = str(tmp_path / "mid_window.ckpt")
    ms.save_checkpoint(step, path)
    saved = ms.load_checkpoint(path)
    assert any(name.startswith("accu_state.batch_norm.") for name in saved)
    step(*second)
    uninterrupted = params_of(net)

    resumed_net, resumed = build()
    ms.load_param_into_net(resumed, ms.load_checkpoint(path))
    resumed(*second)
    assert_params_close(params_of(resumed_net), uninterrupted, rtol=0, atol=1e-6)
    # Control: the same resume without the statistics' sums (a checkpoint missing them) moves them otherwise.
    lost_net, lost = build()
    ms.load_param_into_net(lost, {name: value for name, value in ms.load_checkpoint(path).items()
                                  if not name.startswith("accu_state.batch_norm.")})
    lost(*second)
    assert float(np.abs(_moving(lost_net)[0] - _moving(resumed_net)[0]).max()) > 1e-3


def test_batch_norm_checkpoint_without_the_statistics_state_loads_and_resumes(tmp_path):
    # A checkpoint written before batch_norm= existed holds no accu_state.batch_norm.* (between windows they are 0).
    batches = _batches(False, steps=2, rows=12, seed=5)

    def build():
        net = _dense_bn()
        step = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), 0.1), 1,
                                            micro_size=3)
        step.set_train()
        return net, step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net, step = build()
        step(*batches[0])
        path = str(tmp_path / "old.ckpt")
        ms.save_checkpoint([{"name": p.name, "data": p} for p in step.get_parameters()
                            if not p.name.startswith("accu_state.batch_norm.")], path)
        step(*batches[1])
        resumed_net, resumed = build()
    not_loaded, _ = ms.load_param_into_net(resumed, ms.load_checkpoint(path))
    assert all(name.startswith("accu_state.batch_norm.") for name in not_loaded) and not_loaded
    resumed(*batches[1])
    assert_params_close(params_of(resumed_net), params_of(net), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("make_net", [_dense_bn, _conv_bn], ids=["BatchNorm1d", "BatchNorm2d"])
def test_batch_norm_frozen_trains_exactly_like_the_full_batch(make_net):
    batches = _batches(make_net is _conv_bn)
    reference, candidate = make_net(), make_net()
    for cell in reference.cells():
        if isinstance(cell, (nn.BatchNorm1d, nn.BatchNorm2d)):
            cell.use_batch_statistics = False   # the same frozen BatchNorm
    initial = params_of(reference)
    plain = nn.TrainOneStepCell(nn.WithLossCell(reference, ce()), make_optimizer("momentum",
                                                                                 reference.trainable_params()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # chosen: no warning
        step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(candidate, ce()), MICRO, batch_norm="frozen"),
                                   make_optimizer("momentum", candidate.trainable_params()))
    plain.set_train()
    step.set_train()
    for x, y in batches:
        plain(x, y)
        step(x, y)
    expected = params_of(reference)
    assert_params_moved(expected, initial)
    assert_params_close(params_of(candidate), expected, rtol=1e-5, atol=2e-6)
    # The moving statistics (not trainable: params_of leaves them out) did not move, in either.
    start = _moving(make_net())
    for net in (reference, candidate):
        for before, after in zip(start, _moving(net)):
            assert np.array_equal(before, after)
    # Control: the default (each micro-batch normalised by its own statistics) trains otherwise.
    other = make_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(other, ce()), MICRO),
                                   make_optimizer("momentum", other.trainable_params()))
    step.set_train()
    for x, y in batches:
        step(x, y)
    assert max(float(np.abs(params_of(other)[name] - expected[name]).max()) for name in expected) > 1e-3


def test_batch_norm_warning_only_where_nothing_was_chosen():
    with pytest.warns(UserWarning) as record:
        GradAccumulationCell(nn.WithLossCell(_dense_bn(), ce()), MICRO)
    messages = [str(w.message) for w in record if "batch normalisation" in str(w.message)]
    assert len(messages) == 1
    first = messages[0].split(". ")[0]
    # Its first sentence says what each choice makes exact.
    assert "only with batch_norm='frozen'" in first and "'per_step'" in first and "'micro'" in first, first
    for choice in ("per_step", "frozen", "micro"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            GradAccumulationCell(nn.WithLossCell(_dense_bn(), ce()), MICRO, batch_norm=choice)
            net = _dense_bn()
            AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), 0.1), 2,
                                         batch_norm=choice)


@pytest.mark.parametrize("value, error, match", [
    ("step", ValueError, "the argument 'batch_norm' must be None or one of 'per_step', 'frozen', 'micro', but got "
                         "'step'"),
    (True, TypeError, "the argument 'batch_norm' must be None or one of 'per_step', 'frozen', 'micro', but got True"),
    (1, TypeError, "the argument 'batch_norm' must be None or one of"),
])
def test_batch_norm_bad_values_are_refused(value, error, match):
    net = _dense_bn()
    with pytest.raises(error, match=re.escape("For 'GradAccumulationCell', " + match)):
        GradAccumulationCell(nn.WithLossCell(net, ce()), MICRO, batch_norm=value)
    with pytest.raises(error, match=re.escape("For 'AccumulatingTrainOneStepCell', " + match)):
        AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), 0.1), 2,
                                     batch_norm=value)
    # Refused before the network is touched.
    assert all(getattr(cell, "use_batch_statistics", None) is None for cell in net.cells())


def test_batch_norm_cell_of_ones_own_is_refused_where_its_update_cannot_be_read():
    class OwnNorm(nn.Cell):
        def __init__(self):
            super().__init__()
            self.moving_mean = ms.Parameter(ms.Tensor(np.zeros(8, np.float32)), requires_grad=False)
            self.moving_variance = ms.Parameter(ms.Tensor(np.ones(8, np.float32)), requires_grad=False)

        def construct(self, x):
            return (x - self.moving_mean) / ms.ops.sqrt(self.moving_variance + 1e-5)

    net = nn.SequentialCell(nn.Dense(5, 8), OwnNorm(), nn.Dense(8, 3))
    with pytest.raises(ValueError, match=r"'batch_norm' is 'per_step', but the network's cells _backbone.1 hold moving "
                                         r"statistics whose update the cell cannot read"):
        GradAccumulationCell(nn.WithLossCell(net, ce()), MICRO, batch_norm="per_step")
    with pytest.raises(ValueError, match=r"'batch_norm' is 'frozen', but the network's cells _backbone.1 hold moving "
                                         r"statistics without MindSpore's use_batch_statistics switch"):
        GradAccumulationCell(nn.WithLossCell(net, ce()), MICRO, batch_norm="frozen")
    GradAccumulationCell(nn.WithLossCell(net, ce()), MICRO, batch_norm="micro")   # stated: accepted


def test_batch_norm_taken_over_from_a_grad_accumulation_cell_and_contradictions_refused():
    net = _dense_bn()
    inner = GradAccumulationCell(nn.WithLossCell(net, ce()), 2, batch_norm="frozen")
    step = AccumulatingTrainOneStepCell(inner, nn.SGD(net.trainable_params(), 0.1), 2)
    assert step.batch_norm == "frozen"
    net = _dense_bn()
    inner = GradAccumulationCell(nn.WithLossCell(net, ce()), 2, batch_norm="micro")
    with pytest.raises(ValueError, match=r"'batch_norm' is 'frozen' but the GradAccumulationCell given as 'network' "
                                         r"has batch_norm='micro'"):
        AccumulatingTrainOneStepCell(inner, nn.SGD(net.trainable_params(), 0.1), 2, batch_norm="frozen")


def test_batch_norm_in_inference_mode_moves_nothing():
    # nn.TrainOneStepCell alone leaves the network in inference mode: no statistics move, in either path.
    net = _dense_bn()
    start = _moving(net)
    step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(net, ce()), MICRO, batch_norm="per_step"),
                               nn.SGD(net.trainable_params(), 0.1))
    for x, y in _batches(False, steps=2):
        step(x, y)
    for e, a in zip(start, _moving(net)):
        assert np.array_equal(e, a)


@pytest.mark.slow
def test_batch_norm_per_step_under_mixed_precision_o2():
    # amp_level O2 computes in float16 and keeps BatchNorm in float32: the statistics are combined in float32.
    def make():
        net = ms.amp.auto_mixed_precision(_dense_bn(), "O2")
        return net

    reference, candidate = make(), make()
    assert _first_bn(reference).moving_mean.dtype == ms.float32
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    plain = nn.TrainOneStepCell(nn.WithLossCell(reference, loss), nn.SGD(reference.trainable_params(), 0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # float16 without a loss scale is warned about
        step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(candidate, loss), MICRO,
                                                        batch_norm="per_step"),
                                   nn.SGD(candidate.trainable_params(), 0.0))
    plain.set_train()
    step.set_train()
    expected, actual = [], []
    for x, y in _batches(False):
        plain(x, y)
        step(x, y)
        expected.append(_moving(reference))
        actual.append(_moving(candidate))
    assert _gap(expected, actual) < 1e-5, _gap(expected, actual)
    # Control: per micro-batch, under the same precision, far off.
    other = make()
    step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(other, loss), MICRO, batch_norm="micro"),
                               nn.SGD(other.trainable_params(), 0.0))
    step.set_train()
    for x, y in _batches(False)[:1]:
        step(x, y)
    assert _gap(expected[:1], [_moving(other)]) > 1e-2


def test_batch_norm_per_step_with_one_row_micro_batches():
    # 5 rows in 4 micro-batches: 2, 1, 1, 1. The kernel's unbiased variance of one row is 0/0 (its moving variance
    # becomes NaN in a plain step on one row); a one-row micro-batch adds no deviation of its own to the step's.
    batches = _batches(False, steps=2, rows=5, seed=6)
    expected, actual, _, _ = _twin_runs(_dense_bn, batches, _grad_accumulation("per_step"))
    assert all(np.isfinite(a).all() for pair in actual for a in pair)
    assert _gap(expected, actual) < 2e-6, _gap(expected, actual)


class _TokensThenNorm(nn.Cell):
    """(B, T, 5) -> Dense -> (B * T, 8) -> BatchNorm1d -> the mean over T: a BatchNorm whose input merges the batch
    axis with another."""

    def __init__(self):
        super().__init__()
        self.dense, self.norm, self.head = nn.Dense(5, 8), nn.BatchNorm1d(8), nn.Dense(8, 3)

    def construct(self, x):
        rows, tokens = x.shape[0], x.shape[1]
        h = self.norm(self.dense(x.reshape(rows * tokens, 5)))
        return self.head(h).reshape(rows, tokens, 3).mean(1)


def test_batch_norm_per_step_where_the_batch_axis_is_merged_with_another():
    rng = np.random.RandomState(7)
    batches = [(ms.Tensor((rng.randn(10, 3, 5) * 2 + 1).astype(np.float32)),
                ms.Tensor(rng.randint(0, 3, 10).astype(np.int32))) for _ in range(2)]   # split 3, 3, 2, 2
    make = lambda: _seeded(_TokensThenNorm(), 0)   # noqa: E731
    expected, actual, _, _ = _twin_runs(make, batches, _grad_accumulation("per_step"))
    assert _gap(expected, actual) < 2e-6, _gap(expected, actual)
