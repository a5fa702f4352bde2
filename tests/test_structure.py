"""The loss contract read from the loss network's graph on the first call (diagnostics.contract), whatever values the
batches hold: each kind of loss of one's own with a case of its own and a negative control, in GRAPH_MODE and
PyNative, under nn.TrainOneStepCell and Model, and for AccumulatingTrainOneStepCell; random draws never stop or
loosen anything; the probe's hook is undone on every path and nothing is written on the user's train cell."""
import gc
import warnings

import numpy as np
import mindspore as ms
import mindspore.dataset as ds
import pytest
from mindspore import nn, ops, Tensor

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell, IgnoredLabelMean
from ms_gradaccum._mindspore.patches import GRAPH_COMPILE
from ms_gradaccum.cells import compile_hook as _compile_hook
from helpers import assert_params_close, assert_params_moved, make_mlp, params_of

K, B = 4, 32


class RowMeanLoss(nn.Cell):
    """A row mean of one's own, with random draws inside when asked: ops.uniform noise on the input (as diffusion
    training adds), nn.Dropout, or functional ops.dropout."""

    def __init__(self, net, noise=0.0, dropout=False, functional_dropout=False):
        super().__init__()
        self.net, self.noise, self.functional_dropout = net, noise, functional_dropout
        self.dropout = nn.Dropout(p=0.3) if dropout else None
        self.per_row = nn.CrossEntropyLoss(reduction="none")

    def construct(self, x, y, mask):
        if self.noise:
            x = x + self.noise * ops.uniform(x.shape, Tensor(-1.0), Tensor(1.0))
        if self.dropout is not None:
            x = self.dropout(x)
        if self.functional_dropout:
            x = ops.dropout(x, p=0.2, training=True)
        return self.per_row(self.net(x), y).mean()


class StochasticNet(RowMeanLoss):
    """Functional ops.dropout in a class whose name says nothing of it (names decide nothing)."""


class MaskedMean(nn.Cell):
    """``(loss * mask).sum() / mask.sum()``, times `scale` (a small loss is caught like its x1 twin)."""

    def __init__(self, net, scale=1.0):
        super().__init__()
        self.net, self.scale = net, scale
        self.per_row = nn.CrossEntropyLoss(reduction="none")

    def construct(self, x, y, mask):
        return self.scale * (self.per_row(self.net(x), y) * mask).sum() / mask.sum()


class ThresholdedCount(nn.Cell):
    """``sum(bce) / max(positives, 1)``, the positives counted from thresholded float targets."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x, y, mask):
        p = ops.sigmoid(self.net(x)[:, 0])
        positive = (mask > 0.5).astype(ms.float32)
        bce = -(positive * ops.log(p + 1e-6) + (1 - positive) * ops.log(1 - p + 1e-6))
        return bce.sum() / ops.maximum(positive.sum(), 1.0)


class OwnCrossEntropy(nn.Cell):
    """``ops.cross_entropy`` in a loss of one's own (ignore_index -100 by default), with a row-mean term if asked."""

    def __init__(self, net, auxiliary=False):
        super().__init__()
        self.net, self.auxiliary = net, auxiliary

    def construct(self, x, y, mask):
        out = self.net(x)
        loss = ops.cross_entropy(out, y)
        if self.auxiliary:
            loss = loss + 0.1 * (out ** 2).mean()
        return loss


class BatchStandardised(nn.Cell):
    """Statistics over the batch inside the network: ``(x - x.mean(0)) / x.std(0)``."""

    def __init__(self, net):
        super().__init__()
        self.net, self.loss = net, nn.CrossEntropyLoss()

    def construct(self, x, y, mask):
        return self.loss(self.net((x - x.mean(0)) / (x.std(0) + 1e-5)), y)


