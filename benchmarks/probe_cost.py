"""What the loss contract's first-call probe costs, side by side in one process per model.

    python benchmarks/probe_cost.py                    # mlp and lm2, batch 64, micro_size 4
    python benchmarks/probe_cost.py --models lm6 --steps 20

``nn.TrainOneStepCell(GradAccumulationCell(loss_net, 4))`` in GRAPH_MODE on the benchmark's MLP and language model
(benchmarks/worker.py). Timed in one process: the first call with the probe and with ``check_loss=False`` (each the
probe, where on, then the graph's compile and one step; wall and process CPU seconds), the probe alone on the same batch
(``LossContract.compare_values``, medians of REPEATS), and STEPS steady steps (median). The probe runs once per run
(again in PyNative only when the inputs' layout changes), so its cost over a run's first 1024 steps is its time over
theirs.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def _loss_net(model: str):
    from mindspore import nn
    import worker   # pylint: disable=import-outside-toplevel
    if model.startswith("lm"):
        return worker._LanguageModel(int(model[2:]))   # pylint: disable=protected-access
    inputs, width = worker.DENSE[model]
    net = nn.SequentialCell(nn.Dense(inputs, width), nn.ReLU(), nn.Dense(width, width), nn.ReLU(),
                            nn.Dense(width, width), nn.ReLU(), nn.Dense(width, worker.CLASSES))
    return nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))


def measure(model: str, batch: int, micro_size: int, steps: int, repeats: int) -> dict:
    import mindspore as ms
    from mindspore import nn, Tensor
    import worker   # pylint: disable=import-outside-toplevel
    from ms_gradaccum import GradAccumulationCell

    ms.set_context(mode=ms.GRAPH_MODE)
    row = dict(model=model)
    for check_loss in (False, True):
        ms.set_seed(0)
        loss_net = _loss_net(model)
        cell = GradAccumulationCell(loss_net, micro_size, check_loss=check_loss)
        step = nn.TrainOneStepCell(cell, nn.SGD(loss_net.trainable_params(), 0.001))
        x, y = (Tensor(a) for a in worker._data(model, batch))   # pylint: disable=protected-access
        start, start_cpu = time.perf_counter(), time.process_time()
        step(x, y).asnumpy()   # the probe (where on), the compile, one step
        key = "first_checked" if check_loss else "first"
        row[key], row[key + "_cpu"] = time.perf_counter() - start, time.process_time() - start_cpu
    probe = []
    for _ in range(repeats):
        start = time.perf_counter()
        cell.contract.compare_values(cell.engine, (x, y))
        probe.append(time.perf_counter() - start)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        step(x, y).asnumpy()
        times.append(time.perf_counter() - start)
    row["probe"], row["step"] = float(np.median(probe)), float(np.median(times[1:]))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "lm2"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{'model':6} {'step ms':>8} {'probe ms':>9} {'probe/step':>10} {'/1024 steps':>11} "
          f"{'first call s (off / on, wall)':>30} {'(cpu)':>16}")
    for model in args.models:
        row = measure(model, args.batch, args.micro_size, args.steps, args.repeats)
        print(f"{row['model']:6} {row['step'] * 1e3:8.2f} {row['probe'] * 1e3:9.1f} "
              f"{row['probe'] / row['step']:9.2f}x {row['probe'] / (1024 * row['step']):11.3%} "
              f"{row['first']:14.2f} / {row['first_checked']:6.2f} ({row['first_checked'] / row['first']:.2f}x) "
              f"{row['first_cpu']:6.2f} / {row['first_checked_cpu']:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
