"""What the loss contract's re-checks cost, side by side in one process per model.

    python benchmarks/recheck_probe.py                    # mlp and lm2, batch 64, micro_size 4
    python benchmarks/recheck_probe.py --models lm6 --steps 40

``nn.TrainOneStepCell(GradAccumulationCell(loss_net, 4))`` in GRAPH_MODE on the benchmark's MLP and language model
(benchmarks/worker.py). Timed, interleaved in one process after the compile: STEPS steady steps that no check falls on,
and STEPS steps each preceded by the check's eager passes (what a step the schedule names runs: the first two
micro-batches together and each of them, forward only). The extra time of a checked step over a plain one, times the
checks the schedule runs (_contract.check_due: steps 1, 2, 4, ..., RECHECK_EVERY, then every RECHECK_EVERY-th), over
the steps' own time: the cost over a run's first RECHECK_EVERY steps and from then on. Medians; the first step of each
kind is left out.
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


def measure(model: str, batch: int, micro_size: int, steps: int) -> dict:
    import mindspore as ms
    from mindspore import nn, Tensor
    import worker   # pylint: disable=import-outside-toplevel
    from ms_gradaccum import GradAccumulationCell
    from ms_gradaccum.diagnostics.contract import RECHECK_EVERY, check_due

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    loss_net = _loss_net(model)
    cell = GradAccumulationCell(loss_net, micro_size)
    step = nn.TrainOneStepCell(cell, nn.SGD(loss_net.trainable_params(), 0.001))
    x, y = (Tensor(a) for a in worker._data(model, batch))   # pylint: disable=protected-access
    step(x, y).asnumpy()   # compiles, and the first step's check
    contract = cell.engine.contract

    def timed(checked: bool) -> float:
        start = time.perf_counter()
        if checked:
            contract._check_eagerly(cell.engine, (x, y))   # pylint: disable=protected-access
        step(x, y).asnumpy()
        return time.perf_counter() - start

    plain, checked = [], []
    for _ in range(steps + 1):   # interleaved: the machine's load falls on both alike
        plain.append(timed(False))
        checked.append(timed(True))
    plain_s, checked_s = float(np.median(plain[1:])), float(np.median(checked[1:]))
    extra = max(checked_s - plain_s, 0.0)
    first = sum(check_due(n) for n in range(1, RECHECK_EVERY + 1))
    return dict(model=model, step_ms=plain_s * 1e3, checked_step_ms=checked_s * 1e3, check_ms=extra * 1e3,
                checks_first=first, cost_first=first * extra / (RECHECK_EVERY * plain_s),
                cost_after=extra / (RECHECK_EVERY * plain_s), every=RECHECK_EVERY)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "lm2"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    print(f"{'model':6} {'step ms':>8} {'checked':>8} {'check ms':>9} {'check/step':>10} "
          f"{'first N steps':>14} {'after':>8}")
    for model in args.models:
        row = measure(model, args.batch, args.micro_size, args.steps)
        print(f"{row['model']:6} {row['step_ms']:8.2f} {row['checked_step_ms']:8.2f} {row['check_ms']:9.2f} "
              f"{row['check_ms'] / row['step_ms']:9.2f}x {row['cost_first']:13.3%} {row['cost_after']:8.4%}   "
              f"({row['checks_first']} checks in the first {row['every']} steps, then 1 every {row['every']})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
