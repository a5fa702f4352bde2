"""How the cell presents itself to MindSpore in each parallel mode (checked on CPU, where
SEMI_AUTO_PARALLEL/AUTO_PARALLEL cannot compile): routing, markers and the loss/gradient contract."""
import re
import subprocess
import sys

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, Tensor
from mindspore.nn.wrap.cell_wrapper import _TrainGradAccuStepCell
from mindspore.train.amp import _is_grad_accumulation

from mindspore.parallel.auto_parallel import AutoParallel

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from ms_gradaccum._mindspore.parallel import batch_axis_splits
from ms_gradaccum.parallel import parallel_pass as parallel_pass
from helpers import (assert_params_close, assert_params_moved, ce, classification_batches, make_mlp, make_optimizer,
                     params_of, reference_run, train_steps)

K = 4


@pytest.fixture(autouse=True)
def reset_parallel_context():
    yield
    ms.reset_auto_parallel_context()



def _loss_net():
    return nn.WithLossCell(make_mlp(), ce())


def _primitives(cell, prim_name):
    found = []
    for _, sub in cell.cells_and_names():
        for value in list(vars(sub).values()) + list(getattr(sub, "add_list", [])):
            if isinstance(value, ms.ops.Primitive) and value.name == prim_name and value not in found:
                found.append(value)
    return found


@pytest.mark.parametrize("mode", [ms.ParallelMode.SEMI_AUTO_PARALLEL, ms.ParallelMode.AUTO_PARALLEL])
def test_parallel_modes_semi_auto_routes_into_mindspore_accumulation_with_markers(mode):
    ms.set_auto_parallel_context(parallel_mode=mode, enable_parallel_optimizer=True)
    cell = GradAccumulationCell(_loss_net(), K)

    assert _is_grad_accumulation(cell) and cell.cls_name == "GradAccumulationCell"
    slices = _primitives(cell, "StridedSlice")
    assert len(slices) == K and all(p.attrs["grad_accu_num"] == K for p in slices)
    ends = [p.attrs["forward_end"] for p in _primitives(cell, "Add") if "forward_end" in p.attrs]
    assert sorted(ends) == list(range(K))

    model = ms.Model(cell, optimizer=nn.SGD(cell.trainable_params(), 0.1))
    train_network = model._train_network  # pylint: disable=protected-access
    assert type(train_network) is _TrainGradAccuStepCell
    assert train_network.sens == pytest.approx(1.0 / K)  # read from the cell's micro_size
    assert train_network.opt_shard  # the parallel optimizer will shard the accumulation buffers


@pytest.mark.parametrize("mode", [ms.ParallelMode.STAND_ALONE, ms.ParallelMode.DATA_PARALLEL])
def test_parallel_modes_stand_alone_and_data_parallel_are_not_routed(mode):
    ms.set_auto_parallel_context(parallel_mode=mode)
    cell = GradAccumulationCell(_loss_net(), K)
    assert not _is_grad_accumulation(cell) and not cell.parallel_pass
    model = ms.Model(cell, optimizer=nn.SGD(cell.trainable_params(), 0.1))
    assert type(model._train_network) is nn.TrainOneStepCell  # pylint: disable=protected-access
    # The parallel pass's markers are built only where it may run.
    assert not any("parallel_pass_part" in name for name, _ in model._train_network.cells_and_names())  # pylint: disable=protected-access


_STEP_MODULES = """
import sys
import numpy as np
import mindspore as ms
from mindspore import nn, Tensor
from ms_gradaccum import GradAccumulationCell
ms.set_context(mode=ms.GRAPH_MODE)
net = nn.Dense(4, 2)
step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(net, nn.MSELoss()), 2), nn.SGD(net.trainable_params()))
step(Tensor(np.ones((4, 4), np.float32)), Tensor(np.zeros((4, 2), np.float32)))
def loaded():
    return ("ms_gradaccum.parallel.data_parallel" in sys.modules or "ms_gradaccum._mindspore.parallel" in sys.modules,
            "ms_gradaccum.parallel.parallel_pass" in sys.modules)
print("STAND_ALONE", *loaded())
ms.set_auto_parallel_context(parallel_mode=sys.argv[1])
GradAccumulationCell(nn.WithLossCell(nn.Dense(4, 2), nn.MSELoss()), 2)
print("BUILT", *loaded())
"""