class InfoNCE(nn.Cell):
    """InfoNCE over the batch's similarity matrix (each row's positive is its own second view)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x, y, mask):
        similarity = ops.matmul(self.net(x), self.net(x + 0.1).T)
        return ops.cross_entropy(similarity, ops.arange(x.shape[0]).astype(ms.int32))


class SumLoss(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net, self.loss = net, nn.CrossEntropyLoss(reduction="sum")

    def construct(self, x, y, mask):
        return self.loss(self.net(x), y)


def batches(steps, change="", seed=0):
    """``(x, y, mask)`` batches: all ones and no ignored label on the first two steps; from step 3 on, with
    `change`: "ragged" masks, "ignored" labels (-100), or "sorted" (a ragged mask whose first two micro-batches are
    full, as batches sorted longest first)."""
    rng = np.random.RandomState(seed)
    out = []
    for step in range(steps):
        x = rng.randn(B, 16).astype(np.float32)
        y = rng.randint(0, 4, B).astype(np.int32)
        mask = np.ones(B, np.float32)
        if change == "ragged" and step >= 2:
            mask = (rng.rand(B) < 0.6).astype(np.float32)
            mask[::8] = 1
        if change == "sorted":
            mask[16:] = (rng.rand(16) < 0.4).astype(np.float32)
            mask[16::8] = 1
        if change == "ignored" and step >= 2:
            y[rng.rand(B) < 0.3] = -100
            y[::8] = 1
        out.append((x, y, mask))
    return out


class _Rows:
    def __init__(self, data):
        self.data = data

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


def train(make_loss, data, how, check_loss=True, mode=ms.GRAPH_MODE):
    """The weights before and after `data` through `how`: "full" (plain nn.TrainOneStepCell on the full batch),
    "cell" (nn.TrainOneStepCell around GradAccumulationCell), "steps" (AccumulatingTrainOneStepCell) or "model"
    (Model(GradAccumulationCell)); with warnings recorded."""
    ms.set_context(mode=mode)
    net = make_mlp()
    loss_net = make_loss(net)
    initial = params_of(net)   # named as in the loss network
    optimizer = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "model":
            dataset = ds.GeneratorDataset(_Rows(data), ["x", "y", "mask"], shuffle=False)
            ms.Model(GradAccumulationCell(loss_net, K, check_loss=check_loss), optimizer=optimizer).train(
                1, dataset, dataset_sink_mode=False)
        else:
            if how == "full":
                step = nn.TrainOneStepCell(loss_net, optimizer)
            elif how == "cell":
                step = nn.TrainOneStepCell(GradAccumulationCell(loss_net, K, check_loss=check_loss), optimizer)
            else:
                step = AccumulatingTrainOneStepCell(loss_net, optimizer, 1, micro_size=K, check_loss=check_loss)
            step.set_train()
            for batch in data:
                step(*(Tensor(a) for a in batch))
    return initial, params_of(net), [str(w.message) for w in caught]


def off(actual, expected, initial):
    """The largest weight difference from the full batch over the full batch's largest update."""
    return max(float(np.abs(actual[n] - expected[n]).max() / max(np.abs(expected[n] - initial[n]).max(), 1e-12))
               for n in expected)


MODES = [pytest.param(ms.GRAPH_MODE, id="graph"), pytest.param(ms.PYNATIVE_MODE, id="pynative")]
HOWS = ["cell", "steps", "model"]


# --- separable losses train, exactly, with no check on later steps --------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", HOWS)
def test_structure_ignored_labels_appearing_on_step_3_train_exactly(mode, how):
    # ops.cross_entropy in a loss of one's own: no ignored label on steps 1-2, some from step 3. The probe finds it a
    # mean over the labels that are not -100 and counts them on every step: the full batch's update, exactly.
    # Negative control: with the check off it is a mean of micro-batch means from step 3 on.
    data = batches(5, "ignored")
    initial, expected, _ = train(OwnCrossEntropy, data, "full", mode=mode)
    _, actual, caught = train(OwnCrossEntropy, data, how, mode=mode)
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-4, atol=2e-6)
    assert not caught, caught
    _, control, _ = train(OwnCrossEntropy, data, how, check_loss=False, mode=mode)
    assert off(control, expected, initial) > 1e-2


def test_structure_probe_reports_the_ignored_labels_it_counts():
    from ms_gradaccum import check_loss_contract   # pylint: disable=import-outside-toplevel
    x, y, mask = batches(1)[0]
    report = check_loss_contract(OwnCrossEntropy(make_mlp()), (Tensor(x), Tensor(y), Tensor(mask)), K)
    assert report.kind == IgnoredLabelMean(1) and report.ignore_labels == 1 and report.separable is True
    # Control: a one-hot MSE counts every row (its -100 row is a row like the others): a row mean.
    class OneHotMSE(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def construct(self, x, y, mask):
            return ((self.net(x) - ops.one_hot(y, 4, Tensor(1.0), Tensor(0.0))) ** 2).mean()

    report = check_loss_contract(OneHotMSE(make_mlp()), (Tensor(x), Tensor(y), Tensor(mask)), K)
    assert type(report.kind).__name__ == "RowMean" and report.ignore_labels is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make_loss", [
    lambda net: RowMeanLoss(net, noise=0.5),
    lambda net: RowMeanLoss(net, noise=0.02),
    lambda net: RowMeanLoss(net, dropout=True),
    lambda net: StochasticNet(net, functional_dropout=True),
], ids=["uniform_noise_0.5", "uniform_noise_0.02", "nn_dropout", "functional_dropout"])
def test_structure_random_draws_never_stop_or_warn(mode, make_loss):
    # A row mean with random draws inside: no error, no warning, the weights move. Where the draws can be repeated
    # (ops.uniform noise), the run equals the same run with check_loss=False to the last bit: the probe draws nothing
    # from the process's random state.
    data = batches(3)
    ms.set_seed(1)
    initial, actual, caught = train(make_loss, data, "cell", mode=mode)
    assert not caught, caught
    assert_params_moved(actual, initial)
    if getattr(make_loss(make_mlp()), "noise", 0.0):
        ms.set_seed(1)
        _, unchecked, _ = train(make_loss, data, "cell", check_loss=False, mode=mode)
        for name, value in unchecked.items():
            np.testing.assert_array_equal(actual[name], value, err_msg=name)


