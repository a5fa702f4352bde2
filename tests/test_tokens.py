"""Token-normalised losses: per_token_loss=True and (loss_sum, count) networks, divided by the whole batch's count."""
import os
import re
import sys
import warnings

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell, check_equivalence, token_sum_loss
from ms_gradaccum.core.tokens import CountedMean, token_mean_cells
from helpers import (assert_params_close, assert_params_equal, assert_params_moved, ce, classification_batches,
                     make_mlp, make_optimizer, make_token_net, max_abs_diff, params_of, token_batches, TokenLoss,
                     train_steps)
from launch import REPO

sys.path.insert(0, os.path.join(REPO, "sample_code", "distributed_gradient_accumulation"))   # the tutorial's network

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
# Four micro-batches of 4 samples with 1, 6, 2 and 5 valid tokens per sample: very uneven token counts.
VALID = [1] * 4 + [6] * 4 + [2] * 4 + [5] * 4
K = 4


def _token_reference(optimizer, batches):
    net = make_token_net()
    step = nn.TrainOneStepCell(TokenLoss(net, "mean"), make_optimizer(optimizer, net.trainable_params()))
    losses = train_steps(step, batches)
    return params_of(net), losses


def _run_cell(optimizer, batches, mode="sum_count", micro_size=K):
    net = make_token_net()
    # A control ("mean": a token mean per micro-batch) trains the inexact way on purpose: the contract check would stop
    # it.
    step = nn.TrainOneStepCell(GradAccumulationCell(TokenLoss(net, mode), micro_size,
                                                    per_token_loss=mode == "sum_count", check_loss=mode == "sum_count"),
                               make_optimizer(optimizer, net.trainable_params()))
    losses = train_steps(step, batches)
    return params_of(net), losses


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_tokens_cell_matches_global_token_mean(optimizer):
    batches = token_batches(3, VALID)
    expected, expected_losses = _token_reference(optimizer, batches)
    actual, losses = _run_cell(optimizer, batches)
    assert_params_moved(expected, params_of(make_token_net()))
    assert_params_close(actual, expected, **TOLERANCE)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)   # what LossMonitor prints: the token mean


@pytest.mark.slow
def test_tokens_mean_of_micro_batch_means_fails_reference():
    # Negative control: the Transformers bug (#34191), each micro-batch normalised by its own token count.
    batches = token_batches(3, VALID)
    expected, _ = _token_reference("sgd", batches)
    control, _ = _run_cell("sgd", batches, mode="mean")
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, **TOLERANCE)


@pytest.mark.slow
def test_tokens_ragged_batch_with_token_counts():
    # 14 samples in 4 micro-batches (4, 4, 3, 3 samples): the split and the token counts are both uneven.
    batches = token_batches(2, VALID[:14])
    expected, expected_losses = _token_reference("momentum", batches)
    actual, losses = _run_cell("momentum", batches)
    assert_params_close(actual, expected, **TOLERANCE)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("micro", [False, True], ids=["window", "micro_batches"])
def test_tokens_accumulating_cell_divides_by_the_window_count(micro):
    dense, sparse = token_batches(2, VALID), token_batches(2, [1] * 16, seed=5)
    batches = [dense[0], sparse[0], sparse[1], dense[1]]   # 2 windows of 2 batches with different token counts
    windows = [tuple(np.concatenate([a, b]) for a, b in zip(batches[i], batches[i + 1])) for i in (0, 2)]
    expected, expected_losses = _token_reference("adam", windows)

    def run(mode):
        net = make_token_net()
        loss_net = TokenLoss(net, mode)
        tokens = mode == "sum_count"
        # The control (mean) trains the inexact way on purpose: the contract check off.
        network = GradAccumulationCell(loss_net, K, per_token_loss=tokens, check_loss=tokens) if micro else loss_net
        cell = AccumulatingTrainOneStepCell(network, make_optimizer("adam", net.trainable_params()), 2,
                                            per_token_loss=tokens, check_loss=tokens)
        for batch in batches:
            cell(*(Tensor(a) for a in batch))
        return params_of(net), cell

    actual, cell = run("sum_count")
    assert_params_close(actual, expected, **TOLERANCE)
    assert cell.last_window_loss == pytest.approx(expected_losses[-1], rel=1e-5)
    control, _ = run("mean")
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, **TOLERANCE)


