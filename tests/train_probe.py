"""Trains a few steps of an MLP in a fresh process, for a parent test to measure.

Usage: python train_probe.py {plain|accumulate|accumulate_steps|mindspore|steps} MICRO_SIZE BATCH [{mlp|wide}]
- mlp (default): activation-heavy, 64 -> 512 -> 512 -> 512 -> 10; wide: parameter-heavy, three 1024 x 1024
  Dense layers and a 1024 -> 10 one (12 MB of float32 weights).
- plain: nn.TrainOneStepCell on the full batch; accumulate: ms_gradaccum.GradAccumulationCell;
  mindspore: MindSpore's own nn.GradAccumulationCell inside nn.TrainOneStepCell (a Python-unrolled loop);
  steps: ms_gradaccum.AccumulatingTrainOneStepCell with accumulate_steps=MICRO_SIZE, on batches of BATCH
  (one step = MICRO_SIZE calls = one optimizer update); accumulate_steps: GradAccumulationCell inside
  AccumulatingTrainOneStepCell with accumulate_steps=1 (the micro-batch loop, this package's train cell).
- Prints the loss, the first step's time (compilation included) and the median of 5 steady steps, and the
  bytes of every Parameter the train cell holds (weights, optimizer state, accumulation buffers).
- With MS_DEV_RUNTIME_CONF="memory_statistics:True" MindSpore prints "peak used mem:NNNM" at exit.
- With MS_DEV_SAVE_GRAPHS=1 and MS_DEV_SAVE_GRAPHS_PATH=DIR it writes the compiled graphs' IR into DIR.
- With PROBE_DATA_PARALLEL=1, started by msrun, each rank trains data parallel (gradients averaged over the
  ranks, every rank on the same batch) and prints what the stand-alone probe prints.
"""
import os
import sys
import time

import numpy as np
import mindspore as ms
from mindspore import nn, Tensor

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell


def main(kind: str, micro_size: int, batch: int, model: str = "mlp") -> None:
    ms.set_context(mode=ms.GRAPH_MODE)
    if os.environ.get("PROBE_DATA_PARALLEL") == "1":
        from mindspore.communication import init
        init()
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(0)
    rng = np.random.RandomState(0)
    width, inputs = {"mlp": (512, 64), "wide": (1024, 1024)}[model]
    x = Tensor(rng.randn(batch, inputs).astype(np.float32))
    y = Tensor(rng.randint(0, 10, batch).astype(np.int32))
    net = nn.SequentialCell(nn.Dense(inputs, width), nn.ReLU(), nn.Dense(width, width), nn.ReLU(),
                            nn.Dense(width, width), nn.ReLU(), nn.Dense(width, 10))
    loss_net = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))
    if kind in ("accumulate", "accumulate_steps"):
        loss_net = GradAccumulationCell(loss_net, micro_size)
    elif kind == "mindspore":
        loss_net = nn.GradAccumulationCell(loss_net, micro_size)
    elif kind not in ("plain", "steps"):
        raise SystemExit(f"unknown kind {kind!r}: expected 'plain', 'accumulate', 'accumulate_steps', 'mindspore' "
                         f"or 'steps'")
    optimizer = nn.SGD(net.trainable_params(), 0.01)
    if kind == "steps":
        step = AccumulatingTrainOneStepCell(loss_net, optimizer, micro_size)
    elif kind == "accumulate_steps":
        step = AccumulatingTrainOneStepCell(loss_net, optimizer, 1)
    else:
        step = nn.TrainOneStepCell(loss_net, optimizer)
    calls = micro_size if kind == "steps" else 1   # a "step" is one optimizer update: a whole window

    def run():
        return [step(x, y) for _ in range(calls)][-1].asnumpy()

    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    steady_steps = []
    for _ in range(5):
        start = time.perf_counter()
        loss = run()
        steady_steps.append(time.perf_counter() - start)
    steady = sorted(steady_steps)[2]
    # first step = graph compilation + one step; the median of the next 5 is the steady cost.
    print(f"loss {float(loss):.6f} first_step_s {first:.3f} steady_step_s {steady:.3f}", flush=True)
    param_bytes = sum(p.size * p.itemsize for p in step.get_parameters())
    weight_bytes = sum(p.size * p.itemsize for p in net.trainable_params())
    print(f"param_bytes {param_bytes} weight_bytes {weight_bytes}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