@pytest.mark.slow
def test_parallel_modes_a_stand_alone_step_never_loads_the_parallel_pass():
    # The semi-auto hand-over sits behind one door (cells.grad_accumulation._parallel_pass), data parallel's
    # cross-rank parts behind another (cells.grad_accumulation.data_parallel_module): a stand-alone step reads
    # neither. Control: a cell bound (built) in either mode loads its own part, and only that.
    def loaded(mode):
        done = subprocess.run([sys.executable, "-c", _STEP_MODULES, mode], capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("STAND", "BUILT")))
        return lines["STAND_ALONE"], lines["BUILT"]
    assert loaded(ms.ParallelMode.DATA_PARALLEL) == ("False False", "True False")
    stand_alone, built = loaded(ms.ParallelMode.SEMI_AUTO_PARALLEL)   # (its hand-over reads _mindspore.parallel too)
    assert stand_alone == "False False" and built.endswith("True")


def test_parallel_modes_data_parallel_parts_are_built_in_that_mode_only(monkeypatch):
    # A stand-alone step builds no replica check and no token totals. Control: where data parallel is in force (the
    # mode read as the graph would read it), the same cell builds both as its children.
    cell = GradAccumulationCell(_loss_net(), K)
    step = nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), 0.1))
    step(*(Tensor(x) for x in classification_batches(1, 8)[0]))
    assert not cell.data_parallel
    assert not any(name in ("replicas", "token_totals") for name, _ in cell.name_cells().items())
    monkeypatch.setattr(ms, "get_auto_parallel_context", lambda key, real=ms.get_auto_parallel_context: (
        ms.ParallelMode.DATA_PARALLEL if key == "parallel_mode" else real(key)))
    cell.rebind()   # no collective is built before communication is set up: bound for it only once it is
    assert not cell.data_parallel and "replicas" not in cell.name_cells()
    with pytest.raises(RuntimeError, match=r"the parallel mode is data_parallel but mindspore.communication.init\(\) "
                                           r"has not been called"):
        cell.check_data_parallel("GradAccumulationCell")
    from ms_gradaccum.parallel import data_parallel   # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(data_parallel, "communication_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"the graph compiles in data_parallel mode, but the cell was bound in "
                                           r"another mode .* Call cell.rebind\(\) after setting the parallel mode"):
        cell.check_data_parallel("GradAccumulationCell")   # bound before init(), compiled after it without rebind
    cell.rebind()
    assert cell.data_parallel and type(cell.replicas).__name__ == "ReplicaCheck"
    assert type(cell.token_totals).__name__ == "TokenTotals"
    assert {"replicas", "token_totals"} <= set(cell.name_cells())


def test_parallel_modes_mechanism_follows_the_mode_in_force_not_the_one_at_construction():
    # Built under semi-auto, trained stand-alone: the cell's own loop, exactly the full batch (a construction-time
    # choice would have kept the parallel-pass markers, which accumulate nothing outside that pass).
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    net = make_mlp()
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), K)
    assert cell.parallel_pass and _is_grad_accumulation(cell)
    ms.reset_auto_parallel_context()
    assert not cell.parallel_pass and not _is_grad_accumulation(cell)
    batches = classification_batches(3, 32)
    expected, _, initial = reference_run(make_mlp, ce(), "momentum", batches)
    train_steps(nn.TrainOneStepCell(cell, make_optimizer("momentum", net.trainable_params())), batches)
    assert_params_moved(expected, initial)
    assert_params_close(params_of(net), expected, rtol=1e-5, atol=1e-6)


def test_parallel_modes_mode_changed_between_model_and_train_is_refused():
    # Model built under semi-auto (routed to _TrainGradAccuStepCell), then trained stand-alone: its buffers would
    # never be filled. The check that runs when the graph compiles refuses it.
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    cell = GradAccumulationCell(_loss_net(), K)
    model = ms.Model(cell, optimizer=nn.SGD(cell.trainable_params(), 0.1))
    ms.reset_auto_parallel_context()
    with pytest.raises(RuntimeError, match=r"the train cell around it is MindSpore's _TrainGradAccuStepCell, which "
                                           r"Model builds for semi-auto/auto parallel, but the graph compiles in "
                                           r"stand_alone mode"):
        _bound(cell, model._train_network, cell.check_at_compile)  # pylint: disable=protected-access


