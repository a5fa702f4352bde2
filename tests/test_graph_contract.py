"""The loss contract read from the loss network's graph (diagnostics.batch_axis, batch_rules, batch_table,
graph_contract): each class of loss the eager probe could not reach, against the plain full batch for several steps
with the irregular data on a later step, each with a negative control (the check off: a mean of micro-batch losses);
the coupled losses stopped on step 1 naming the primitive."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor

from ms_gradaccum import GradAccumulationCell, IgnoredLabelMean, RowMean, RowSum, check_loss_contract
from ms_gradaccum.core.input_count import InputCountMean
from helpers import assert_params_moved, params_of

K, B, T, VOCAB = 4, 16, 6, 11
# Dropout that keeps every value (with overwhelming probability): the primitive is in the graph and the network
# draws, yet the full batch and the accumulated run compute the same values, so they can be compared exactly.
KEEP_ALL = 1e-7


def _seeded(net: nn.Cell, seed: int = 0) -> nn.Cell:
    rng = np.random.RandomState(seed)
    for param in net.trainable_params():
        param.set_data(Tensor((rng.randn(*param.shape) * 0.3).astype(np.float32)))
    return net


class TokenLM(nn.Cell):
    """An integer-input language model with dropout: ids -> logits (B, T, V); the loss is the subclass's."""

    def __init__(self, p=KEEP_ALL, head_last=False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 8)
        self.dropout = nn.Dropout(p=p)
        self.out = nn.Dense(8, VOCAB)
        if head_last:   # an unused head defined last (a pooler, a value head)
            self.pooler = nn.Dense(8, 3)
        _seeded(self)

    def logits(self, ids):
        return self.out(self.dropout(self.embedding(ids)))


class IgnoredMean(TokenLM):
    """``ops.cross_entropy(logits, labels, ignore_index=...)`` (or ``ops.nll_loss`` of a log-softmax)."""

    def __init__(self, ignore=-100, nll=False, **kwargs):
        super().__init__(**kwargs)
        self.ignore, self.nll = ignore, nll

    def construct(self, ids, labels):
        logits = self.logits(ids).reshape(-1, VOCAB)
        if self.nll:
            return ops.nll_loss(ops.log_softmax(logits, -1), labels.reshape(-1), ignore_index=self.ignore)
        return ops.cross_entropy(logits, labels.reshape(-1), ignore_index=self.ignore)


class ShiftedMaskMean(TokenLM):
    """A causal LM's loss as LM code writes it: labels shifted by one, a ``labels >= 0`` mask, a masked mean."""

    def construct(self, ids, labels):
        logits = self.logits(ids)[:, :-1].reshape(-1, VOCAB)
        shifted = labels[:, 1:].reshape(-1)
        mask = (shifted >= 0).astype(ms.float32)
        per_token = ops.cross_entropy(logits, ops.maximum(shifted, 0), reduction="none")
        return (per_token * mask).sum() / mask.sum()