@pytest.mark.slow
def test_tokens_flush_divides_a_partial_window_by_its_count():
    batches = token_batches(3, VALID)
    expected, _ = _token_reference("sgd", [tuple(np.concatenate(parts) for parts in zip(*batches))])
    net = make_token_net()
    cell = AccumulatingTrainOneStepCell(TokenLoss(net), make_optimizer("sgd", net.trainable_params()), 4,
                                        per_token_loss=True)
    for batch in batches:
        cell(*(Tensor(a) for a in batch))
    assert cell.flush() is True
    assert_params_close(params_of(net), expected, **TOLERANCE)


# --- the explicit token mode: per_token_loss ------------------------------------------------------------------

class _LossAndAccuracy(nn.Cell):
    """A network returning (loss, accuracy): two scalars that are NOT (loss_sum, count)."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net = net
        self.ce = ce()

    def construct(self, x, y):
        logits = self.net(x)
        return self.ce(logits, y), (logits.argmax(axis=1) == y).astype(ms.float32).mean()


class _LossAndItems(_LossAndAccuracy):
    """A detector's (loss, loss_items): the second element holds 3 entries (it hit a Reshape error in graph mode)."""

    def construct(self, x, y):
        loss = self.ce(self.net(x), y)
        return loss, ops.stack([loss, loss * 2, loss * 3])


@pytest.mark.slow
@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE], ids=["graph", "pynative"])
@pytest.mark.parametrize("outputs", ["accuracy", "loss_items"])
@pytest.mark.parametrize("make", ["cell", "accumulating", "accumulating_micro"])
def test_tokens_tuple_without_per_token_loss_is_refused(make, outputs, mode):
    # A (loss, accuracy) network used to be taken as (loss_sum, count): a 1.9x update, or inf with accuracy 0.
    ms.set_context(mode=mode)
    net = make_mlp()
    loss_net = (_LossAndAccuracy if outputs == "accuracy" else _LossAndItems)(net)
    opt = make_optimizer("sgd", net.trainable_params())
    if make == "cell":
        step = nn.TrainOneStepCell(GradAccumulationCell(loss_net, K), opt)
        name = "GradAccumulationCell"
    else:
        step = AccumulatingTrainOneStepCell(loss_net, opt, 2, micro_size=K if make == "accumulating_micro" else 1)
        name = "AccumulatingTrainOneStepCell"
    initial = params_of(net)
    x, y = classification_batches(1, 16)[0]
    shapes = "((), ())" if outputs == "accuracy" else "((), (3,))"
    expected = (f"For '{name}', the argument 'network' must return a scalar loss, but it returned a tuple of 2 "
                f"element(s) with shapes {shapes}. Auxiliary outputs (logits, metrics) are not carried through the "
                f"accumulation: return only the loss. If the tuple is (loss_sum, count), e.g. a masked token loss and "
                f"the number of valid tokens, pass per_token_loss=True.")
    with pytest.raises(ValueError, match=re.escape(expected)):
        step(Tensor(x), Tensor(y))
    assert_params_equal(params_of(net), initial)


def test_tokens_per_token_loss_with_a_scalar_loss_is_refused():
    net = make_mlp()
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), K, per_token_loss=True)
    x, y = classification_batches(1, 16)[0]
    with pytest.raises(ValueError, match=re.escape(
            "with per_token_loss=True the argument 'network' must return a tuple (loss_sum, count) of two "
            "single-element Tensors "
            "(e.g. the sum of a masked token loss and the number of valid tokens), but it returned a single Tensor of "
            "shape (). Return (loss_sum, count), or set per_token_loss=False for a mean loss.")):
        cell(Tensor(x), Tensor(y))


class _CountTimes(nn.Cell):
    """TokenLoss whose count is multiplied by a constant (negative or non-finite counts for the error tests)."""

    def __init__(self, net, factor):
        super().__init__(auto_prefix=False)
        self.loss, self.factor = TokenLoss(net), factor

    def construct(self, x, y, mask):
        loss_sum, count = self.loss(x, y, mask)
        return loss_sum, count * self.factor


