"""Models nobody here wrote, at tiny configs on CPU, against the plain full batch: MindFormers' LLaMA (its own loss
with custom bprops and a (1,) loss, -100 labels, right-padded ragged batches through the token route, shared position
ids, Model.train), through both cells in graph mode and GradAccumulationCell in PyNative mode, and mindcv's ViT.
Skipped, saying why, where a library is absent."""

import numpy as np
import mindspore as ms
import mindspore.dataset as ds
import pytest
from mindspore import nn, Tensor
from mindspore.train import LossMonitor, Model

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell, token_sum_loss
from helpers import (assert_params_moved, assert_updates_close, ce, classification_batches, LLAMA_SEQ as SEQ,
                     LLAMA_VOCAB as VOCAB, make_llama, make_optimizer, params_of, RecordLoss, update_ratios)

pytestmark = pytest.mark.realmodels

mindformers = pytest.importorskip("mindformers", reason="MindFormers is not installed (.ci/run installs 2.1.0)")
mindcv = pytest.importorskip("mindcv", reason="mindcv is not installed (.ci/run installs it)")

K = 4
BATCH, PAD = 8, 0
# Of each parameter's own full-batch update: float32 summation order differs between the two paths.
FRACTION = 1e-3   # check_equivalence's tolerance; measured worst: 3.7e-4 (attention wq, tiny and cancelling gradients)
MOVED = dict(min_change=1e-6)
MODES = [pytest.param(ms.GRAPH_MODE, id="graph"), pytest.param(ms.PYNATIVE_MODE, id="pynative")]
# (mode, cell): both cells in graph mode (MindFormers' loss cells have bprops calling mindspore.ops.zeros_like, which
# GradAccumulationCell's nested gradient compiles through ms_gradaccum/_mindspore/patches.py), GradAccumulationCell in
# PyNative mode.
WAYS = [pytest.param(ms.GRAPH_MODE, "GradAccumulationCell", id="graph-GradAccumulationCell"),
        pytest.param(ms.GRAPH_MODE, "AccumulatingTrainOneStepCell", id="graph-AccumulatingTrainOneStepCell"),
        pytest.param(ms.PYNATIVE_MODE, "GradAccumulationCell", id="pynative-GradAccumulationCell")]


def accumulating(cell: str, **kwargs):
    """``wrap(model, optimizer)`` training through `cell`, with `kwargs` for it (per_token_loss, shared_inputs)."""
    if cell == "AccumulatingTrainOneStepCell":
        return lambda model, optimizer: AccumulatingTrainOneStepCell(model, optimizer, 1, micro_size=K, **kwargs)
    return lambda model, optimizer: nn.TrainOneStepCell(GradAccumulationCell(model, K, **kwargs), optimizer)


def _report(name, actual, expected, initial):
    worst = max(update_ratios(actual, expected, initial).items(), key=lambda item: item[1])
    print(f"[{name}] worst parameter {worst[0]}: {worst[1]:.2e} of its update")


def _train(model, wrap, batches, optimizer="momentum"):
    initial = params_of(model)
    step = wrap(model, make_optimizer(optimizer, model.trainable_params()))
    losses = [step(*batch) for batch in batches]
    return params_of(model), losses, initial