@pytest.mark.parametrize("parallel_mode, expected", [("semi_auto", "semi_auto_parallel"),
                                                     ("sharding_propagation", "auto_parallel"),
                                                     ("recursive_programming", "auto_parallel")])
@pytest.mark.parametrize("hsdp", [False, True])
def test_parallel_modes_auto_parallel_wrapper_routes_while_model_builds(parallel_mode, expected, hsdp):
    # MindSpore 2.10's AutoParallel sets the parallel context only while Model builds its train cell and while the
    # graph compiles (mindspore/parallel/_utils.py::_init_auto_parallel_context). The cell is built stand-alone,
    # before the wrapper, and must still hand the accumulation to the parallel pass. 8 devices are simulated
    # (AutoParallel reads the group size, 1 on CPU without init(), which would mean stand-alone).
    cell = GradAccumulationCell(_loss_net(), K)
    wrapped = AutoParallel(cell, parallel_mode=parallel_mode)
    if hsdp:
        wrapped.hsdp()
    wrapped._device_num = 8  # pylint: disable=protected-access
    assert not cell.parallel_pass   # outside Model: the global context, stand-alone

    seen = {}
    original = _TrainGradAccuStepCell.__init__

    def record(self, network, optimizer, *args, **kwargs):
        seen["mode"] = ms.get_auto_parallel_context("parallel_mode")
        seen["parallel_pass"] = cell.parallel_pass
        original(self, network, optimizer, *args, **kwargs)

    _TrainGradAccuStepCell.__init__ = record
    try:
        model = ms.Model(wrapped, optimizer=nn.SGD(cell.trainable_params(), 0.1))
    finally:
        _TrainGradAccuStepCell.__init__ = original
    train_network = model._train_network  # pylint: disable=protected-access
    assert type(train_network) is _TrainGradAccuStepCell and seen == {"mode": expected, "parallel_pass": True}
    assert train_network.sens == pytest.approx(1.0 / K)
    assert bool(train_network.opt_shard) == hsdp      # hsdp(): the parallel optimizer shards the buffers
    assert ms.get_auto_parallel_context("parallel_mode") == "stand_alone"   # Model restored the context


def test_parallel_modes_accumulating_cell_refused_under_semi_auto():
    net = make_mlp()
    cell = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), nn.SGD(net.trainable_params(), 0.1), 2)
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    with pytest.raises(RuntimeError, match=r"For 'AccumulatingTrainOneStepCell', semi-auto/auto parallel is not "
                                           r"supported.*Model\(GradAccumulationCell\(loss_net, micro_size\)"):
        cell.check_at_compile()


@pytest.mark.parametrize("kwargs, message", [(dict(per_token_loss=True), "per_token_loss=True is not supported"),
                                             (dict(loss_scale=8.0), "the argument 'loss_scale' must be None")])
def test_parallel_modes_semi_auto_refuses_what_the_pass_cannot_do(kwargs, message):
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    with pytest.raises(ValueError, match=message):
        GradAccumulationCell(_loss_net(), K, **kwargs)
    ms.reset_auto_parallel_context()
    cell = GradAccumulationCell(_loss_net(), K, **kwargs)   # built stand-alone, compiled under semi-auto
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    with pytest.raises(ValueError, match=message):
        _bound(cell, nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), 0.1)), cell.check_at_compile)


def test_parallel_modes_semi_auto_output_is_mean_loss_with_gradient_of_sum():
    # _TrainGradAccuStepCell multiplies the gradient by 1/micro_size, so the parallel-pass part must return the mean
    # loss (for LossMonitor) whose gradient is that of the SUM. Since semi-auto cannot compile on CPU, the part is
    # evaluated stand-alone (the markers are inert there), the cell built under semi-auto.
    cell = _built_under_semi_auto()
    reference = _loss_net()

    x, y = (Tensor(a) for a in classification_batches(1, 32)[0])
    loss, grads = _part_value_and_grad(cell, x, y)
    ref_loss, ref_grads = ms.value_and_grad(reference, None, reference.trainable_params())(x, y)

    np.testing.assert_allclose(loss.asnumpy(), ref_loss.asnumpy(), rtol=1e-6)
    for grad, ref_grad in zip(grads, ref_grads):
        np.testing.assert_allclose(grad.asnumpy() / K, ref_grad.asnumpy(), rtol=1e-5, atol=1e-7)


