"""Which weights are trained: the wrapping optimizer's (or requires_grad's), read when the graph compiles.

Staged fine-tuning freezes and unfreezes layers after the loss network (and its accumulation cell) is built; the
accumulation must follow exactly what plain full-batch training with the same optimizer does.
"""
import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor
from mindspore.train import Model

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from helpers import (assert_params_close, assert_params_equal, ce, classification_batches, classification_dataset,
                     make_mlp, make_optimizer, max_abs_diff, train_steps)

BATCH, K, STEPS = 32, 4, 3
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
FIRST = ("0.weight", "0.bias")    # the first Dense layer of helpers.make_mlp



def _set_first_layer(net, trainable):
    for param in net.get_parameters():
        if param.name in FIRST:
            param.requires_grad = trainable


def _all_params(net):
    return {p.name: p.asnumpy().copy() for p in net.get_parameters()}


def _staged(wrap, freeze_before, freeze_after, how="train_one_step", optimizer="momentum", rebind=True):
    """Builds the loss network with the first layer frozen or not, wraps it (`wrap`), changes the first layer's
    requires_grad after wrapping, builds the optimizer from trainable_params() after that, and trains 3 steps. In graph
    mode a functional loop (no train cell built around the cell) calls ``rebind()`` after the change (`rebind`)."""
    net = make_mlp()
    _set_first_layer(net, not freeze_before)
    loss_net = wrap(nn.WithLossCell(net, ce()))
    _set_first_layer(net, not freeze_after)
    if rebind and how == "functional" and ms.get_context("mode") == ms.GRAPH_MODE and hasattr(loss_net, "rebind"):
        loss_net.rebind()
    opt = make_optimizer(optimizer, net.trainable_params())
    batches = classification_batches(STEPS, BATCH)
    if how == "model":
        Model(loss_net, optimizer=opt).train(1, classification_dataset(STEPS, BATCH), dataset_sink_mode=False)
    elif how == "functional":
        grad_fn = ms.value_and_grad(loss_net, None, opt.parameters)
        for x, y in batches:
            _, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
    elif how == "accumulating":
        train_steps(AccumulatingTrainOneStepCell(loss_net, opt, 1), batches)
    else:
        train_steps(nn.TrainOneStepCell(loss_net, opt), batches)
    return _all_params(net), loss_net


def _plain(freeze_after, optimizer="momentum"):
    return _staged(lambda loss_net: loss_net, True, freeze_after, optimizer=optimizer)[0]


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE])
@pytest.mark.parametrize("how", ["train_one_step", "model", "functional", "accumulating"])
def test_trainable_layer_unfrozen_after_wrapping_is_trained(how, mode):
    ms.set_context(mode=mode)
    expected = _plain(freeze_after=False)
    initial = _all_params(make_mlp())
    actual, _ = _staged(lambda loss_net: GradAccumulationCell(loss_net, K), True, False, how)
    assert_params_close(actual, expected, **TOLERANCE)
    # The unfrozen layer really moved, as in plain training: equality is not vacuous, and a cell
    # that kept the trainable set of its construction (the layer frozen) is a different model.
    assert max_abs_diff({n: actual[n] for n in FIRST}, {n: initial[n] for n in FIRST}) > 1e-3
    control = _plain(freeze_after=True)
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, **TOLERANCE)


def test_trainable_change_a_graph_cannot_follow_asks_for_rebind():
    # A functional loop in graph mode compiles through a jit function: no root is handed over and no train cell is
    # built around the cell, so a layer unfrozen after wrapping is not followed by itself; the compile says so.
    with pytest.raises(RuntimeError, match=r"the network's weights with requires_grad=True changed since the cell was "
                                           r"bound \(0.weight, 0.bias\).* Call cell.rebind\(\) after freezing or "
                                           r"unfreezing weights, or pass weights= to the cell"):
        _staged(lambda loss_net: GradAccumulationCell(loss_net, K), True, False, "functional", rebind=False)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["train_one_step", "model", "functional", "accumulating"])
def test_trainable_layer_frozen_after_wrapping_stays_and_costs_no_buffer(how):
    expected = _plain(freeze_after=True)
    if how == "functional":
        # No optimizer around the cell and a frozen layer: which weights value_and_grad differentiates is the user's
        # to say (weights=), not guessed (0.3.0).
        with pytest.raises(ValueError, match=r"the argument 'weights' is required where no optimizer is around"):
            _staged(lambda loss_net: GradAccumulationCell(loss_net, K), False, True, how)
        return
    actual, loss_net = _staged(lambda loss_net: GradAccumulationCell(loss_net, K), False, True, how)
    assert_params_close(actual, expected, **TOLERANCE)
    initial = _all_params(make_mlp())
    assert_params_equal({n: actual[n] for n in FIRST}, {n: initial[n] for n in FIRST})
    if how != "accumulating":   # there the train cell's own buffers serve (one per optimizer parameter)
        buffers = sorted(b.name for b in loss_net.get_parameters() if b.name.startswith("accu_grads."))
        assert buffers == sorted(f"accu_grads.{n}" for n in expected if n not in FIRST)