class IdsMaskMean(TokenLM):
    """A mask built from the ids inside the network (padding id 0), divided by its sum."""

    def construct(self, ids, labels):
        mask = (ids != 0).astype(ms.float32).reshape(-1)
        per_token = ops.cross_entropy(self.logits(ids).reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        return (per_token * mask).sum() / mask.sum()


class TwoHeads(TokenLM):
    """Main and auxiliary heads, two ``nn.CrossEntropyLoss`` on the same labels: one count serves both."""

    def __init__(self):
        super().__init__()
        self.aux = nn.Dense(8, VOCAB)
        self.main_loss, self.aux_loss = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
        _seeded(self, 1)

    def construct(self, ids, labels):
        hidden = self.dropout(self.embedding(ids)).reshape(-1, 8)
        labels = labels.reshape(-1)
        return self.main_loss(self.out(hidden), labels) + 0.4 * self.aux_loss(self.aux(hidden), labels)


def token_batches(steps, ignore=-100, irregular_from=2, seed=0, first_rows_ignored=False, empty_micro_batch=False):
    """``(ids, labels)`` batches: no ignored label before step `irregular_from`, about 40% ignored after (and with
    `empty_micro_batch`, every label of micro-batch 1 from then on)."""
    rng = np.random.RandomState(seed)
    out = []
    for step in range(steps):
        ids = rng.randint(1, VOCAB, (B, T)).astype(np.int32)
        labels = rng.randint(0, VOCAB, (B, T)).astype(np.int32)
        labels[labels == ignore] = (ignore + 1) % VOCAB if 0 <= ignore < VOCAB else labels[labels == ignore]
        if step >= irregular_from:
            labels[rng.rand(B, T) < 0.4] = ignore
            ids[rng.rand(B, T) < 0.3] = 0
            labels[::4, 0] = 1   # every micro-batch keeps a label
            ids[::4, 0] = 1
            if empty_micro_batch:
                labels[B // K:2 * B // K] = ignore
        if first_rows_ignored and step == 0:
            labels[:2] = ignore   # the rows the eager probe read on step 1
            labels[4:6] = ignore
        out.append((ids, labels))
    return out


def run(make, batches, micro_size=K, mode=ms.GRAPH_MODE, **kwargs):
    """The weights after training `batches`: the plain full batch (micro_size 0) or through GradAccumulationCell."""
    ms.set_context(mode=mode)
    net = make()
    initial = params_of(net)
    optimizer = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    inner = GradAccumulationCell(net, micro_size, **kwargs) if micro_size else net
    step = nn.TrainOneStepCell(inner, optimizer)
    step.set_train()
    for batch in batches:
        step(*(Tensor(a) for a in batch))
    return initial, params_of(net), inner


def off(actual, expected, initial):
    """The largest weight difference from the full batch over the full batch's largest update."""
    return max(float(np.abs(actual[n] - expected[n]).max() / max(np.abs(expected[n] - initial[n]).max(), 1e-12))
               for n in expected)


def assert_exact_with_control(make, batches, mode=ms.GRAPH_MODE, unused=()):
    """Trained through the cell, `make`'s loss equals the full batch's; with the check off it does not."""
    initial, expected, _ = run(make, batches, 0, mode)
    _, actual, cell = run(make, batches, K, mode)
    assert_params_moved({n: v for n, v in expected.items() if n.split(".")[0] not in unused},
                        {n: v for n, v in initial.items() if n.split(".")[0] not in unused})
    assert off(actual, expected, initial) < 1e-4, (off(actual, expected, initial), cell.kind)
    _, control, _ = run(make, batches, K, mode, check_loss=False)
    assert off(control, expected, initial) > 1e-2
    return cell


@pytest.mark.slow
@pytest.mark.parametrize("mode", [pytest.param(ms.GRAPH_MODE, id="graph"), pytest.param(ms.PYNATIVE_MODE,
                                                                                         id="pynative")])
def test_graph_contract_integer_input_network_with_dropout_counts_its_ignored_labels(mode):
    # The gradient probe needed a float input and the value comparison a network without random draws: this one has
    # neither, and trained 38% off. Read from the graph: a mean over the labels that are not -100, counted.
    cell = assert_exact_with_control(IgnoredMean, token_batches(4), mode)
    assert cell.kind == IgnoredLabelMean(1)


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("make, kind", [
    (lambda: IgnoredMean(head_last=True), IgnoredLabelMean(1)),
    (ShiftedMaskMean, InputCountMean),
    (IdsMaskMean, IgnoredLabelMean(0, 0)),
], ids=["unused_head_last", "shifted_labels_ge_0", "mask_from_ids"])
def test_graph_contract_counts_what_the_loss_divides_by_whatever_the_network_holds(make, kind):
    # An unused head defined last blinded the probe of the last two weights; a `labels >= 0` mask after a shift and
    # a mask built from the ids are counts taken from one input, replayed per micro-batch.
    batches = token_batches(4, ignore=-1) if make is ShiftedMaskMean else token_batches(4)
    cell = assert_exact_with_control(make, batches, unused=("pooler",))
    assert cell.kind == kind if isinstance(kind, IgnoredLabelMean) else isinstance(cell.kind, kind), cell.kind


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("ignore, nll", [(-1, False), (0, True), (1, False), (255, True)],
                         ids=["-1-cross_entropy", "0-nll_loss", "1-cross_entropy", "255-nll_loss"])
def test_graph_contract_ignore_values_other_than_minus_100(ignore, nll):
    # ops.cross_entropy / ops.nll_loss with ignore_index -1, 0, 1 (RoBERTa's pad id) and 255 (segmentation): the
    # graph holds the value; each is counted as the -100 ones are.
    vocab_ignore = ignore if ignore < VOCAB else 255
    cell = assert_exact_with_control(lambda: IgnoredMean(ignore=vocab_ignore, nll=nll),
                                     token_batches(4, ignore=vocab_ignore))
    assert cell.kind == IgnoredLabelMean(1, vocab_ignore), cell.kind


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("make, ignore", [(IgnoredMean, -100), (ShiftedMaskMean, -1)],
                         ids=["ignored_label_mean", "shifted_labels_ge_0"])
def test_graph_contract_micro_batch_without_a_valid_label_adds_nothing(make, ignore):
    # From step 3 micro-batch 1 holds no valid label: its mean is 0/0 where the full batch's is finite. The kind read
    # from the graph counts it 0 and leaves its loss and gradients out, as the full batch leaves its rows out.
    # Control: declared a row mean (the check off), the same data stops on that micro-batch's NaN.
    batches = token_batches(4, ignore=ignore, empty_micro_batch=True)
    initial, expected, _ = run(make, batches, 0)
    _, actual, cell = run(make, batches, K)
    assert cell.kind.skips_empty, cell.kind
    assert_params_moved(expected, initial)
    assert off(actual, expected, initial) < 1e-4, off(actual, expected, initial)
    with pytest.raises(ValueError, match=r"micro-batch 1 \(rows 4 to 7 of the batch of 16, micro_size=4\) returned a "
                                         r"non-finite loss"):
        run(make, batches, K, check_loss=False)


@pytest.mark.slow
def test_graph_contract_rows_the_probe_read_all_ignored_on_step_1():
    # The probe read fixed rows (the first halves of micro-batches 0 and 1); all their labels -100 on step 1 left it
    # undecided. The graph does not read rows.
    assert_exact_with_control(IgnoredMean, token_batches(4, first_rows_ignored=True))


@pytest.mark.slow
def test_graph_contract_two_losses_on_the_same_labels_share_one_count():
    # Stopped before ("these loss cells ran 2 times"), though one count serves both: the graph shows two means over
    # the same count. Control: with the check off, the recognised cells' own counting still refuses two calls.
    batches = token_batches(4)
    initial, expected, _ = run(TwoHeads, batches, 0)
    _, actual, cell = run(TwoHeads, batches, K)
    assert_params_moved(expected, initial)
    assert off(actual, expected, initial) < 1e-4 and cell.kind == IgnoredLabelMean(1), cell.kind
    with pytest.raises(ValueError, match="these loss cells ran 2 times"):
        run(TwoHeads, batches, K, check_loss=False)


class NoisySum(nn.Cell):
    """A summed loss in a network that draws (noise of a negligible size: the draws cannot change the values)."""

    def __init__(self):
        super().__init__()
        self.net = _seeded(nn.SequentialCell(nn.Dense(6, 8), nn.Tanh(), nn.Dense(8, 6)))

    def construct(self, x, y):
        noisy = x + 1e-12 * ops.standard_normal(x.shape)
        return ((self.net(noisy) - y) ** 2).sum()


class VAE(nn.Cell):
    """PyTorch's example VAE: binary cross-entropy and KL, both summed, with reparameterisation noise."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Dense(6, 8)
        self.mu, self.logvar = nn.Dense(8, 2), nn.Dense(8, 2)
        self.decoder = nn.SequentialCell(nn.Dense(2, 8), nn.ReLU(), nn.Dense(8, 6), nn.Sigmoid())
        _seeded(self, 2)

    def construct(self, x, y):
        hidden = ops.relu(self.encoder(x))
        mu, logvar = self.mu(hidden), self.logvar(hidden)
        z = mu + ops.exp(0.5 * logvar) * (1e-12 * ops.standard_normal(mu.shape))
        recon = self.decoder(z)
        bce = ops.binary_cross_entropy(recon, y, reduction="sum")
        kl = -0.5 * (1 + logvar - mu ** 2 - ops.exp(logvar)).sum()
        return bce + kl


def float_batches(steps, seed=0, binary=False):
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(steps):
        x = rng.rand(B, 6).astype(np.float32)
        y = (rng.rand(B, 6) > 0.5).astype(np.float32) if binary else rng.randn(B, 6).astype(np.float32)
        out.append((x, y))
    return out


@pytest.mark.lowest
@pytest.mark.parametrize("make, binary", [(NoisySum, False), (VAE, True)], ids=["sum_with_noise", "vae"])
def test_graph_contract_sums_in_networks_that_draw_train_as_sums(make, binary):
    # The value comparison ran only where nothing is random: these trained with 1/micro_size of the gradient.
    cell = assert_exact_with_control(make, float_batches(3, binary=binary))
    assert cell.kind == RowSum(), cell.kind


class CTCMean(nn.Cell):
    """``nn.CTCLoss`` with its default mean, on a batch-first network (the time axis moved inside)."""

    def __init__(self):
        super().__init__()
        self.net = _seeded(nn.Dense(4, 5))
        self.loss = nn.CTCLoss(blank=0, reduction="mean")

    def construct(self, x, targets, input_lengths, target_lengths):
        log_probs = ops.log_softmax(self.net(x), -1).transpose(1, 0, 2)   # (T, N, C)
        return self.loss(log_probs, targets, input_lengths, target_lengths)


def test_graph_contract_ctc_mean_is_a_row_mean_no_value_written_into_its_targets():
    # The probe wrote -100 into the targets, which sent the CPU CTC kernel out of range: a false alarm. The graph is
    # read, nothing is written into an input.
    rng = np.random.RandomState(0)
    batches = []
    for _ in range(3):
        x = rng.randn(B, 8, 4).astype(np.float32)
        targets = rng.randint(1, 5, (B, 3)).astype(np.int32)
        batches.append((x, targets, np.full(B, 8, np.int32), rng.randint(1, 4, B).astype(np.int32)))
    initial, expected, _ = run(CTCMean, batches, 0)
    _, actual, cell = run(CTCMean, batches, K)
    assert_params_moved(expected, initial)
    assert off(actual, expected, initial) < 1e-4, cell.kind
    assert type(cell.kind).__name__ == "RowMean"


# --- coupled losses: stopped on step 1, the primitive named ---------------------------------------------------------

class Embedder(nn.Cell):
    def __init__(self):
        super().__init__()
        self.net = _seeded(nn.SequentialCell(nn.Dense(6, 8), nn.Tanh(), nn.Dense(8, 4)))


class InfoNCE(Embedder):
    def construct(self, x, y):
        similarity = ops.matmul(self.net(x), self.net(y).T)
        return ops.cross_entropy(similarity, ops.arange(x.shape[0]).astype(ms.int32))


class BatchHard(Embedder):
    def construct(self, x, y):
        e = self.net(x)
        distances = ((e.expand_dims(1) - e.expand_dims(0)) ** 2).sum(-1)
        return ops.relu(distances.max(axis=1) - distances.min(axis=1) + 0.1).mean()


class Dice(Embedder):
    def construct(self, x, y):
        p = ops.sigmoid(self.net(x))
        target = (y[:, :4] > 0).astype(ms.float32)
        return 1 - 2 * (p * target).sum() / (p.sum() + target.sum() + 1e-6)


class RMSE(Embedder):
    def construct(self, x, y):
        return ops.sqrt(((self.net(x) - y[:, :4]) ** 2).mean())


class OHEM(Embedder):
    def construct(self, x, y):
        per_row = ((self.net(x) - y[:, :4]) ** 2).mean(-1)
        return ops.topk(per_row, B // (2 * K))[0].mean()


class ValueBranch(Embedder):
    """A loss whose form depends on the values: summed where the batch's largest input is large, else averaged."""

    def construct(self, x, y):
        per_row = ((self.net(x) - y[:, :4]) ** 2).mean(-1)
        if x.max() > 0.97:
            return per_row.sum()
        return per_row.mean()


@pytest.mark.lowest
@pytest.mark.parametrize("make, says", [
    (ValueBranch, "a branch on a value taken over the rows"),
    (InfoNCE, "a matrix product between rows"),
    (BatchHard, "rows on different axes meet"),
    (Dice, "per_token_loss=True"),
    (RMSE, "Sqrt of a reduction over the rows"),
    (OHEM, "TopK along the rows"),
], ids=["value_branch", "info_nce", "batch_hard", "dice", "rmse", "ohem"])
def test_graph_contract_coupled_losses_stop_on_step_1_naming_the_primitive(make, says):
    net = make()
    before = params_of(net)
    step = nn.TrainOneStepCell(GradAccumulationCell(net, K), nn.Momentum(net.trainable_params(), 0.1, 0.9))
    x, y = float_batches(1)[0]
    with pytest.raises(ValueError) as caught:
        step(Tensor(x), Tensor(y))
    message = str(caught.value)
    assert says in message and "Read from the loss network's graph" in message, message
    assert "micro_size=1" in message, message
    assert all(np.array_equal(value, before[name]) for name, value in params_of(net).items()), "the weights moved"
    # Negative control: with the check off, it trains away from the full batch.
    batches = float_batches(2)
    initial, expected, _ = run(make, batches, 0)
    _, control, _ = run(make, batches, K, check_loss=False)
    assert off(control, expected, initial) > 1e-3


class RowMSE(Embedder):
    def construct(self, x, y):
        return ((self.net(x) - y[:, :4]) ** 2).mean()


class MeanByShape(Embedder):
    """A mean written as a sum over a number taken from the shape: a constant in the graph, which the graph at another
    row count shows to change with the rows."""

    def construct(self, x, y):
        return ((self.net(x) - y[:, :4]) ** 2).sum() / (x.shape[0] * 4)


@pytest.mark.slow
@pytest.mark.lowest
def test_graph_contract_read_from_the_compiled_step_without_compiling_the_network_apart(monkeypatch):
    # GRAPH_MODE: the contract is read from the step's own compiled graph (no compile of the network apart); a kind
    # other than the compiled one compiles the step once more. Control: a mean over a constant taken from the shape
    # needs the graph at another row count: with one micro-batch shape, the network is compiled apart at two (the spy
    # counts); with two shapes (an uneven split), the step's second loop body serves.
    from ms_gradaccum._mindspore import patches   # pylint: disable=import-outside-toplevel
    from ms_gradaccum.diagnostics import graph_contract   # pylint: disable=import-outside-toplevel
    apart, again = [], []
    forward, forget = graph_contract.forward_graph, patches.forget_compile
    monkeypatch.setattr(graph_contract, "forward_graph", lambda *args: apart.append(1) or forward(*args))
    monkeypatch.setattr(patches, "forget_compile", lambda *args: again.append(1) or forget(*args))
    float_batch = float_batches(1)
    for make, batches, kind, compiled_again, compiled_apart in (
            (RowMSE, float_batch, RowMean(), 0, 0),
            (IgnoredMean, token_batches(1), IgnoredLabelMean(1), 1, 0),
            (NoisySum, float_batch, RowSum(), 1, 0),
            (TwoHeads, token_batches(1), IgnoredLabelMean(1), 1, 0),
            (MeanByShape, float_batch, RowMean(), 0, 2),
            (MeanByShape, [tuple(a[:15] for a in float_batch[0])], RowMean(), 0, 0)):
        apart.clear()
        again.clear()
        _, _, cell = run(make, batches)
        assert cell.kind == kind, (make, cell.kind)
        assert (len(again), len(apart)) == (compiled_again, compiled_apart), (make, len(again), len(apart))


def run_in_jit(make, batches, micro_size=K, **kwargs):
    """`run` as a functional loop: ``value_and_grad`` of the cell in an ``ms.jit`` step (the batch never reaches the
    cell from Python, and no train cell is built)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    net = make()
    initial = params_of(net)
    optimizer = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    cell = GradAccumulationCell(net, micro_size, weights=optimizer.parameters, **kwargs) if micro_size else net
    grad_fn = ms.value_and_grad(cell, None, optimizer.parameters)

    @ms.jit
    def step(*inputs):
        loss, grads = grad_fn(*inputs)
        return ops.depend(loss, optimizer(grads))
    for batch in batches:
        step(*(Tensor(a) for a in batch))
    return initial, params_of(net), cell


@pytest.mark.slow
@pytest.mark.lowest
def test_graph_contract_read_from_a_jit_functions_own_graph():
    # A functional loop in ms.jit: the contract is read from the function's compiled graph before it runs (it compiled
    # the value comparison into the graph before); a counted mean trains exactly (the function compiled again for its
    # kind), a coupled loss stops at every call with no weight moved. Control: with the check off, the row mean is off.
    batches = token_batches(4)
    initial, expected, _ = run_in_jit(IgnoredMean, batches, 0)
    _, actual, cell = run_in_jit(IgnoredMean, batches)
    assert cell.kind == IgnoredLabelMean(1) and cell.contract.decided and not cell.contract.in_graph, cell.kind
    assert_params_moved(expected, initial)
    assert off(actual, expected, initial) < 1e-4, off(actual, expected, initial)
    _, control, _ = run_in_jit(IgnoredMean, batches, check_loss=False)
    assert off(control, expected, initial) > 1e-2
    net = InfoNCE()
    before = params_of(net)
    optimizer = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    grad_fn = ms.value_and_grad(GradAccumulationCell(net, K, weights=optimizer.parameters), None,
                                optimizer.parameters)

    @ms.jit
    def step(x, y):
        loss, grads = grad_fn(x, y)
        return ops.depend(loss, optimizer(grads))
    x, y = float_batches(1)[0]
    for _ in range(2):
        with pytest.raises(ValueError, match="a matrix product between rows"):
            step(Tensor(x), Tensor(y))
    assert all(np.array_equal(value, before[name]) for name, value in params_of(net).items()), "the weights moved"


def test_graph_contract_reading_is_reported_and_needs_no_eager_pass(monkeypatch):
    # check_loss_contract reports what the graph showed; no network pass runs (the eager runner is not called).
    from ms_gradaccum.diagnostics import eager   # pylint: disable=import-outside-toplevel
    calls = []
    monkeypatch.setattr(eager, "run_eagerly", lambda *args, **kwargs: calls.append(1))
    ids, labels = token_batches(1)[0]
    net = IgnoredMean(ignore=255, p=0.3)
    net.set_train()
    report = check_loss_contract(net, (Tensor(ids), Tensor(labels)), K)
    assert report.kind == IgnoredLabelMean(1, 255) and report.count_input == 1 and report.read_from_graph
    assert report.random_primitives == ("Dropout",) and report.primitives > 10 and not calls