@pytest.mark.slow
@pytest.mark.parametrize("factor, message", [
    (-1.0, "with per_token_loss=True the count returned by 'network' must be a finite number >= 0 (e.g. the number of "
           "valid tokens), but a micro-batch returned -"),
    (float("inf"), "but a micro-batch returned a non-finite count (inf or nan)"),
    (float("nan"), "but a micro-batch returned a non-finite count (inf or nan)"),
])
@pytest.mark.parametrize("make", ["cell", "accumulating"])
def test_tokens_bad_counts_stop_before_any_update(factor, message, make):
    net = make_token_net()
    opt = make_optimizer("adam", net.trainable_params())
    if make == "cell":
        step = nn.TrainOneStepCell(GradAccumulationCell(_CountTimes(net, factor), K, per_token_loss=True), opt)
    else:
        step = AccumulatingTrainOneStepCell(_CountTimes(net, factor), opt, 1, micro_size=K, per_token_loss=True)
    before = {p.name: p.asnumpy().copy() for p in opt.get_parameters()}
    with pytest.raises(ValueError, match=re.escape(message)):
        step(*(Tensor(a) for a in token_batches(1, VALID)[0]))
    assert_params_equal({p.name: p.asnumpy() for p in opt.get_parameters()}, before)   # weights and moments


def test_tokens_window_without_tokens_updates_nothing_and_returns_zero():
    net = make_token_net()
    cell = AccumulatingTrainOneStepCell(TokenLoss(net), make_optimizer("adam", net.trainable_params()), 2,
                                        micro_size=K, per_token_loss=True)
    data = token_batches(3, VALID)
    cell(*(Tensor(a) for a in data[0]))
    cell(*(Tensor(a) for a in data[1]))                        # one real window: Adam's moments are non-zero
    state = {p.name: p.asnumpy().copy() for p in cell.get_parameters() if not p.name.startswith("accu_")}
    x, y, mask = data[2]
    empty = [cell(Tensor(x), Tensor(y), Tensor(mask * 0)) for _ in range(2)]   # a window with no valid token
    assert [float(loss.asnumpy()) for loss in empty] == [0.0, 0.0] and cell.last_window_loss == 0.0
    assert_params_equal({p.name: p.asnumpy() for p in cell.get_parameters() if not p.name.startswith("accu_")},
                        state)                                 # weights, moments, global_step bit-unchanged
    assert cell.pending_batches == 0 and not np.any(cell.grad_sums[0].asnumpy())
    # Control: a window with tokens does move the weights.
    cell(Tensor(x), Tensor(y), Tensor(mask))
    cell(Tensor(x), Tensor(y), Tensor(mask))
    assert max_abs_diff(params_of(net), {n: state[n] for n in params_of(net)}) > 1e-4


def test_tokens_batch_without_tokens_hands_over_a_zero_gradient():
    net = make_token_net()
    step = nn.TrainOneStepCell(GradAccumulationCell(TokenLoss(net), K, per_token_loss=True),
                               nn.SGD(net.trainable_params(), 0.1))
    x, y, mask = token_batches(1, VALID)[0]
    initial = params_of(net)
    assert float(step(Tensor(x), Tensor(y), Tensor(mask * 0)).asnumpy()) == 0.0
    assert_params_equal(params_of(net), initial)               # plain SGD on a zero gradient: unchanged


@pytest.mark.parametrize("kwargs, message", [
    (dict(per_token_loss=False), "the argument 'per_token_loss' is False but the GradAccumulationCell given as "
                                 "'network' has per_token_loss=True"),
    (dict(micro_size=2), "the argument 'micro_size' is 2 but the GradAccumulationCell given as 'network' has "
                         "micro_size=4"),
])
def test_tokens_accumulating_cell_contradicting_its_grad_accumulation_cell_is_refused(kwargs, message):
    net = make_token_net()
    with pytest.raises(ValueError, match=re.escape(message)):
        AccumulatingTrainOneStepCell(GradAccumulationCell(TokenLoss(net), K, per_token_loss=True),
                                     nn.SGD(net.trainable_params(), 0.1), 1, **kwargs)
    # The same settings given once, either way, are accepted.
    AccumulatingTrainOneStepCell(GradAccumulationCell(TokenLoss(net), K, per_token_loss=True),
                                 nn.SGD(net.trainable_params(), 0.1), 1, micro_size=K, per_token_loss=True)