def test_trainable_optimizer_parameter_without_requires_grad_is_trained_as_plain_training_does():
    # MindSpore differentiates what the optimizer holds, whatever requires_grad says: plain training updates a
    # parameter frozen after the optimizer was built, and so must the accumulation.
    def run(wrap):
        net = make_mlp()
        loss_net = wrap(nn.WithLossCell(net, ce()))
        opt = make_optimizer("sgd", net.trainable_params())
        _set_first_layer(net, False)
        train_steps(nn.TrainOneStepCell(loss_net, opt), classification_batches(STEPS, BATCH))
        return _all_params(net)

    expected = run(lambda loss_net: loss_net)
    initial = _all_params(make_mlp())
    assert max_abs_diff({n: expected[n] for n in FIRST}, {n: initial[n] for n in FIRST}) > 1e-3
    assert_params_close(run(lambda loss_net: GradAccumulationCell(loss_net, K)), expected, **TOLERANCE)


def test_trainable_optimizer_on_a_subset_gets_buffers_for_that_subset_only():
    net = make_mlp()
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), K)
    head = [p for p in net.trainable_params() if p.name.startswith("4.")]
    step = nn.TrainOneStepCell(cell, make_optimizer("sgd", head))
    initial = _all_params(net)
    train_steps(step, classification_batches(STEPS, BATCH))
    assert sorted(p.name for p in step.get_parameters() if p.name.startswith("accu_grads.")) == \
        ["accu_grads.4.bias", "accu_grads.4.weight"]
    after = _all_params(net)
    assert all(np.array_equal(after[n], initial[n]) for n in after if not n.startswith("4."))
    assert max_abs_diff({n: after[n] for n in ("4.weight",)}, {n: initial[n] for n in ("4.weight",)}) > 1e-3


@pytest.mark.slow
def test_trainable_new_train_cell_after_freezing_follows_and_drops_the_buffer():
    # The same GradAccumulationCell, trained, then a layer frozen and a new optimizer and train cell built: the
    # new graph trains the new set, and the frozen layer's buffer is gone (not in checkpoints, no memory).
    def run(wrap):
        net = make_mlp()
        loss_net = wrap(nn.WithLossCell(net, ce()))
        batches = classification_batches(2 * STEPS, BATCH)
        train_steps(nn.TrainOneStepCell(loss_net, make_optimizer("sgd", net.trainable_params())), batches[:STEPS])
        _set_first_layer(net, False)
        step = nn.TrainOneStepCell(loss_net, make_optimizer("sgd", net.trainable_params()))
        train_steps(step, batches[STEPS:])
        return _all_params(net), step

    expected, _ = run(lambda loss_net: loss_net)
    actual, step = run(lambda loss_net: GradAccumulationCell(loss_net, K))
    assert_params_close(actual, expected, **TOLERANCE)
    names = [p.name for p in step.get_parameters() if p.name.startswith("accu_grads.")]
    assert names and not [n for n in names if n in {f"accu_grads.{f}" for f in FIRST}]


@pytest.mark.slow
@pytest.mark.parametrize("freeze_before, freeze_after", [(True, False), (False, True)])
def test_trainable_accumulating_cell_around_grad_accumulation_cell(freeze_before, freeze_after):
    # Was: IndexError (unfreeze) and an AssignAdd shape error (freeze): the train cell used the inner cell's
    # buffers, taken when it was built. Now one set of buffers, for the optimizer's parameters.
    expected = _plain(freeze_after=freeze_after, optimizer="adam")
    actual, _ = _staged(lambda loss_net: GradAccumulationCell(loss_net, K), freeze_before, freeze_after,
                        "accumulating", optimizer="adam")
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-5)


class _HandWrittenTrainCell(nn.Cell):
    """A train cell as MindSpore's tutorials write one (not an nn.TrainOneStepCell): it holds `optimizer`."""

    def __init__(self, network, optimizer):
        super().__init__(auto_prefix=False)
        self.network, self.optimizer = network, optimizer
        self.weights = optimizer.parameters
        self.grad = ops.GradOperation(get_by_list=True)

    def construct(self, x, y):
        loss = self.network(x, y)
        grads = self.grad(self.network, self.weights)(x, y)
        return ops.depend(loss, self.optimizer(grads))


