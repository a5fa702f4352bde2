"""Where does the loss contract's check run: eagerly before the step, or inside the graph (its fallback)?

Runs one or two steps of each network the project's issues name, the way a user trains it, and prints per case
whether the eager check ran (``passed``), gave up (``failed``: the network does not run eagerly) or left the pass to
the graph (its ``accu_state.loss_contract_step`` moved). The graph holds the pass only where the eager check has not
run.

    python benchmarks/contract_survey.py            # CPU; MindFormers, mindcv, mindone where installed
"""
import os
import sys
import warnings

import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore import nn, Tensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import ce, classification_batches, make_convnet, make_llama, make_mlp   # noqa: E402

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell   # noqa: E402

K = 4


def where(cell) -> str:
    contract = cell.contract
    graph = int(contract.graph_runs.asnumpy())
    if contract.decided:
        return "eager probe" + (" (and graph)" if graph else "")
    return "graph (first run)" if graph else ("eager failed, graph off" if contract.failed else "not run")


def _classification(net_fn, in_shape=(16,), batch=32):
    net = net_fn()
    batches = [(Tensor(x), Tensor(y)) for x, y in classification_batches(2, batch, in_shape=in_shape)]
    return net, batches


def train_cell(make_net, in_shape=(16,), batch=32, how="TrainOneStepCell"):
    net, batches = _classification(make_net, in_shape, batch)
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    if how == "AccumulatingTrainOneStepCell":
        step = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), opt, 1, micro_size=K)
        cell = step
    else:
        cell = GradAccumulationCell(nn.WithLossCell(net, ce()), K)
        wrapper = {"TrainOneStepCell": nn.TrainOneStepCell, "own train cell": type("Own", (nn.TrainOneStepCell,),
                                                                                    {})}[how]
        step = wrapper(cell, opt)
    for batch_ in batches:
        step(*batch_)
    return where(cell)


def model_train(make_net, sink: bool):
    net, batches = _classification(make_net)
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), K)
    rows = [(x.asnumpy()[i], y.asnumpy()[i]) for x, y in batches for i in range(32)]
    data = ds.GeneratorDataset(lambda: iter(rows), ["x", "y"], shuffle=False).batch(32)
    ms.Model(cell, optimizer=nn.Momentum(net.trainable_params(), 0.01, 0.9)).train(1, data, dataset_sink_mode=sink)
    return where(cell)


def jit_loop(make_net):
    net, batches = _classification(make_net)
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), K)
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    grad_fn = ms.value_and_grad(cell, None, opt.parameters)

    @ms.jit
    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    for batch_ in batches:
        step(*batch_)
    return where(cell)


def llama(how):
    model = make_llama()
    ids = [(Tensor(np.random.RandomState(s).randint(1, 64, (8, 9)).astype(np.int32)),) for s in range(2)]
    opt = nn.SGD(model.trainable_params(), 0.01)
    if how == "AccumulatingTrainOneStepCell":
        step = cell = AccumulatingTrainOneStepCell(model, opt, 1, micro_size=K)
    else:
        cell = GradAccumulationCell(model, K)
        step = nn.TrainOneStepCell(cell, opt)
    for batch_ in ids:
        step(*batch_)
    return where(cell)


def mindcv(name):
    from mindcv.models import create_model   # pylint: disable=import-outside-toplevel
    if name == "vit":
        from mindcv.models.vit import VisionTransformer   # pylint: disable=import-outside-toplevel
        return train_cell(lambda: VisionTransformer(image_size=16, patch_size=8, in_channels=1, embed_dim=32, depth=1,
                                                    num_heads=2, num_classes=4), in_shape=(1, 16, 16), batch=16)
    return train_cell(lambda: create_model("resnet18", num_classes=4, in_channels=1), in_shape=(1, 32, 32), batch=16)


def mindone_step():
    from ms_gradaccum.mindone import TrainOneStepWrapper   # pylint: disable=import-outside-toplevel
    net, batches = _classification(make_mlp)
    step = TrainOneStepWrapper(nn.WithLossCell(net, ce()), nn.Momentum(net.trainable_params(), 0.01, 0.9),
                               micro_size=K)
    for batch_ in batches:
        step(*batch_)
    return where(step)


CASES = [
    ("MLP, nn.TrainOneStepCell(GradAccumulationCell)", lambda: train_cell(make_mlp)),
    ("MLP, AccumulatingTrainOneStepCell", lambda: train_cell(make_mlp, how="AccumulatingTrainOneStepCell")),
    ("convnet, nn.TrainOneStepCell(GradAccumulationCell)", lambda: train_cell(make_convnet, in_shape=(1, 8, 8))),
    ("MLP, Model.train", lambda: model_train(make_mlp, sink=False)),
    ("MLP, Model.train, dataset_sink_mode=True", lambda: model_train(make_mlp, sink=True)),
    ("MLP, a train cell of one's own", lambda: train_cell(make_mlp, how="own train cell")),
    ("MLP, an ms.jit functional step", lambda: jit_loop(make_mlp)),
    ("MindFormers LLaMA, nn.TrainOneStepCell(GradAccumulationCell)", lambda: llama("TrainOneStepCell")),
    ("MindFormers LLaMA, AccumulatingTrainOneStepCell", lambda: llama("AccumulatingTrainOneStepCell")),
    ("mindcv ViT, nn.TrainOneStepCell(GradAccumulationCell)", lambda: mindcv("vit")),
    ("mindcv ResNet-18, nn.TrainOneStepCell(GradAccumulationCell)", lambda: mindcv("resnet")),
    ("mindone TrainOneStepWrapper", mindone_step),
]


def main():
    ms.set_context(mode=ms.GRAPH_MODE)
    warnings.simplefilter("ignore")
    for name, case in CASES:
        try:
            outcome = case()
        except ImportError as error:
            outcome = f"skipped ({error})"
        except Exception as error:  # pylint: disable=broad-except
            outcome = f"error: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
        print(f"{name:70s} {outcome}", flush=True)


if __name__ == "__main__":
    main()