def test_tokens_accumulating_cell_refuses_an_inner_loss_scale():
    net = make_mlp()
    with pytest.raises(ValueError, match="has its own loss_scale, which this cell does not use"):
        AccumulatingTrainOneStepCell(GradAccumulationCell(nn.WithLossCell(net, ce()), K, loss_scale=8.0),
                                     nn.SGD(net.trainable_params(), 0.1), 1)


# --- losses that average over valid tokens: token_sum_loss, the warning, check_equivalence ---------------------------

def _ignored_label_batches(steps=3, batch=32, ignore_index=-100):
    """Batches whose ignored labels fall unevenly: most in the first micro-batch, none in the last."""
    batches = []
    for x, y in classification_batches(steps, batch, seed=7):
        y = y.copy()
        y[:6] = ignore_index
        y[batch // 2:batch // 2 + 2] = ignore_index
        batches.append((x, y))
    return batches


_WEIGHT = np.array([0.5, 1.0, 2.0, 1.5], np.float32)
TOKEN_MEAN_LOSSES = {
    "cross_entropy": lambda: nn.CrossEntropyLoss(ignore_index=-100),
    "weighted_smoothed": lambda: nn.CrossEntropyLoss(weight=Tensor(_WEIGHT), ignore_index=-100, label_smoothing=0.1),
    "nll": lambda: nn.NLLLoss(ignore_index=-100),
}


class _LogSoftmaxNet(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x):
        return ops.log_softmax(self.net(x), -1)


def _token_mean_run(name, wrap, batches, optimizer="adam"):
    net = make_mlp()
    backbone = _LogSoftmaxNet(net) if name == "nll" else net
    initial = params_of(net)
    step = wrap(backbone, TOKEN_MEAN_LOSSES[name](), make_optimizer(optimizer, net.trainable_params()))
    losses = train_steps(step, batches)
    return params_of(net), losses, initial


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TOKEN_MEAN_LOSSES))
@pytest.mark.parametrize("cell", ["GradAccumulationCell", "AccumulatingTrainOneStepCell"])
def test_tokens_token_sum_loss_matches_the_full_batch_token_mean(name, cell):
    batches = _ignored_label_batches()
    expected, expected_losses, initial = _token_mean_run(
        name, lambda net, loss, opt: nn.TrainOneStepCell(nn.WithLossCell(net, loss), opt), batches)

    def accumulate(net, loss, opt, exact=True):
        loss_net = nn.WithLossCell(net, token_sum_loss(loss) if exact else loss)
        # The control (not exact) trains the inexact way on purpose: the contract check off.
        if cell == "GradAccumulationCell":
            return nn.TrainOneStepCell(GradAccumulationCell(loss_net, K, per_token_loss=exact, check_loss=exact), opt)
        return AccumulatingTrainOneStepCell(loss_net, opt, 1, micro_size=K, per_token_loss=exact, check_loss=exact)

    actual, losses, _ = _token_mean_run(name, accumulate, batches)
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    # Negative control: the same loss averaged per micro-batch and weighted by rows (declared a row mean).
    control, _, _ = _token_mean_run(name, lambda net, loss, opt: accumulate(net, loss, opt, exact=False), batches)
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, rtol=1e-5, atol=1e-6)


def _package_warnings(build):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = build()
    return result, [str(w.message) for w in record if "GradAccumulationCell" in str(w.message) or
                    "AccumulatingTrainOneStepCell" in str(w.message)]