@pytest.mark.slow
def test_trainable_hand_written_train_cell_is_followed_through_its_optimizer():
    def run(wrap):
        net = make_mlp()
        loss_net = wrap(nn.WithLossCell(net, ce()))
        opt = make_optimizer("momentum", net.trainable_params())
        _set_first_layer(net, False)   # frozen after the optimizer was built: plain training still updates it
        train_steps(_HandWrittenTrainCell(loss_net, opt), classification_batches(STEPS, BATCH))
        return _all_params(net)

    expected = run(lambda loss_net: loss_net)
    initial = _all_params(make_mlp())
    assert max_abs_diff({n: expected[n] for n in FIRST}, {n: initial[n] for n in FIRST}) > 1e-3
    assert_params_close(run(lambda loss_net: GradAccumulationCell(loss_net, K)), expected, **TOLERANCE)


_GLOBAL_GRAD_FN = None   # MindSpore's functional recipe keeps grad_fn global and uses it in an @ms.jit train step


def _global_train_step(x, y):
    return _GLOBAL_GRAD_FN(x, y)


def _functional_with_frozen_in_weights(wrap, style):
    """The functional style with an optimizer over get_parameters(), one layer frozen (requires_grad=False) yet in
    the weights passed to value_and_grad: MindSpore's graph mode differentiates it anyway."""
    global _GLOBAL_GRAD_FN  # pylint: disable=global-statement
    net = make_mlp()
    _set_first_layer(net, False)
    opt = make_optimizer("momentum", net.get_parameters())
    loss_net = wrap(nn.WithLossCell(net, ce()), opt)

    def forward(x, y):
        return loss_net(x, y)

    grad_fn = ms.value_and_grad(loss_net if style == "cell" else forward, None, opt.parameters)
    def closure_train_step(x, y):
        return grad_fn(x, y)

    def helper_train_step(x, y):
        return closure_train_step(x, y)   # the grad function one call further down

    if style == "jit_closure":
        train_step = ms.jit(closure_train_step)
    elif style == "jit_helper":
        train_step = ms.jit(helper_train_step)
    elif style == "jit_global":
        _GLOBAL_GRAD_FN, train_step = grad_fn, ms.jit(_global_train_step)
    else:
        train_step = grad_fn
    for x, y in classification_batches(STEPS, BATCH):
        _, grads = train_step(Tensor(x), Tensor(y))
        opt(grads)
    return _all_params(net)


@pytest.mark.slow
@pytest.mark.lowest
@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE])
@pytest.mark.parametrize("style", ["cell", "forward_fn", "jit_closure", "jit_global", "jit_helper"])
def test_trainable_functional_weights_are_followed_including_frozen_ones(style, mode):
    # Without a train cell, the weights are those passed (weights=), as to value_and_grad.
    ms.set_context(mode=mode)
    expected = _functional_with_frozen_in_weights(lambda loss_net, opt: loss_net, style)
    actual = _functional_with_frozen_in_weights(
        lambda loss_net, opt: GradAccumulationCell(loss_net, K, weights=opt.parameters), style)
    assert_params_close(actual, expected, **TOLERANCE)
    initial = _all_params(make_mlp())
    first_moved = max_abs_diff({n: expected[n] for n in FIRST}, {n: initial[n] for n in FIRST}) > 1e-3
    # Graph mode differentiates the frozen layer; PyNative mode does not, unless inside ms.jit.
    assert first_moved == (mode == ms.GRAPH_MODE or style.startswith("jit"))
    if first_moved:
        # Negative control: accumulating only the requires_grad=True weights leaves the frozen layer where it was, a
        # different model from plain training.
        control = _functional_with_frozen_in_weights(
            lambda loss_net, opt: GradAccumulationCell(loss_net, K, weights=[p for p in opt.parameters
                                                                             if p.requires_grad]), style)
        with pytest.raises(AssertionError, match="differs from the reference"):
            assert_params_close(control, expected, **TOLERANCE)


# --- weights=: given, not found ----------------------------------------------------------------------------------

class _Trainer:
    """Holds its grad function as an attribute, used inside an ms.jit step."""

    def __init__(self, loss_net, weights):
        self.grad_fn = ms.value_and_grad(loss_net, None, weights)