def _token_batches(steps=3, seed=0):
    """Right-padded sequences of uneven lengths (pad 0) whose prompts are masked with -100 labels."""
    rng = np.random.RandomState(seed)
    batches = []
    for _ in range(steps):
        ids = rng.randint(1, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
        lengths = rng.randint(3, SEQ + 2, BATCH)
        lengths[:2] = SEQ + 1                                   # the first micro-batch is full, others are short
        labels = ids.copy()
        for row, length in enumerate(lengths):
            ids[row, length:] = PAD
            labels[row, length:] = -100
            labels[row, :rng.randint(1, 4)] = -100              # the prompt
        batches.append((Tensor(ids), Tensor(labels)))
    return batches


@pytest.mark.slow
@pytest.mark.parametrize("mode, cell", WAYS)
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_real_models_llama_own_loss_trains_like_the_full_batch(mode, cell, optimizer):
    ms.set_context(mode=mode)
    batches = [(Tensor(np.random.RandomState(s).randint(1, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)),)
               for s in range(3)]
    expected, expected_losses, initial = _train(make_llama(), nn.TrainOneStepCell, batches, optimizer)
    actual, losses, _ = _train(make_llama(), accumulating(cell), batches, optimizer)
    assert_params_moved(expected, initial, **MOVED)
    _report("llama_own_loss_trains_like_the_full_batch", actual, expected, initial)
    assert_updates_close(actual, expected, initial, fraction=FRACTION)
    assert all(loss.shape == (1,) for loss in losses)        # MindFormers' loss shape, as its train cells return it
    np.testing.assert_allclose([loss.asnumpy() for loss in losses], [loss.asnumpy() for loss in expected_losses],
                               rtol=1e-5)


# Each route through both cells in graph mode; in PyNative the route nothing declares (the others differ there only
# in what the network returns, which the graph-mode runs cover).
ROUTES = [pytest.param(route, *way.values, id=f"{route}-{way.id}")
          for route in ("config", "token_sum_loss", "recognised")
          for way in WAYS if way.values[0] == ms.GRAPH_MODE or route == "recognised"]


@pytest.mark.slow
@pytest.mark.parametrize("route, mode, cell", ROUTES)
def test_real_models_llama_ragged_masked_batches_through_the_token_route(mode, cell, route):
    # The full batch's loss is the mean over all its valid tokens; micro-batches hold very different numbers of them.
    # Routes: MindFormers' own (sum, count) mode, token_sum_loss on a built model, or nothing said (the cells recognise
    # MindFormers' CrossEntropyLoss and count its tokens; the model keeps its own loss cell).
    ms.set_context(mode=mode)
    batches = _token_batches()
    expected, expected_losses, initial = _train(make_llama(), nn.TrainOneStepCell, batches)

    def per_token_model():
        if route == "config":
            return make_llama(per_token=True)          # MindFormers' own (sum, count) mode
        model = make_llama()
        if route == "token_sum_loss":
            model.loss = token_sum_loss(model.loss)    # the same, on a model already built
        return model

    model = per_token_model()
    actual, losses, _ = _train(model, accumulating(cell, **({} if route == "recognised" else {"per_token_loss": True})),
                               batches)
    assert route != "recognised" or not model.loss.calculate_per_token_loss   # the user's model as it was
    assert_params_moved(expected, initial, **MOVED)
    _report("llama_ragged_masked_batches_through_the_token_route", actual, expected, initial)
    assert_updates_close(actual, expected, initial, fraction=FRACTION)
    np.testing.assert_allclose([float(loss.asnumpy().reshape(-1)[0]) for loss in losses],
                               [float(loss.asnumpy().reshape(-1)[0]) for loss in expected_losses], rtol=1e-5)
    # Negative control: MindFormers' mean per micro-batch, weighted by rows (declared so: no warning), trains off. The
    # graph stops it on the first call: the loss divides by a count of tokens (its mask, from ids and labels).
    with pytest.raises(ValueError, match=r"the loss of LlamaForCausalLM is normalised over the batch by what the cell "
                                         r"cannot count from the inputs alone: .*per_token_loss=True"):
        _train(make_llama(), accumulating(cell, per_token_loss=False), batches)
    control, _, _ = _train(make_llama(), accumulating(cell, per_token_loss=False, check_loss=False), batches)
    with pytest.raises(AssertionError, match="differs from the reference by"):
        assert_updates_close(control, expected, initial, fraction=FRACTION)


@pytest.mark.slow
@pytest.mark.parametrize("mode, cell", WAYS)
def test_real_models_llama_shared_position_ids_and_none_inputs_pass_through(mode, cell):
    # model(input_ids, labels, input_position=None, position_ids (1, T) shared by the batch).
    ms.set_context(mode=mode)
    position_ids = Tensor(np.arange(SEQ, dtype=np.int32).reshape(1, SEQ))
    batches = [(ids, labels, None, position_ids) for ids, labels in _token_batches(2, seed=1)]

    expected, _, initial = _train(make_llama(), nn.TrainOneStepCell, batches)
    actual, _, _ = _train(make_llama(per_token=True), accumulating(cell, per_token_loss=True, shared_inputs=(3,)),
                          batches)
    assert_params_moved(expected, initial, **MOVED)
    _report("llama_shared_position_ids_and_none_inputs_pass_through", actual, expected, initial)
    assert_updates_close(actual, expected, initial, fraction=FRACTION)


def _token_dataset():
    rows = [(ids.asnumpy()[i], labels.asnumpy()[i]) for ids, labels in _token_batches(3, seed=2) for i in range(BATCH)]
    return ds.GeneratorDataset(lambda: iter(rows), ["input_ids", "labels"], shuffle=False).batch(BATCH)


@pytest.mark.slow
@pytest.mark.parametrize("mode, cell", WAYS)
def test_real_models_llama_model_train_with_loss_monitor(mode, cell, capsys):
    ms.set_context(mode=mode)
    reference = make_llama()
    initial = params_of(reference)
    expected_losses = RecordLoss()
    Model(reference, optimizer=make_optimizer("momentum", reference.trainable_params())).train(
        1, _token_dataset(), callbacks=[expected_losses], dataset_sink_mode=False)

    model = make_llama(per_token=True)
    optimizer = make_optimizer("momentum", model.trainable_params())
    losses = RecordLoss()
    if cell == "AccumulatingTrainOneStepCell":
        trained = Model(AccumulatingTrainOneStepCell(model, optimizer, 1, micro_size=K, per_token_loss=True))
    else:
        trained = Model(GradAccumulationCell(model, K, per_token_loss=True), optimizer=optimizer)
    capsys.readouterr()
    trained.train(1, _token_dataset(), callbacks=[losses, LossMonitor(1)], dataset_sink_mode=False)
    assert len([line for line in capsys.readouterr().out.splitlines() if "loss is" in line]) == 3
    assert_params_moved(params_of(reference), initial, **MOVED)
    assert_updates_close(params_of(model), params_of(reference), initial, fraction=FRACTION)
    np.testing.assert_allclose(losses.losses, expected_losses.losses, rtol=1e-5)


def make_vit():
    from mindcv.models.vit import VisionTransformer   # pylint: disable=import-outside-toplevel
    ms.set_seed(0)
    return VisionTransformer(image_size=16, patch_size=8, in_channels=1, embed_dim=32, depth=1, num_heads=2,
                             num_classes=4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_real_models_mindcv_vit_trains_like_the_full_batch(mode):
    ms.set_context(mode=mode)
    batches = [(Tensor(x), Tensor(y)) for x, y in classification_batches(3, 16, in_shape=(1, 16, 16))]
    expected, _, initial = _train(make_vit(), lambda net, opt: nn.TrainOneStepCell(nn.WithLossCell(net, ce()), opt),
                                  batches)
    actual, _, _ = _train(make_vit(), lambda net, opt: nn.TrainOneStepCell(
        GradAccumulationCell(nn.WithLossCell(net, ce()), K), opt), batches)
    assert_params_moved(expected, initial, **MOVED)
    _report("mindcv_vit_trains_like_the_full_batch", actual, expected, initial)
    assert_updates_close(actual, expected, initial, fraction=FRACTION)


def test_real_models_token_sum_loss_leaves_mindformers_loss_as_it_was():
    # Its (sum, count) form is a copy with calculate_per_token_loss=True: the model's own loss cell keeps its mean
    # (a copy.copy of a Cell shares its attribute dict, which set the flag on both before).
    loss = make_llama().loss
    summed = token_sum_loss(loss)
    assert summed.calculate_per_token_loss and not loss.calculate_per_token_loss
    assert summed.__dict__ is not loss.__dict__ and summed._cells is not loss._cells   # pylint: disable=protected-access