def _later_ignored_batches(steps=3, batch=32, ignore_index=-100, seed=3, empty=False):
    """The first batch without an ignored label; later ones with about half ignored, unevenly (most in the last rows):
    what a first-step look cannot see. With `empty`, the second micro-batch of the second step has no valid label."""
    rng = np.random.RandomState(seed)
    batches = []
    for step, (x, y) in enumerate(classification_batches(steps, batch, seed=seed)):
        y = y.copy()
        if step > 0:
            kept = y.copy()
            y[rng.rand(batch) < np.linspace(0.05, 0.9, batch)] = ignore_index
            y[::batch // K] = kept[::batch // K]   # a valid label in every micro-batch (but with `empty`)
        if step == 1 and empty:
            y[batch // K:2 * batch // K] = ignore_index
        batches.append((x, y))
    return batches


def _recognised_run(name, wrap, batches, optimizer="adam", **kwargs):
    net = make_mlp()
    backbone = _LogSoftmaxNet(net) if name == "nll" else net
    initial = params_of(net)
    loss_net = nn.WithLossCell(backbone, TOKEN_MEAN_LOSSES[name]())
    step, messages = _package_warnings(lambda: wrap(loss_net, make_optimizer(optimizer, net.trainable_params()),
                                                    **kwargs))
    losses = train_steps(step, batches)
    return params_of(net), losses, initial, messages, loss_net


RECOGNISING = {
    "GradAccumulationCell": lambda loss_net, opt, **kw: nn.TrainOneStepCell(GradAccumulationCell(loss_net, K, **kw),
                                                                             opt),
    "AccumulatingTrainOneStepCell": lambda loss_net, opt, **kw: AccumulatingTrainOneStepCell(loss_net, opt, 1,
                                                                                             micro_size=K, **kw),
}


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("name, cell", [(name, "GradAccumulationCell") for name in sorted(TOKEN_MEAN_LOSSES)] +
                         [("weighted_smoothed", "AccumulatingTrainOneStepCell")])
def test_tokens_recognised_losses_are_exact_whatever_the_later_labels(name, cell):
    # nn.CrossEntropyLoss / nn.NLLLoss with a mean (ignored labels, class weights, label smoothing), told nothing: the
    # first batch holds no ignored label, later ones many, unevenly, and one micro-batch none valid. Every step equals
    # the full batch's, nothing is said, and the user's loss cell is left as it was.
    batches = _later_ignored_batches()
    expected, expected_losses, initial, _, _ = _recognised_run(
        name, lambda loss_net, opt: nn.TrainOneStepCell(loss_net, opt), batches)
    actual, losses, _, messages, loss_net = _recognised_run(name, RECOGNISING[cell], batches)
    assert not messages, messages
    assert type(loss_net._loss_fn) is type(TOKEN_MEAN_LOSSES[name]())   # pylint: disable=protected-access
    assert_params_moved(expected, initial)
    assert_params_close(actual, expected, **TOLERANCE)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    # Negative control: declared a row mean, each micro-batch's mean weighted by its rows.
    control, _, _, _, _ = _recognised_run(name, RECOGNISING[cell], batches, per_token_loss=False, check_loss=False)
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, **TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("cell", sorted(RECOGNISING))
def test_tokens_recognised_loss_with_a_micro_batch_without_valid_labels_is_exact(cell):
    # A micro-batch whose labels are all ignore_index: its mean is 0/0, the full batch's is finite. Counted, it adds
    # nothing and the step equals the full batch's. Control: declared a row mean, the loss contract stops it
    # before any weight changes (a mean over valid labels told it is a row mean), and with the check off its NaN
    # stops the step, naming the micro-batch.
    batches = _later_ignored_batches(empty=True)
    expected, expected_losses, initial, _, _ = _recognised_run(
        "cross_entropy", lambda loss_net, opt: nn.TrainOneStepCell(loss_net, opt), batches)
    actual, losses, _, messages, _ = _recognised_run("cross_entropy", RECOGNISING[cell], batches)
    assert not messages, messages
    assert_params_close(actual, expected, **TOLERANCE)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    with pytest.raises(ValueError, match=r"is a mean over the labels of input 1 that are not -100, but the cell was "
                                         r"told the loss is a mean over the rows"):
        _recognised_run("cross_entropy", RECOGNISING[cell], batches, per_token_loss=False)
    with pytest.raises(ValueError, match=r"micro-batch 1 \(rows 8 to 15 of the batch of 32, micro_size=4\) returned a "
                                         r"non-finite loss"):
        _recognised_run("cross_entropy", RECOGNISING[cell], batches, per_token_loss=False, check_loss=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE], ids=["graph", "pynative"])
def test_tokens_recognised_loss_on_sorted_token_batches_is_exact(mode):
    # Token batches sorted longest first, as a length-bucketing sampler gives them: the first unpadded, later rows
    # padded with -100 (whole rows of padding in the last micro-batches). Windows of 2 batches as well.
    ms.set_context(mode=mode)

    class SequenceLoss(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net, self.loss = net, nn.CrossEntropyLoss()

        def construct(self, x, y):   # (B, T, F), (B, T): the loss sees (B * T, C) logits and B * T labels
            return self.loss(self.net(x.reshape(-1, x.shape[-1])), y.reshape(-1))

    rng = np.random.RandomState(0)
    batches = []
    for step in range(4):
        x = rng.randn(16, 5, 16).astype(np.float32)
        y = rng.randint(0, 4, (16, 5)).astype(np.int32)
        if step:
            for row, length in enumerate(np.sort(rng.randint(0, 6, 16))[::-1]):
                y[row, length:] = -100
        batches.append((x, y))

    def run(wrap):
        net = make_mlp()
        step = wrap(SequenceLoss(net), make_optimizer("momentum", net.trainable_params()))
        losses = train_steps(step, batches)
        return params_of(net), losses

    expected, expected_losses = run(nn.TrainOneStepCell)
    whole = [(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])) for a, b in zip(batches[::2], batches[1::2])]
    for wrap, reference in [(lambda loss_net, opt: nn.TrainOneStepCell(GradAccumulationCell(loss_net, K), opt),
                             (expected, expected_losses)),
                            (lambda loss_net, opt: AccumulatingTrainOneStepCell(loss_net, opt, 2), None)]:
        actual, losses = run(wrap)
        if reference is None:   # windows of two batches against the full batch of both
            net = make_mlp()
            step = nn.TrainOneStepCell(SequenceLoss(net), make_optimizer("momentum", net.trainable_params()))
            train_steps(step, whole)
            reference = (params_of(net), None)
        else:
            np.testing.assert_allclose(losses, reference[1], rtol=1e-5)
        assert_params_close(actual, reference[0], **TOLERANCE)
    assert_params_moved(expected, params_of(SequenceLoss(make_mlp()).net))


