"""One rank of the 2-process data-parallel tests, started by msrun (see tests/tools/launch.py).

Usage: python dp_worker.py OUT_DIR TASK {data_parallel|stand_alone}, TASK one of the following.
- train: trains the test MLP for 3 steps through ms.Model (dataset sharded with num_shards/shard_id) and
  through a hand-written nn.TrainOneStepCell loop, and with AccumulatingTrainOneStepCell over consecutive
  smaller batches, and saves, per rank, the batches it consumed, the
  losses and the parameters before and after, in OUT_DIR/rank_<r>.npz.
- train_model: the ms.Model path of train only (the stand-alone negative control reads nothing else).
- graphs: compiles one step of plain training, GradAccumulationCell at micro_size 2 and 8, (control)
  a network that all-reduces inside its forward, and AccumulatingTrainOneStepCell with 4 steps per window,
  saving each graph's IR under OUT_DIR/graphs/<name>.
- unseeded: each rank initialises its weights from its own seed (a script without a common seed) and tries one step
  of GradAccumulationCell and one of AccumulatingTrainOneStepCell; each must refuse with the name of the first
  differing parameter, weights unchanged. The errors go to OUT_DIR/rank_<r>.txt.
- unseeded_plain: the same ranks with plain nn.TrainOneStepCell (the negative control): they train on, apart.
- no_init (started without msrun): data parallel without init(); must raise, not crash.
"""
import os
import sys

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import Model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/, for helpers
from helpers import (ce, classification_batches, classification_dataset, make_bn_mlp, make_mlp,  # noqa: E402
                     make_optimizer,
                     make_token_net, params_of, RecordLoss, token_batches, TokenLoss, ZerosLikeLoss)
from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell  # noqa: E402

STEPS, BATCH, MICRO_SIZE = 3, 16, 4  # per-rank batch
CLIP_SCALE, MAX_GRAD_NORM = 1024.0, 0.05
TOKEN_VALID = ([1, 1, 6, 6, 2, 2, 5, 5], [3] * 8)   # per rank: different token counts, uneven micro-batches



def train(out_dir: str, rank: int, group: int, model_only: bool = False) -> None:
    dataset = classification_dataset(STEPS, BATCH * group, num_shards=group, shard_id=rank)
    model_batches = [(x.asnumpy(), y.asnumpy()) for x, y in dataset.create_tuple_iterator(num_epochs=1)]

    net = make_mlp()
    initial = params_of(net)
    record = RecordLoss()
    model = Model(GradAccumulationCell(nn.WithLossCell(net, ce()), MICRO_SIZE),
                  optimizer=make_optimizer("momentum", net.trainable_params()))
    model.train(1, dataset, callbacks=[record], dataset_sink_mode=False)
    arrays = {"model_losses": np.array(record.losses), "model_x": np.stack([x for x, _ in model_batches]),
              "model_y": np.stack([y for _, y in model_batches])}
    for prefix, values in (("initial", initial), ("model_param", params_of(net))):
        arrays.update({f"{prefix}:{name}": value for name, value in values.items()})
    if not model_only:
        arrays.update(_other_paths(rank, group))
    np.savez(os.path.join(out_dir, f"rank_{rank}.npz"), **arrays)


