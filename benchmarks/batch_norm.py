"""What batch_norm='per_step' costs per step beside 'micro' (the kernel's own update per micro-batch), side by side in
one run.

    python benchmarks/batch_norm.py                 # conv net with 4 BatchNorm2d layers, batch 64, micro_size 4
    python benchmarks/batch_norm.py --steps 40 --repeats 5

A conv net (4 blocks of Conv2d-BatchNorm2d-ReLU, 32 channels, 16x16 images, then a Dense head) in training mode,
``nn.TrainOneStepCell(GradAccumulationCell(loss_net, micro_size, batch_norm=...), Momentum)`` for each choice, both
built and compiled first, then timed in alternation (REPEATS rounds of STEPS steps each, the minimum per round
counted), wall and process CPU seconds. Prints the ratio per_step / micro (the target: at most 1.05x) and the extra
Parameters per_step holds (two C-sized buffers and a count per layer).
"""
import argparse
import time
import warnings

import numpy as np
import mindspore as ms
from mindspore import nn

from ms_gradaccum import GradAccumulationCell


def conv_bn_net(channels: int, blocks: int) -> nn.Cell:
    layers, inputs = [], 3
    for _ in range(blocks):
        layers += [nn.Conv2d(inputs, channels, 3, pad_mode="same"), nn.BatchNorm2d(channels), nn.ReLU()]
        inputs = channels
    return nn.SequentialCell(*layers, nn.AvgPool2d(16, 16), nn.Flatten(), nn.Dense(channels, 10))


def build(choice: str, args) -> tuple:
    ms.set_seed(0)
    net = conv_bn_net(args.channels, args.blocks)
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cell = GradAccumulationCell(nn.WithLossCell(net, loss), args.micro_size, batch_norm=choice)
    step = nn.TrainOneStepCell(cell, nn.Momentum(net.trainable_params(), 0.01, 0.9))
    step.set_train()
    return step, net


def timed(step, x, y, steps: int) -> tuple:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loss = step(x, y)
    float(loss.asnumpy())
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-size", type=int, default=4)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.RandomState(0)
    x = ms.Tensor(rng.randn(args.batch, 3, 16, 16).astype(np.float32))
    y = ms.Tensor(rng.randint(0, 10, args.batch).astype(np.int32))
    choices = ("micro", "per_step")
    steps = {}
    for choice in choices:
        step, _ = build(choice, args)
        timed(step, x, y, 2)   # compiled and warm
        steps[choice] = step
    best = {choice: [float("inf"), float("inf")] for choice in choices}
    for _ in range(args.repeats):
        for choice in choices:
            wall, cpu = timed(steps[choice], x, y, args.steps)
            best[choice] = [min(best[choice][0], wall), min(best[choice][1], cpu)]
    extra = sum(p.size * p.itemsize for p in steps["per_step"].get_parameters()) - \
        sum(p.size * p.itemsize for p in steps["micro"].get_parameters())
    print(f"conv net, {args.blocks} BatchNorm2d layers of {args.channels} channels, batch {args.batch}, micro_size "
          f"{args.micro_size}, {args.steps} steps x {args.repeats} rounds (min per round)")
    for choice in choices:
        print(f"  {choice:8s}  wall {1000 * best[choice][0] / args.steps:8.2f} ms/step   "
              f"cpu {1000 * best[choice][1] / args.steps:8.2f} ms/step")
    print(f"  ratio per_step / micro: wall {best['per_step'][0] / best['micro'][0]:.3f}x, "
          f"cpu {best['per_step'][1] / best['micro'][1]:.3f}x")
    print(f"  Parameters per_step holds beyond micro: {extra} bytes")


if __name__ == "__main__":
    main()
