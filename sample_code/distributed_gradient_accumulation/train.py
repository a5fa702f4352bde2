"""Gradient accumulation on MNIST-format data: the MindSpore distributed tutorial's job, accumulating.

The tutorial's shape: ``ds.MnistDataset(DATA_PATH)`` with Rescale/Normalize/HWC2CHW, the 784-512-512-10
Dense/ReLU network, SGD 1e-2, CrossEntropyLoss, ``LossMonitor(100)`` and ``Model.train(10, ...)``, with
``GradAccumulationCell(nn.WithLossCell(net, loss_fn), 4)`` as the training network.

Runs stand-alone (``python train.py``) or as one rank of a job started by ``run.sh`` (msrun or mpirun),
where each rank reads its own shard of the data. Without ``DATA_PATH`` it uses the built-in handwritten
digits (see builtin_digits.py), written once to a cache directory and read through ``ds.MnistDataset``.
"""
import argparse
import os
import sys

import mindspore as ms
import mindspore.dataset as ds
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init
from mindspore.dataset import transforms, vision
from mindspore.train import LossMonitor, Model

from ms_gradaccum import GradAccumulationCell

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from builtin_digits import ensure_digits_mnist  # noqa: E402  (sits next to this script)

PARALLEL_MODES = {
    "stand_alone": ms.ParallelMode.STAND_ALONE,
    "data_parallel": ms.ParallelMode.DATA_PARALLEL,
    "semi_auto_parallel": ms.ParallelMode.SEMI_AUTO_PARALLEL,
    "auto_parallel": ms.ParallelMode.AUTO_PARALLEL,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (split into micro-batches)")
    parser.add_argument("--micro-size", type=int, default=4, help="NUMBER of micro-batches per batch")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--device-target", default="CPU", choices=["CPU", "GPU", "Ascend"])
    parser.add_argument("--parallel-mode", default="auto", choices=["auto", *PARALLEL_MODES],
                        help="auto: stand_alone for one process; data_parallel on CPU and "
                             "semi_auto_parallel (with the parallel optimizer) on GPU/Ascend for several")
    parser.add_argument("--loss-every", type=int, default=100, help="LossMonitor's per_print_times")
    parser.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    parser.add_argument("--data-path", default=os.environ.get("DATA_PATH", ""),
                        help="MNIST folder in idx format (default: $DATA_PATH, else the built-in digits)")
    return parser.parse_args(argv)


def launched_ranks() -> int:
    """How many ranks the launcher started (msrun and run.sh's mpirun both set MS_WORKER_NUM)."""
    return int(os.environ.get("MS_WORKER_NUM", "1"))


def resolve_parallel_mode(requested: str, device_target: str, ranks: int) -> str:
    if requested != "auto":
        return requested
    if ranks == 1:
        return "stand_alone"
    return "data_parallel" if device_target == "CPU" else "semi_auto_parallel"


def setup_parallel(mode: str) -> tuple:
    """Initialise communication for a parallel mode; return (rank, group size)."""
    if mode == "stand_alone":
        return 0, 1
    init()
    context = dict(parallel_mode=PARALLEL_MODES[mode], gradients_mean=True)
    if mode in ("semi_auto_parallel", "auto_parallel"):
        context["enable_parallel_optimizer"] = True
    ms.set_auto_parallel_context(**context)
    return get_rank(), get_group_size()


def create_dataset(path: str, usage: str, batch_size: int, rank: int, group: int, training: bool) -> ds.Dataset:
    shard = dict(num_shards=group, shard_id=rank) if group > 1 else {}
    dataset = ds.MnistDataset(path, usage=usage, shuffle=training, **shard)
    image_ops = [vision.Rescale(1.0 / 255.0, 0.0), vision.Normalize(mean=(0.1307,), std=(0.3081,)),
                 vision.HWC2CHW()]
    dataset = dataset.map(image_ops, "image").map(transforms.TypeCast(ms.int32), "label")
    # Training drops the last partial batch (GradAccumulationCell refuses a batch that micro_size does not
    # divide, rather than drop rows itself); evaluation keeps every image.
    return dataset.batch(batch_size, drop_remainder=training)


class Network(nn.Cell):
    """The tutorial's 784-512-512-10 MLP."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.layers = nn.SequentialCell(nn.Dense(28 * 28, 512), nn.ReLU(), nn.Dense(512, 512), nn.ReLU(),
                                        nn.Dense(512, 10))

    def construct(self, x):
        return self.layers(self.flatten(x))


class _LastLoss(ms.train.Callback):
    def __init__(self):
        super().__init__()
        self.loss = float("nan")

    def on_train_step_end(self, run_context):
        self.loss = float(run_context.original_args().net_outputs.asnumpy())


def accuracy(net: nn.Cell, dataset: ds.Dataset) -> tuple:
    correct = total = 0
    for image, label in dataset.create_tuple_iterator(num_epochs=1):
        predicted = net(image).asnumpy().argmax(axis=1)
        correct += int((predicted == label.asnumpy()).sum())
        total += len(predicted)
    return correct / max(total, 1), total


def main(argv=None) -> int:
    args = parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE, device_target=args.device_target)
    ms.set_seed(1)
    mode = resolve_parallel_mode(args.parallel_mode, args.device_target, launched_ranks())
    rank, group = setup_parallel(mode)
    data_path = args.data_path or ensure_digits_mnist()

    train_set = create_dataset(data_path, "train", args.batch_size, rank, group, training=True)
    if args.max_steps:
        train_set = train_set.take(args.max_steps)
    net = Network()
    loss_fn = nn.CrossEntropyLoss()
    optimizer = nn.SGD(net.trainable_params(), args.lr)
    model = Model(GradAccumulationCell(nn.WithLossCell(net, loss_fn), args.micro_size), optimizer=optimizer)
    last = _LastLoss()
    print(f"[rank {rank}] mode {mode}, {group} rank(s), data {data_path}, {train_set.get_dataset_size()} steps "
          f"per epoch of batch {args.batch_size} = {args.micro_size} micro-batches of "
          f"{args.batch_size // max(args.micro_size, 1)}", flush=True)
    model.train(args.epochs, train_set, callbacks=[LossMonitor(args.loss_every), last], dataset_sink_mode=False)

    test_acc, test_images = accuracy(net, create_dataset(data_path, "test", 100, 0, 1, training=False))
    print(f"[rank {rank}] final loss {last.loss:.6f} test accuracy {test_acc:.4f} ({test_images} images)",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