def _built_under_semi_auto(**kwargs):
    """A GradAccumulationCell built (and so bound, with its parallel-pass part) under semi-auto, the context reset."""
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    cell = GradAccumulationCell(_loss_net(), K, **kwargs)
    ms.reset_auto_parallel_context()
    return cell


def _part_value_and_grad(cell, *inputs):
    """The parallel-pass part's loss and gradients, evaluated stand-alone in PyNative mode. Stand-alone the markers
    are inert, and the graph the part compiles to there is not the one the parallel pass builds on Ascend/GPU; in
    GRAPH_MODE, late in a long test process, MindSpore once failed to infer its backward (CI: "For 'AddN', input shape
    must be same ... (4) ... (8, 4)", not reproduced in the file alone or after the real-model files)."""
    ms.set_context(mode=ms.PYNATIVE_MODE)   # the conftest fixture restores GRAPH_MODE
    return ms.value_and_grad(cell.parallel_pass_part, None, cell.trainable_params())(*inputs)


def _bound(cell, root, lookup):
    """`lookup()` after `cell` is bound from `root`'s tree, as a compile of `root` binds it
    (ms_gradaccum.cells.binding)."""
    assert cell.bind(root)
    return lookup()


def _semi_auto_fixed_scale_model(scale):
    """(cell, the train cell Model builds) under semi-auto with FixedLossScaleManager(scale, False)."""
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    cell = GradAccumulationCell(_loss_net(), K)
    model = ms.Model(cell, optimizer=nn.SGD(cell.trainable_params(), 0.1, loss_scale=scale),
                     loss_scale_manager=ms.FixedLossScaleManager(scale, drop_overflow_update=False))
    return cell, model._train_network  # pylint: disable=protected-access


def test_parallel_modes_semi_auto_fixed_loss_scale_reaches_the_backward():
    # Model builds _TrainGradAccuStepCell(network, optimizer) for FixedLossScaleManager(S, False) under
    # semi-auto: no sens at all, while the optimizer divides by S. The cell must scale its backward by S.
    scale = 2.0 ** 10
    cell, train_network = _semi_auto_fixed_scale_model(scale)
    assert type(train_network) is _TrainGradAccuStepCell and not train_network.sense_flag
    assert _bound(cell, train_network, lambda: cell.parallel_pass_part.left_out_scale) == scale
    # Any other wrapper applies its own scale: nothing is scaled twice.
    plain = nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), 0.1), sens=scale)
    assert _bound(cell, plain, lambda: cell.parallel_pass_part.left_out_scale) == 1.0


def test_parallel_modes_semi_auto_gradient_carries_the_optimizer_loss_scale():
    # Evaluated stand-alone (the markers are inert there), inside a frame that holds the semi-auto wrapper.
    scale = 2.0 ** 10
    cell, wrapper = _semi_auto_fixed_scale_model(scale)
    ms.reset_auto_parallel_context()
    reference = _loss_net()
    x, y = (Tensor(a) for a in classification_batches(1, 32)[0])

    loss, grads = _bound(cell, wrapper, lambda: _part_value_and_grad(cell, x, y))
    ref_loss, ref_grads = ms.value_and_grad(reference, None, reference.trainable_params())(x, y)
    np.testing.assert_allclose(loss.asnumpy(), ref_loss.asnumpy(), rtol=1e-6)
    for grad, ref_grad in zip(grads, ref_grads):   # sum over micro-batches, times the scale
        np.testing.assert_allclose(grad.asnumpy() / K / scale, ref_grad.asnumpy(), rtol=1e-5, atol=1e-7)


def test_parallel_modes_dynamic_loss_scale_wrapper_is_refused_with_the_fix():
    # On Ascend/GPU, Model builds nn.TrainOneStepWithLossScaleCell for a DynamicLossScaleManager; a scale that
    # changes while training cannot reach backward passes that run inside the forward: a clear error.
    cell = GradAccumulationCell(_loss_net(), K)
    opt = nn.SGD(cell.trainable_params(), 0.1)
    dynamic = nn.TrainOneStepWithLossScaleCell(cell, opt, scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 100))
    with pytest.raises(ValueError, match=r"AccumulatingTrainOneStepCell\(loss_net, optimizer, 1, "
                                         r"micro_size=micro_size, "
                                         r"scale_sense=manager.get_update_cell\(\)\)"):
        _bound(cell, dynamic, cell.loss_scale.check)
    fixed = nn.TrainOneStepWithLossScaleCell(cell, opt, scale_sense=nn.FixedLossScaleUpdateCell(2.0 ** 10))
    assert _bound(cell, fixed, lambda: cell.loss_scale.value) == 2.0 ** 10