@pytest.mark.slow
def test_structure_random_draws_with_a_coupled_loss_still_stop():
    # Negative control for the above: random draws do not hide statistics over the batch.
    class DroppedStandardised(BatchStandardised):
        def __init__(self, net):
            super().__init__(nn.SequentialCell(nn.Dropout(p=0.3), net))

    with pytest.raises(ValueError, match=r"couples the rows of a batch"):
        train(DroppedStandardised, batches(2, "ragged"), "cell")


# --- losses normalised through their inputs, or summed: read from the graph, counted, exact -------------------------

EXACT = [(MaskedMean, "ragged"), (lambda net: MaskedMean(net, 1e-2), "sorted"), (ThresholdedCount, "ragged"),
         (SumLoss, "")]


@pytest.mark.slow
@pytest.mark.parametrize("make_loss, change", EXACT, ids=["masked_mean", "small_masked_mean_sorted",
                                                          "thresholded_count", "sum"])
def test_structure_losses_counted_through_their_inputs_or_summed_train_exactly(make_loss, change):
    # The graph shows a sum over a count taken from input 2 (a mask's sum; positives thresholded from float targets,
    # floored at 1) or a sum: the cell counts it per micro-batch on every step, whatever step 1 held. Control: with
    # the check off, the same data train away from the full batch.
    data = batches(4, change)
    initial, expected, _ = train(make_loss, data, "full")
    _, actual, caught = train(make_loss, data, "cell")
    assert not caught, caught
    assert_params_moved(expected, initial)
    assert off(actual, expected, initial) < 1e-4
    _, control, _ = train(make_loss, data, "cell", check_loss=False)
    assert off(control, expected, initial) > 1e-3


# --- coupled losses stop on step 1, before any update, whatever step 1's data hold ---------------------------------

CASES = [
    # (loss, data, what the message says first)
    (lambda net: OwnCrossEntropy(net, auxiliary=True), "ignored",
     "is not one kind the cell can combine over micro-batches: a mean over the rows and a sum over them, or a count"),
    (BatchStandardised, "", "couples the rows of a batch, so no split into micro-batches gives the full batch's "
                            "update: train with micro_size=1"),
    (InfoNCE, "", "couples the rows of a batch, so no split into micro-batches gives the full batch's update: train "
                  "with micro_size=1"),
]
IDS = ["ignored_plus_row_mean_term", "standardised_over_the_batch", "info_nce"]


@pytest.mark.slow
@pytest.mark.parametrize("make_loss, change, says", CASES, ids=IDS)
def test_structure_coupled_losses_stop_on_step_1_with_the_cause_first(make_loss, change, says):
    data = batches(3, change)
    net = make_mlp()
    loss_net = make_loss(net)
    before = params_of(net)
    step = nn.TrainOneStepCell(GradAccumulationCell(loss_net, K), nn.Momentum(net.trainable_params(), 0.1, 0.9))
    with pytest.raises(ValueError) as caught:
        step(*(Tensor(a) for a in data[0]))
    message = str(caught.value)
    assert says in message[:320], message
    assert "ratio inf" not in message and "the cell was told" not in message, message
    assert all(np.array_equal(value, before[name]) for name, value in params_of(net).items()), "the weights moved"
    if "micro_size=1" in says:
        assert "check_loss=False would train another objective" in message, message
    # Negative control: with the check off, the same data train away from the full batch (silently).
    initial, expected, _ = train(make_loss, data, "full")
    _, control, _ = train(make_loss, data, "cell", check_loss=False)
    assert off(control, expected, initial) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", HOWS)
