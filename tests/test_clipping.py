"""Clipping by global norm: once per optimizer step, on the reduced, unscaled window gradient, as the full batch."""
import pytest
from mindspore import nn, Tensor

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from helpers import (assert_params_close, assert_params_moved, ce, classification_batches, ClippedStep, make_mlp,
                     make_optimizer, params_of)

K = 4
BATCH = 32
MAX_NORM = 0.05


@pytest.mark.slow
@pytest.mark.parametrize("micro", [False, True], ids=["window", "micro_batches"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_clipping_once_per_step_matches_full_batch(micro, optimizer):
    batches = classification_batches(3, BATCH)
    ref_net = make_mlp()
    initial = params_of(ref_net)
    ref = ClippedStep(nn.WithLossCell(ref_net, ce()), make_optimizer(optimizer, ref_net.trainable_params()), MAX_NORM)
    for x, y in batches:
        ref(Tensor(x), Tensor(y))

    def run(max_grad_norm):
        net = make_mlp()
        loss_net = nn.WithLossCell(net, ce())
        opt = make_optimizer(optimizer, net.trainable_params())
        if micro:
            cell = AccumulatingTrainOneStepCell(GradAccumulationCell(loss_net, K), opt, 1, max_grad_norm=max_grad_norm)
            feed = batches
        else:
            cell = AccumulatingTrainOneStepCell(loss_net, opt, K, max_grad_norm=max_grad_norm)
            feed = [(x[i::K], y[i::K]) for x, y in batches for i in range(K)]
        for x, y in feed:
            cell(Tensor(x), Tensor(y))
        return params_of(net)

    assert_params_moved(params_of(ref_net), initial)
    assert_params_close(run(MAX_NORM), params_of(ref_net), rtol=1e-5, atol=1e-6)
    # Negative control: without clipping the update differs (clipping is active at this max_grad_norm).
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(run(None), params_of(ref_net), rtol=1e-5, atol=1e-6)


def test_clipping_each_micro_batch_is_not_the_same():
    # Negative control for "once per step": clipping every quarter batch then averaging differs.
    batches = classification_batches(2, BATCH)
    ref_net = make_mlp()
    ref = ClippedStep(nn.WithLossCell(ref_net, ce()), nn.SGD(ref_net.trainable_params(), 0.1), MAX_NORM)
    for x, y in batches:
        ref(Tensor(x), Tensor(y))
    net = make_mlp()
    per_batch = ClippedStep(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), 0.1 / K), MAX_NORM)
    for x, y in batches:
        for i in range(K):
            per_batch(Tensor(x[i::K]), Tensor(y[i::K]))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(params_of(net), params_of(ref_net), rtol=1e-5, atol=1e-6)