def _other_paths(rank: int, group: int) -> dict:
    """The paths besides Model's, with their batches, losses and trained parameters."""
    # The hand-written loop takes this rank's contiguous slice of each global batch.
    loop_batches = [(x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH])
                    for x, y in classification_batches(STEPS, BATCH * group, seed=7)]
    loop_net = make_mlp()
    step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(loop_net, ce()), MICRO_SIZE),
                               make_optimizer("adam", loop_net.trainable_params()))
    loop_losses = [float(step(Tensor(x), Tensor(y)).asnumpy()) for x, y in loop_batches]

    # A loss whose bprop calls mindspore.ops.zeros_like (MindFormers' pattern), through GradAccumulationCell.
    bprop_net = make_mlp()
    bprop_step = nn.TrainOneStepCell(GradAccumulationCell(ZerosLikeLoss(bprop_net), MICRO_SIZE),
                                     make_optimizer("momentum", bprop_net.trainable_params()))
    bprop_losses = [float(bprop_step(Tensor(x), Tensor(y)).asnumpy()) for x, y in loop_batches]

    # AccumulatingTrainOneStepCell: windows of MICRO_SIZE consecutive per-rank batches of BATCH // MICRO_SIZE.
    small = BATCH // MICRO_SIZE
    steps_batches = [(x[i:i + small], y[i:i + small]) for x, y in loop_batches for i in range(0, BATCH, small)]
    steps_net = make_mlp()
    steps_cell = AccumulatingTrainOneStepCell(nn.WithLossCell(steps_net, ce()),
                                              make_optimizer("momentum", steps_net.trainable_params()), MICRO_SIZE)
    steps_losses = [float(steps_cell(Tensor(x), Tensor(y)).asnumpy()) for x, y in steps_batches]

    # Loss scale and clipping: micro-batches of the loop batches, clipped once per step after the all-reduce.
    clip_net = make_mlp()
    clip_cell = AccumulatingTrainOneStepCell(
        GradAccumulationCell(nn.WithLossCell(clip_net, ce()), MICRO_SIZE),
        make_optimizer("sgd", clip_net.trainable_params()), 1, scale_sense=CLIP_SCALE, max_grad_norm=MAX_GRAD_NORM)
    clip_losses = [float(clip_cell(Tensor(x), Tensor(y))[0].asnumpy()) for x, y in loop_batches]

    # Token losses with different token counts on each rank: GradAccumulationCell and AccumulatingTrainOneStepCell.
    token_data = token_batches(4, TOKEN_VALID[rank], seed=10 + rank)
    token_net = make_token_net()
    token_step = nn.TrainOneStepCell(GradAccumulationCell(TokenLoss(token_net), MICRO_SIZE, per_token_loss=True),
                                     make_optimizer("sgd", token_net.trainable_params()))
    token_losses = [float(token_step(*(Tensor(a) for a in batch)).asnumpy()) for batch in token_data]
    window_net = make_token_net()
    window_cell = AccumulatingTrainOneStepCell(TokenLoss(window_net),
                                               make_optimizer("sgd", window_net.trainable_params()), 2,
                                               per_token_loss=True)
    for batch in token_data:
        window_cell(*(Tensor(a) for a in batch))

    # A token mean the cells recognise (nn.CrossEntropyLoss, told nothing), ranks ignoring different numbers of labels.
    ce_batches = [(x, np.where(np.arange(len(y)) % (2 + rank) == 0, -100, y).astype(np.int32)) for x, y in loop_batches]
    ce_net = make_mlp()
    ce_step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(ce_net, nn.CrossEntropyLoss()), MICRO_SIZE),
                                  make_optimizer("momentum", ce_net.trainable_params()))
    ce_losses = [float(ce_step(Tensor(x), Tensor(y)).asnumpy()) for x, y in ce_batches]

    # BatchNorm in training mode, batch_norm='per_step', against plain data parallel (each rank normalising its own
    # batch) on the same ranks: the moving statistics of each rank (SGD lr 0: the same weights in both).
    bn_rng = np.random.RandomState(20 + rank)
    bn_batches = [(Tensor((bn_rng.randn(BATCH, 5) * 2 + 1 + rank).astype(np.float32)),
                   Tensor(bn_rng.randint(0, 3, BATCH).astype(np.int32))) for _ in range(STEPS)]
    bn_arrays = {}
    for name, wrap in (("bn_plain", lambda loss_net: loss_net),
                       ("bn_accu", lambda loss_net: GradAccumulationCell(loss_net, 3, batch_norm="per_step"))):
        bn_net = make_bn_mlp()
        bn_step = nn.TrainOneStepCell(wrap(nn.WithLossCell(bn_net, ce())), nn.SGD(bn_net.trainable_params(), 0.0))
        bn_step.set_train()
        for x, y in bn_batches:
            bn_step(x, y)
        bn_arrays.update({f"{name}:{p.name}": p.asnumpy() for p in bn_net.get_parameters() if "moving" in p.name})

    arrays = {"loop_losses": np.array(loop_losses), "ce_losses": np.array(ce_losses),
              "steps_losses": np.array(steps_losses), "clip_losses": np.array(clip_losses),
              "bprop_losses": np.array(bprop_losses),
              "token_losses": np.array(token_losses), "window_last_loss": np.array(window_cell.last_window_loss)}
    for name, index in (("x", 0), ("y", 1), ("mask", 2)):
        arrays[f"token_{name}"] = np.stack([batch[index] for batch in token_data])
    for prefix, batches in (("loop", loop_batches), ("steps", steps_batches), ("bprop", loop_batches),
                            ("ce", ce_batches)):
        arrays[f"{prefix}_x"] = np.stack([x for x, _ in batches])
        arrays[f"{prefix}_y"] = np.stack([y for _, y in batches])
    for prefix, values in (("loop_param", params_of(loop_net)), ("steps_param", params_of(steps_net)),
                           ("clip_param", params_of(clip_net)), ("token_param", params_of(token_net)),
                           ("window_param", params_of(window_net)), ("bprop_param", params_of(bprop_net)),
                           ("ce_param", params_of(ce_net))):
        arrays.update({f"{prefix}:{name}": value for name, value in values.items()})
    arrays.update(bn_arrays)
    return arrays