# --- a batch the parallel pass cannot split into equal micro-batches
# ---------------------------------------------------

def _ragged(rows):
    x, y = classification_batches(1, rows)[0]
    return Tensor(x), Tensor(y)


def test_parallel_modes_ragged_batch_gets_the_package_error_before_mindspore_wrapper():
    # Semi-auto cannot compile on CPU, so the parallel-pass part is compiled stand-alone (one rank): the check runs
    # when its graph compiles, on the same shapes it sees under the pass, before MindSpore's _MicroBatch slices.
    cell = _built_under_semi_auto()
    with pytest.raises(ValueError, match=r"For 'GradAccumulationCell', under stand_alone MindSpore's parallel pass "
                                         r"splits every batch into micro_size=4 micro-batches of equal size, so "
                                         r"micro_size must divide each rank's batch, but input 0 \(shape \(29, 16\)\) "
                                         r"holds 29 rows\. Batch the dataset with drop_remainder=True"):
        ms.value_and_grad(cell.parallel_pass_part, None, cell.trainable_params())(*_ragged(29))
    # A batch micro_size divides passes (the same graph code).
    loss, _ = ms.value_and_grad(cell.parallel_pass_part, None, cell.trainable_params())(*_ragged(28))
    assert np.isfinite(loss.asnumpy())
    # Control: without the check, MindSpore's own wrapper is what refuses, with its internal message.
    with pytest.raises(ValueError, match=r"For micro batch initialization, the 0th dimension shape of input\(29\) "
                                         r"must be divided by micro size\(4\)"):
        ms.value_and_grad(cell.parallel_pass_part.markers, None, cell.trainable_params())(*_ragged(29))


@pytest.mark.parametrize("context, splits", [
    (dict(parallel_mode=ms.ParallelMode.STAND_ALONE), (1,)),
    (dict(parallel_mode=ms.ParallelMode.DATA_PARALLEL, device_num=8), (1,)),
    (dict(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL, device_num=8), (8,)),
    (dict(parallel_mode=ms.ParallelMode.AUTO_PARALLEL, device_num=8, pipeline_stages=2), (4,)),
    (dict(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL, device_num=8, full_batch=True), (1,)),
    (dict(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL, device_num=8, dataset_strategy=((4, 1), (4,))), (4, 4)),
])
def test_parallel_modes_rows_per_rank_follow_how_mindspore_expands_the_inputs(context, splits):
    # Under semi-auto the graph sees every rank's rows together (MindSpore's ToFullShape); each rank slices its own.
    ms.set_auto_parallel_context(**context)
    assert batch_axis_splits() == splits


@pytest.mark.parametrize("shapes, splits, message", [
    (((232, 784), (232,)), (8,), r"input 0 \(shape \(232, 784\)\) holds 29 rows per rank \(232 across 8 ranks\)"),
    (((64, 16), (58,)), (1,), r"input 1 \(shape \(58,\)\) holds 58 rows"),
    (((8, 16), (8,)), (4, 2), r"input 0 \(shape \(8, 16\)\) holds 2 rows per rank \(8 across 4 ranks\)"),
])
def test_parallel_modes_each_rank_batch_must_split_evenly(shapes, splits, message):
    # 232 global rows on 8 ranks: MindSpore's own check passes (4 divides 232), but each rank holds 29 rows.
    check = parallel_pass.check_parallel_pass_batch
    with pytest.raises(ValueError, match=r"under semi_auto_parallel .*" + message + r".*drop_remainder=True"):
        check(shapes, splits, K, "semi_auto_parallel")
    check(((256, 784), (256,)), (8,), K, "semi_auto_parallel")   # 32 rows per rank: 4 micro-batches of 8
    check(((16, 16), (16,)), (4, 1), K, "semi_auto_parallel")   # 4 rows per rank of input 0
    # Inputs the pass cannot slice (the stand-alone loop passes them to every micro-batch).
    for kind, what in (((), "a 0-d Tensor"), (None, "not a Tensor")):
        with pytest.raises(ValueError, match=rf"slices every input along axis 0, but input 1 is {what}"):
            check(((16, 16), kind), (1,), K, "semi_auto_parallel")