def _functional_through_an_attribute(wrap):
    """The functional style, the optimizer over get_parameters() with the first layer frozen (requires_grad=False) yet
    differentiated (graph mode does), the grad function reached through an object's attribute."""
    net = make_mlp()
    _set_first_layer(net, False)
    opt = make_optimizer("momentum", net.get_parameters())
    trainer = _Trainer(wrap(nn.WithLossCell(net, ce()), opt), opt.parameters)

    @ms.jit
    def train_step(x, y):
        return trainer.grad_fn(x, y)

    for x, y in classification_batches(STEPS, BATCH):
        _, grads = train_step(Tensor(x), Tensor(y))
        opt(grads)
    return _all_params(net)


@pytest.mark.slow
def test_trainable_weights_given_are_accumulated_where_discovery_cannot_see_them():
    expected = _functional_through_an_attribute(lambda loss_net, opt: loss_net)
    initial = _all_params(make_mlp())
    assert max_abs_diff({n: expected[n] for n in FIRST}, {n: initial[n] for n in FIRST}) > 1e-3
    actual = _functional_through_an_attribute(
        lambda loss_net, opt: GradAccumulationCell(loss_net, K, weights=opt.parameters))
    assert_params_close(actual, expected, **TOLERANCE)
    # Negative control: the requires_grad=True weights only, and the frozen (but differentiated) first layer gets no
    # accumulated gradient: another model.
    control = _functional_through_an_attribute(
        lambda loss_net, opt: GradAccumulationCell(loss_net, K, weights=[p for p in opt.parameters if p.requires_grad]))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(control, expected, **TOLERANCE)


def test_trainable_weights_given_with_a_frozen_subset_train_like_the_full_batch():
    # An optimizer over the last two layers only, weights= the same: the first layer stays as it was, the others
    # train exactly like the plain full batch.
    def run(wrap):
        net = make_mlp()
        trained = [param for param in net.trainable_params() if param.name not in FIRST]
        opt = make_optimizer("adam", trained)
        train_steps(nn.TrainOneStepCell(wrap(nn.WithLossCell(net, ce()), trained), opt),
                    classification_batches(STEPS, BATCH))
        return _all_params(net)

    expected = run(lambda loss_net, trained: loss_net)
    actual = run(lambda loss_net, trained: GradAccumulationCell(loss_net, K, weights=trained))
    assert_params_close(actual, expected, **TOLERANCE)
    initial = _all_params(make_mlp())
    assert_params_equal({n: actual[n] for n in FIRST}, {n: initial[n] for n in FIRST})
    assert max_abs_diff(actual, initial) > 1e-3


def test_trainable_weights_leaving_out_what_the_optimizer_updates_are_refused():
    net = make_mlp()
    opt = make_optimizer("sgd", net.trainable_params())
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), K, weights=net.trainable_params()[2:])
    x, y = classification_batches(1, BATCH)[0]
    with pytest.raises(ValueError, match=r"the argument 'weights' must hold every weight of the network that the "
                                         r"wrapping optimizer updates, but it leaves out 0\.weight, 0\.bias \(2 in "
                                         r"all\)"):
        nn.TrainOneStepCell(cell, opt)(Tensor(x), Tensor(y))


_OTHER = make_mlp(seed=5)


@pytest.mark.parametrize("weights, error, message", [
    ("all", TypeError, r"the argument 'weights' must be None or a list/tuple of the network's Parameters, e.g. "
                       r"optimizer.parameters, but got 'all' \(str\)"),
    ("one", TypeError, r"the argument 'weights' must be None or a list/tuple .* but got Parameter"),
    ("empty", ValueError, r"the argument 'weights' must be .*, at least one, but got \[\] \(list\)\. With no weight"),
    ("tensor", TypeError, r"every item of the argument 'weights' must be a Parameter of the network, but item 1 is "
                          r"Tensor"),
    ("foreign", ValueError, r"every item of the argument 'weights' must be a Parameter of the network, but item 0, "
                            r"'0\.weight', is not one of WithLossCell's parameters"),
    ("twice", ValueError, r"the argument 'weights' must name each Parameter once, but '0\.weight' \(item 2\) appears "
                          r"twice"),
])
def test_trainable_weights_bad_input_rejected(weights, error, message):
    net = make_mlp()
    params = net.trainable_params()
    given = {"all": "all", "one": params[0], "empty": [], "tensor": [params[0], Tensor(np.zeros(2, np.float32))],
             "foreign": _OTHER.trainable_params()[:1], "twice": [params[0], params[1], params[0]]}[weights]
    with pytest.raises(error, match=message):
        GradAccumulationCell(nn.WithLossCell(net, ce()), K, weights=given)