class _AllReduceInForward(nn.Cell):
    """Control: a loss network that communicates inside its forward (so inside the micro-batch loop)."""

    def __init__(self, loss_net):
        super().__init__(auto_prefix=False)
        self.loss_net = loss_net
        self.all_reduce = ops.AllReduce()

    def construct(self, x, y):
        return self.loss_net(self.all_reduce(x), y)


def graphs(out_dir: str) -> None:
    x, y = (Tensor(a) for a in classification_batches(1, BATCH)[0])
    configs = {
        "plain": lambda loss_net: loss_net,
        "micro_2": lambda loss_net: GradAccumulationCell(loss_net, 2),
        "micro_8": lambda loss_net: GradAccumulationCell(loss_net, 8),
        "control_micro_2": lambda loss_net: GradAccumulationCell(_AllReduceInForward(loss_net), 2),
    }
    for name, wrap in configs.items():
        ms.set_context(save_graphs=1, save_graphs_path=os.path.join(out_dir, "graphs", name))
        net = make_mlp()
        step = nn.TrainOneStepCell(wrap(nn.WithLossCell(net, ce())), make_optimizer("sgd", net.trainable_params()))
        step(x, y).asnumpy()
    ms.set_context(save_graphs=1, save_graphs_path=os.path.join(out_dir, "graphs", "steps_4"))
    net = make_mlp()
    step = AccumulatingTrainOneStepCell(nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()), 4)
    step(x, y).asnumpy()


def unseeded(out_dir: str, rank: int, plain: bool) -> None:
    net = make_mlp(seed=100 + rank)   # a different initialisation on every rank
    x, y = (Tensor(a) for a in classification_batches(1, BATCH, seed=rank)[0])
    loss_net = nn.WithLossCell(net, ce())
    if plain:
        step = nn.TrainOneStepCell(loss_net, make_optimizer("sgd", net.trainable_params()))
        for _ in range(STEPS):
            step(x, y)
        np.savez(os.path.join(out_dir, f"rank_{rank}.npz"), **params_of(net))
        return
    failures = []
    for name, step in (("GradAccumulationCell", nn.TrainOneStepCell(GradAccumulationCell(loss_net, MICRO_SIZE),
                                                                     make_optimizer("sgd", net.trainable_params()))),
                       ("AccumulatingTrainOneStepCell", AccumulatingTrainOneStepCell(
                           loss_net, make_optimizer("sgd", net.trainable_params()), 1, micro_size=MICRO_SIZE))):
        before = params_of(net)
        try:
            step(x, y)
        except ValueError as error:
            unchanged = all(np.array_equal(value, before[key]) for key, value in params_of(net).items())
            failures.append(f"{name} raised: {error} (weights unchanged: {unchanged})")
    with open(os.path.join(out_dir, f"rank_{rank}.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(failures))


def main(out_dir: str, task: str, mode: str) -> None:
    ms.set_context(mode=ms.GRAPH_MODE, device_target=os.environ.get("MS_GRADACCUM_DEVICE", "CPU"))
    if task == "no_init":
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
        net = make_mlp()
        step = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(net, ce()), MICRO_SIZE),
                                   make_optimizer("sgd", net.trainable_params()))
        step(*(Tensor(a) for a in classification_batches(1, BATCH)[0]))
        return
    init()
    if mode == "data_parallel":
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    elif mode != "stand_alone":
        raise SystemExit(f"unknown mode {mode!r}")
    if task in ("train", "train_model"):
        train(out_dir, get_rank(), get_group_size(), model_only=task == "train_model")
    elif task == "graphs":
        graphs(out_dir)
    elif task in ("unseeded", "unseeded_plain"):
        unseeded(out_dir, get_rank(), task == "unseeded_plain")
    else:
        raise SystemExit(f"unknown task {task!r}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