def test_tokens_recognised_cells_are_found_counted_and_declared_away():
    # Which cells are recognised; the kind they give a cell that splits or sums; none where the loss is declared,
    # nothing is split, or the cell is told the kind.
    loss_net = lambda: nn.WithLossCell(make_mlp(), nn.CrossEntropyLoss(weight=Tensor(_WEIGHT)))   # noqa: E731
    assert GradAccumulationCell(loss_net(), K).kind == CountedMean(("_loss_fn",))
    net = make_mlp()
    opt = make_optimizer("sgd", net.trainable_params())
    assert AccumulatingTrainOneStepCell(nn.WithLossCell(net, nn.NLLLoss()), opt, 2).kind == CountedMean(("_loss_fn",))
    for cell in (GradAccumulationCell(loss_net(), K, per_token_loss=False), GradAccumulationCell(loss_net(), 1),
                 GradAccumulationCell(nn.WithLossCell(make_mlp(), ce()), K),
                 GradAccumulationCell(nn.WithLossCell(make_mlp(), token_sum_loss(nn.CrossEntropyLoss())), K,
                                      per_token_loss=True)):
        assert not isinstance(cell.kind, CountedMean), cell.kind
    declared = GradAccumulationCell(loss_net(), K, per_token_loss=False)
    assert not isinstance(AccumulatingTrainOneStepCell(
        declared, make_optimizer("sgd", declared.trainable_params()), 1).kind, CountedMean)
    recognised = GradAccumulationCell(loss_net(), K)
    assert not isinstance(AccumulatingTrainOneStepCell(
        recognised, make_optimizer("sgd", recognised.trainable_params()), 1, per_token_loss=False).kind, CountedMean)
    # An adapted loss beside one that is not: the other one is found; a sum is not a mean over labels.
    assert token_mean_cells(nn.SequentialCell(token_sum_loss(nn.CrossEntropyLoss()), nn.NLLLoss())) == ["1"]
    assert token_mean_cells(nn.CrossEntropyLoss(reduction="sum")) == []