class _LabelsNotMinusOne(nn.Cell):
    """``ops.cross_entropy`` leaving out the labels that are -1: a mean over a count taken from the labels."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x, y):
        return ms.ops.cross_entropy(self.net(x), y, ignore_index=-1)


class _Centred(nn.Cell):
    """Statistics over the batch inside the loss: the rows are coupled."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x, y):
        out = self.net(x)
        return ((out - out.mean(0)) ** 2).mean()


@pytest.mark.parametrize("mode", [ms.ParallelMode.SEMI_AUTO_PARALLEL, ms.ParallelMode.AUTO_PARALLEL])
def test_parallel_modes_semi_auto_loss_contract_read_from_the_graph_before_the_compile(mode):
    # Under semi-auto/auto parallel MindSpore's pass weighs each micro-batch 1/micro_size: the loss network's graph is
    # read (stand-alone, the context put back) before the step compiles. A coupled loss and a mean over a count stop
    # with the package's message; a row mean (control) goes on to MindSpore's compile, which on CPU refuses the mode.
    x, y = classification_batches(1, 32)[0]
    for loss, expected in ((_Centred, "couples the rows"),
                           (_LabelsNotMinusOne, r"labels of input 1 that are not -1, as read from the loss network's "
                                                r"graph, but under semi-auto/auto parallel MindSpore's parallel pass"),
                           (lambda net: nn.WithLossCell(net, ce()), None)):
        ms.set_auto_parallel_context(parallel_mode=mode)
        net = make_mlp()
        before = [param.asnumpy() for param in net.get_parameters()]
        cell = GradAccumulationCell(loss(net), K)
        model = ms.Model(cell, optimizer=nn.SGD(cell.trainable_params(), 0.1))
        with pytest.raises((ValueError, RuntimeError)) as raised:
            model._train_network.compile(Tensor(x), Tensor(y))  # pylint: disable=protected-access
        message = str(raised.value)
        if expected is None:
            assert "For 'GradAccumulationCell'" not in message and "semi_auto_parallel/auto_parallel" in message, \
                message
        else:
            assert re.search(expected, message), message
        assert ms.get_auto_parallel_context("parallel_mode") == mode   # the reading put the mode back
        assert all(np.array_equal(param.asnumpy(), value) for param, value in zip(net.get_parameters(), before))


class _ClassScaled(nn.Cell):
    """Logits scaled by one weight per class, 16 classes: with a batch of 16 the weights' axis 0 equals the batch size,
    so they are split like a batched input unless declared shared (and the split rows fail to broadcast)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Dense(16, 16)
        self.ce = ce()

    def construct(self, x, class_weights, y):
        return self.ce(self.net(x) * class_weights, y)


def test_parallel_modes_semi_auto_network_error_on_split_rows_gets_the_shared_inputs_advice():
    # The loss network's error on micro-batch rows is examined stand-alone under semi-auto parallel too, and the
    # advice is what holds there: the input that, given whole, runs is named, but shared_inputs (which the parallel
    # pass cannot take) is not offered. Control: stand-alone, the same error offers shared_inputs=(1,).
    rng = np.random.default_rng(0)
    inputs = (Tensor(rng.standard_normal((16, 16)).astype(np.float32)),
              Tensor(np.linspace(0.5, 1.5, 16).astype(np.float32)), Tensor(rng.integers(0, 16, 16).astype(np.int32)))
    named = r"input 1 \('class_weights'\) makes the loss combine"
    for mode in (ms.ParallelMode.SEMI_AUTO_PARALLEL, ms.ParallelMode.STAND_ALONE):
        ms.set_auto_parallel_context(parallel_mode=mode)
        cell = GradAccumulationCell(_ClassScaled(), K)
        model = ms.Model(cell, optimizer=nn.SGD(cell.trainable_params(), 0.1))
        with pytest.raises(ValueError) as raised:
            model._train_network.compile(*inputs)  # pylint: disable=protected-access
        message = str(raised.value).split("C++ Call Stack")[0]
        assert re.search(named, message), message
        offered = "declare it (e.g. shared_inputs=(1,))" in message
        refused = "no micro-batch can get it whole under semi-auto/auto parallel" in message
        assert (offered, refused) == ((False, True) if mode != ms.ParallelMode.STAND_ALONE else (True, False)), message
        assert ms.get_auto_parallel_context("parallel_mode") == mode