def test_structure_masked_mean_with_all_ones_on_step_1_trains_exactly_everywhere(mode, how):
    # Read from the graph in both modes, under nn.TrainOneStepCell, AccumulatingTrainOneStepCell and Model: the mask's
    # count taken per micro-batch from step 1 on. Control: with the check off, steps 3-4 train off the full batch.
    data = batches(4, "ragged")
    assert (data[0][2] == 1).all() and (data[1][2] == 1).all()
    initial, expected, _ = train(MaskedMean, data, "full", mode=mode)
    _, actual, caught = train(MaskedMean, data, how, mode=mode)
    assert not caught, caught
    assert_params_close(actual, expected, rtol=1e-4, atol=2e-6)
    _, control, _ = train(MaskedMean, data, how, check_loss=False, mode=mode)
    assert off(control, expected, initial) > 1e-3


# --- once, then off the step path -----------------------------------------------------------------------------------

def _no_cell_waits():
    """Cells of earlier tests in this process that never compiled are forgotten: the hook is this test's own."""
    _compile_hook._WAITING.clear()   # pylint: disable=protected-access
    GRAPH_COMPILE.uninstall()


def test_structure_hook_is_undone_when_a_cell_is_dropped_before_its_compile():
    ms.set_context(mode=ms.GRAPH_MODE)
    _no_cell_waits()
    cell = GradAccumulationCell(nn.WithLossCell(make_mlp(), nn.MSELoss()), K)
    assert GRAPH_COMPILE.installed
    del cell
    gc.collect()
    assert not GRAPH_COMPILE.installed


def test_structure_hook_is_undone_after_a_pynative_call_and_nothing_is_written_on_the_train_cell():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    _no_cell_waits()
    net = make_mlp()
    step = nn.TrainOneStepCell(GradAccumulationCell(RowMeanLoss(net), K), nn.SGD(net.trainable_params(), 0.1))
    assert GRAPH_COMPILE.installed   # control: installed until the first call
    x, y, mask = batches(1)[0]
    step(Tensor(x), Tensor(y), Tensor(mask))
    assert not GRAPH_COMPILE.installed
    assert "compile" not in vars(step)
    ms.set_context(mode=ms.GRAPH_MODE)
    step = nn.TrainOneStepCell(GradAccumulationCell(RowMeanLoss(net), K), nn.SGD(net.trainable_params(), 0.1))
    step(Tensor(x), Tensor(y), Tensor(mask))
    assert not GRAPH_COMPILE.installed and "compile" not in vars(step)


def test_structure_hook_is_undone_after_a_cell_compiled_only_in_a_jit_function():
    # A functional loop in graph mode compiles the cell inside a jit function, which the hooked executor never compiles:
    # that compile's checks release it, and nothing of the package stays on later calls of other cells.
    ms.set_context(mode=ms.GRAPH_MODE)
    _no_cell_waits()
    net = make_mlp()
    cell = GradAccumulationCell(RowMeanLoss(net), K)
    assert GRAPH_COMPILE.installed   # control: waiting since its construction
    grad_fn = ms.value_and_grad(cell, None, net.trainable_params())
    x, y, mask = batches(1)[0]
    grad_fn(Tensor(x), Tensor(y), Tensor(mask))
    assert not GRAPH_COMPILE.installed


def test_structure_contract_is_read_once_per_layout():
    # A steady call does not read the graph again; a call with inputs of another layout (dtypes, ranks) does, in
    # PyNative mode. No eager probe runs: the graph decides a row mean.
    from ms_gradaccum.diagnostics import contract   # pylint: disable=import-outside-toplevel
    ms.set_context(mode=ms.PYNATIVE_MODE)
    net = make_mlp()
    cell = GradAccumulationCell(RowMeanLoss(net), K)
    step = nn.TrainOneStepCell(cell, nn.SGD(net.trainable_params(), 0.1))
    calls, probes = [], []
    read, probe = contract.LossContract.read_graph, contract.LossContract.compare_values

    def counted(self, *args, **kwargs):
        calls.append(1)
        return read(self, *args, **kwargs)

    def probed(self, *args, **kwargs):
        probes.append(1)
        return probe(self, *args, **kwargs)

    contract.LossContract.read_graph, contract.LossContract.compare_values = counted, probed
    try:
        for x, y, mask in batches(3):
            step(Tensor(x), Tensor(y), Tensor(mask))
        assert len(calls) == 1
        x, y, mask = batches(1)[0]
        step(Tensor(x), Tensor(y), Tensor(mask.astype(np.float16)))
        assert len(calls) == 2 and not probes
    finally:
        contract.LossContract.read_graph, contract.LossContract.compare_values = read, probe