@pytest.mark.slow
def test_tokens_recognised_loss_called_twice_in_a_forward_pass_is_refused():
    # One weight per micro-batch cannot stand for two counts: stopped before any update, with the routes. Control: the
    # same network declared a row mean is stopped by the probe (a mean over valid labels), and trains with it off.
    class TwoHeads(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net, self.loss = net, nn.CrossEntropyLoss()

        def construct(self, x, y):
            logits = self.net(x)
            return self.loss(logits, y) + self.loss(logits * 2.0, y)

    net = make_mlp()
    step = nn.TrainOneStepCell(GradAccumulationCell(TwoHeads(net), K), make_optimizer("sgd", net.trainable_params()))
    before = params_of(net)
    x, y = classification_batches(1, 32)[0]
    with pytest.raises(ValueError, match=r"these loss cells ran 2 times in one forward pass") as caught:
        step(Tensor(x), Tensor(y))
    assert "per_token_loss=True" in str(caught.value) and "per_token_loss=False and check_loss=False" in \
        str(caught.value)
    assert_params_equal(params_of(net), before)
    with pytest.raises(ValueError, match=r"is a mean over the labels of input 1 that are not -100, but the cell was "
                                         r"told"):
        nn.TrainOneStepCell(GradAccumulationCell(TwoHeads(net), K, per_token_loss=False),
                            make_optimizer("sgd", net.trainable_params()))(Tensor(x), Tensor(y))
    step = nn.TrainOneStepCell(GradAccumulationCell(TwoHeads(net), K, per_token_loss=False, check_loss=False),
                               make_optimizer("sgd", net.trainable_params()))
    step(Tensor(x), Tensor(y))
    assert max_abs_diff(params_of(net), before) > 0


def _tutorial_network():
    """MindSpore's distributed gradient-accumulation tutorial's network, as the sample has it (784-512-512-10)."""
    from train import Network   # sample_code/distributed_gradient_accumulation, on sys.path through launch
    net = Network()
    for param in net.trainable_params():   # the same weights for every build
        param.set_data(Tensor(np.random.RandomState(len(param.name)).uniform(-0.05, 0.05, param.shape)
                              .astype(np.float32)))
    return net


def _tutorial_batches(steps=2, batch=32, ignored=()):
    rng = np.random.RandomState(3)
    batches = []
    for _ in range(steps):
        x = rng.rand(batch, 1, 28, 28).astype(np.float32)
        y = rng.randint(0, 10, batch).astype(np.int32)
        y[list(ignored)] = -100
        batches.append((x, y))
    return batches


def _tutorial_run(loss_fn, batches, cell, **kwargs):
    """The package's warnings, the error, the weights and the losses of the tutorial's training network on `batches`."""
    net = _tutorial_network()
    loss_net = nn.WithLossCell(net, loss_fn)
    optimizer = nn.SGD(net.trainable_params(), 0.05)
    losses = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if cell == "GradAccumulationCell":
            step = nn.TrainOneStepCell(GradAccumulationCell(loss_net, K, **kwargs), optimizer)
        elif cell == "AccumulatingTrainOneStepCell":
            step = AccumulatingTrainOneStepCell(loss_net, optimizer, 1, micro_size=K, **kwargs)
        else:
            step = nn.TrainOneStepCell(loss_net, optimizer)
        try:
            losses = train_steps(step, batches)
            error = None
        except ValueError as caught:
            error = str(caught)
    messages = [str(w.message) for w in record if "ms_gradaccum" in w.filename or "Cell" in str(w.message)[:40]]
    return messages, error, params_of(net), losses


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["GradAccumulationCell", "AccumulatingTrainOneStepCell"])
@pytest.mark.parametrize("loss_fn", [lambda: nn.CrossEntropyLoss(), lambda: _NLLOfLogits(),
                                     lambda: nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")],
                         ids=["CrossEntropyLoss", "NLLLoss", "SoftmaxCrossEntropyWithLogits"])
def test_tokens_tutorial_loss_one_label_per_row_is_not_warned_and_exact(cell, loss_fn):
    # The tutorial's GradAccumulationCell(nn.WithLossCell(net, nn.CrossEntropyLoss()), 4): one label per row, none
    # ignored, no class weights: exact, nothing said, and the loss it returns (what LossMonitor prints) the same number.
    batches = _tutorial_batches()
    messages, error, actual, losses = _tutorial_run(loss_fn(), batches, cell)
    assert not messages and error is None, (messages, error)
    _, _, expected, expected_losses = _tutorial_run(loss_fn(), batches, "full batch")
    assert_params_moved(expected, params_of(_tutorial_network()))
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)


