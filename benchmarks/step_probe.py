"""The steady step of GradAccumulationCell against the plain steps it replaces, side by side in one process.

    python benchmarks/step_probe.py                       # widths 16 and 1024, K=4, batch 64
    python benchmarks/step_probe.py --widths 16 --steps 400

An MLP (3 hidden layers of `width`, 10 classes), GRAPH_MODE, SGD. Measured alternately, in rounds, after a warm-up:
``nn.TrainOneStepCell(GradAccumulationCell(loss_net, K))`` on the batch, and K plain ``nn.TrainOneStepCell`` steps on
a micro-batch each (the work accumulation does, without its loop). Printed: the median round of each and their ratio.
At a small width the loop's fixed cost per step shows; at a large one the ratio tends to 1.
"""
import argparse
import statistics
import time

import numpy as np
import mindspore as ms
from mindspore import nn, Tensor

from ms_gradaccum import GradAccumulationCell


def _mlp(width: int, inputs: int = 64, classes: int = 10) -> nn.Cell:
    ms.set_seed(0)
    return nn.SequentialCell(nn.Dense(inputs, width), nn.ReLU(), nn.Dense(width, width), nn.ReLU(),
                             nn.Dense(width, width), nn.ReLU(), nn.Dense(width, classes))


def _timed(call, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        out = call()
    out.asnumpy()
    return (time.perf_counter() - start) / repeats


def measure(width: int, micro_size: int, batch: int, steps: int, rounds: int) -> tuple:
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((batch, 64)).astype(np.float32))
    y = Tensor(rng.integers(0, 10, batch).astype(np.int32))
    rows = batch // micro_size
    micro = [(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]) for i in range(micro_size)]
    net = _mlp(width)
    accumulated = nn.TrainOneStepCell(GradAccumulationCell(nn.WithLossCell(net, nn.CrossEntropyLoss()), micro_size),
                                      nn.SGD(net.trainable_params(), 1e-4))
    plain_net = _mlp(width)
    plain = nn.TrainOneStepCell(nn.WithLossCell(plain_net, nn.CrossEntropyLoss()),
                                nn.SGD(plain_net.trainable_params(), 1e-4))

    def plain_steps():
        for part in micro:
            out = plain(*part)
        return out

    _timed(lambda: accumulated(x, y), 20)   # compile, the loss check's first steps, warm-up
    _timed(plain_steps, 20)
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(_timed(lambda: accumulated(x, y), steps))
        theirs.append(_timed(plain_steps, steps))
    return statistics.median(ours), statistics.median(theirs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 1024])
    parser.add_argument("--micro-size", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE)
    for width in args.widths:
        ours, theirs = measure(width, args.micro_size, args.batch, args.steps, args.rounds)
        print(f"width {width:5d}: GradAccumulationCell K={args.micro_size} {ours * 1e3:7.3f} ms a step, "
              f"{args.micro_size} plain micro-batch steps {theirs * 1e3:7.3f} ms: {ours / theirs:.2f}x", flush=True)


if __name__ == "__main__":
    main()