class _NLLOfLogits(nn.Cell):
    """``nn.NLLLoss`` on the log-probabilities of logits (its own cell, found inside the loss network)."""

    def __init__(self):
        super().__init__()
        self.nll = nn.NLLLoss()

    def construct(self, logits, labels):
        return self.nll(ops.log_softmax(logits, -1), labels)


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("cell", ["GradAccumulationCell", "AccumulatingTrainOneStepCell"])
def test_tokens_tutorial_loss_with_ignored_labels_is_exact(cell):
    # The same loss with ignored labels, the micro-batches holding different numbers of them (for one cell in the last
    # micro-batch, for the other in the first two, which the check compares): exact and silent. Control: declared a
    # row mean, the run really differs from the full batch (so the labels matter).
    batches = _tutorial_batches(ignored=(28, 29, 30) if cell == "GradAccumulationCell" else range(0, 6))
    messages, error, actual, _ = _tutorial_run(nn.CrossEntropyLoss(), batches, cell)
    assert not messages and error is None, (messages, error)
    _, _, expected, _ = _tutorial_run(nn.CrossEntropyLoss(), batches, "full batch")
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    _, _, control, _ = _tutorial_run(nn.CrossEntropyLoss(), batches, cell, per_token_loss=False, check_loss=False)
    assert max_abs_diff(control, expected) > 1e-4


@pytest.mark.parametrize("loss_fn, error, message", [
    (nn.CrossEntropyLoss(reduction="sum"), ValueError, r"'loss_fn' must be a loss with reduction='mean', but got .* It "
                                                       r"has reduction='sum': a sum needs no count\."),
    (nn.MSELoss(), TypeError, r"'loss_fn' must be mindspore.nn.CrossEntropyLoss or mindspore.nn.NLLLoss with "
                              r"reduction='mean', or MindFormers' CrossEntropyLoss, but got .*MSELoss"),
    ("ce", TypeError, r"For 'token_sum_loss', the argument 'loss_fn' must be"),
])
def test_tokens_token_sum_loss_refuses_what_it_cannot_count(loss_fn, error, message):
    with pytest.raises(error, match=message):
        token_sum_loss(loss_fn)


@pytest.mark.slow
def test_tokens_check_equivalence_passes_a_recognised_token_mean_and_names_batch_norm_alone():
    # check_equivalence trains GradAccumulationCell as a user would: a recognised token mean with ignored labels is
    # exact. Control: BatchNorm fails, named alone (no token-mean cause where the labels are counted).
    batches = _ignored_label_batches(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check_equivalence(lambda: nn.WithLossCell(make_mlp(), nn.CrossEntropyLoss()), batches, K)
        assert report.passed, report
        failed = check_equivalence(lambda: nn.WithLossCell(nn.SequentialCell(nn.Dense(16, 16), nn.BatchNorm1d(16),
                                                                             make_mlp()), nn.CrossEntropyLoss()),
                                   batches, K)
    assert not failed.passed
    assert len(failed.causes) == 1 and failed.causes[0].startswith("batch normalisation"), failed.causes
