"""One benchmark configuration in a fresh process; prints one line ``BENCH {json}`` for benchmarks/run.py.

Usage: python worker.py FRAMEWORK MODEL KIND MICRO_SIZE BATCH STEPS
  FRAMEWORK  mindspore | torch
  MODEL      mlp (activation-heavy) | conv | wide (parameter-heavy: four 1536-wide Dense layers, 27 MB)
             | wide1024 (the same with 1024-wide layers, 12 MB: the tests' size)
             | convbn (a conv net with BatchNorm2d after each of its 4 convolutions of 16 channels, 3x16x16 images:
             batch_norm's cost)
             | lm2, lm6, lm24, lmN (a transformer language model, d_model 128, 4 heads, sequence 64, vocabulary 512,
             with N MindSpore nn.TransformerEncoderLayer layers: what compile time is measured on)
  KIND       plain (nn.TrainOneStepCell on BATCH) | accumulate (GradAccumulationCell, MICRO_SIZE)
             | accumulate_unchecked (the same with check_loss=False: the loss contract check's cost)
             | accumulate_in_graph (the same inside a train cell of one's own, a subclass of nn.TrainOneStepCell,
             which the batch reaches before the package cell: the loss contract read from the compiled step)
             | mindspore (nn.GradAccumulationCell inside nn.TrainOneStepCell) | steps
             (AccumulatingTrainOneStepCell, MICRO_SIZE calls of BATCH / MICRO_SIZE per optimizer step)
             | accumulate_steps (AccumulatingTrainOneStepCell(loss_net, opt, 1, micro_size=MICRO_SIZE))
             | floor (language model only: the least an accumulating step can compile to, not the product; see
             floor_cell)
             | tokens (GradAccumulationCell, MICRO_SIZE, on a network returning (loss_sum, count))
             | accumulate_bn_micro (GradAccumulationCell, MICRO_SIZE, batch_norm='micro': BatchNorm's own update per
             micro-batch, beside accumulate's default 'per_step'; convbn only; both in training mode)
             | plain_o2 | accumulate_o2 (the same in mixed precision: amp O2 float16 compute, float32
             weights, loss scale 2**10 as Model's FixedLossScaleManager applies it)
             torch: plain | accumulate (the standard loop: loss / K, backward per micro-batch, one step)
A "step" is always one optimizer update over BATCH samples. Timings: the graph's compilation (Cell.compile on the
step's inputs: wall seconds compile_s, and the process's CPU seconds compile_cpu_s, MindSpore's own threads included,
steadier than wall on a loaded machine), the first step and the median of STEPS steady steps. Memory: peak RSS, and
its growth over the RSS measured after the framework's import and the data's creation (so it holds compilation,
weights, activations); MindSpore's pool peak is printed by MindSpore itself at exit. It does not hold Parameters, so
the bytes of every Parameter the train cell holds (weights, optimizer state, accumulation buffers) are reported beside
it (param_mb), and the weights' own bytes (weight_mb).
With DATA_PARALLEL=1 (started by msrun), each rank trains data parallel (gradients averaged, every rank on the same
batch). Environment variables reach MindSpore as usual (MS_DEV_RUNTIME_CONF, MS_DEV_SAVE_GRAPHS, ...).
"""
import json
import os
import resource
import sys
import time

import numpy as np

MLP_IN, CLASSES = 64, 10
# The language model: width, heads, sequence length, vocabulary (layers from the model's name).
LM_WIDTH, LM_HEADS, LM_SEQ, LM_VOCAB = 128, 4, 64, 512
# (input width, layer width) of the Dense models
DENSE = {"mlp": (MLP_IN, 512), "wide": (1536, 1536), "wide1024": (1024, 1024)}
MIXED_PRECISION_SCALE = 2.0 ** 10


def _SumAndCount(net):  # pylint: disable=invalid-name
    """``(sum of per-sample losses, number of samples)``: the (loss_sum, count) contract on the same loss."""
    from mindspore import nn, ops
    from mindspore.common import dtype as mstype

    class SumAndCount(nn.Cell):
        def __init__(self):
            super().__init__()
            self.net = net
            self.loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="none")

        def construct(self, x, y):
            per_sample = self.loss_fn(self.net(x), y)
            return per_sample.sum(), ops.cast(ops.size(per_sample), mstype.float32)
    return SumAndCount()


def _Float32Loss(loss_fn):  # pylint: disable=invalid-name
    """The loss on float32 logits, as amp's own loss wrapper computes it under O2."""
    from mindspore import nn, ops
    from mindspore.common import dtype as mstype

    class Float32Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.loss_fn = loss_fn

        def construct(self, logits, label):
            return self.loss_fn(ops.cast(logits, mstype.float32), label)
    return Float32Loss()


def _LanguageModel(layers: int):  # pylint: disable=invalid-name
    """A transformer LM with its token-mean loss: ``(ids, labels) -> loss``, both ``(batch, LM_SEQ)`` int32."""
    import mindspore as ms
    from mindspore import nn

    class LanguageModel(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(LM_VOCAB, LM_WIDTH)
            self.position = ms.Parameter(ms.Tensor(np.random.RandomState(0).randn(1, LM_SEQ, LM_WIDTH).astype(
                np.float32) * 0.02), name="position")
            self.blocks = nn.CellList([nn.TransformerEncoderLayer(LM_WIDTH, LM_HEADS, 4 * LM_WIDTH, dropout=0.0,
                                                                  batch_first=True) for _ in range(layers)])
            self.head = nn.Dense(LM_WIDTH, LM_VOCAB)
            self.loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

        def construct(self, ids, labels):
            hidden = self.embedding(ids) + self.position
            for block in self.blocks:
                hidden = block(hidden)
            logits = self.head(hidden.reshape(-1, LM_WIDTH))
            return self.loss_fn(logits, labels.reshape(-1))
    return LanguageModel()


def floor_cell(net, optimizer, micro_size: int):
    """The least an accumulating step can compile to, a probe that is not the product: a graph-mode while loop over
    the micro-batches running ``value_and_grad`` and adding the gradients into Parameter buffers in place, inside a cell
    whose bprop returns zeros (opaque to the outer gradient), and the package's ``GradientOf`` handing each buffer to
    the optimizer through ``nn.TrainOneStepCell``. No input planning, tallies, loss checks, loss scale, buffer clearing
    or uneven splits: it is exact only for a mean loss on a batch micro_size divides, and only for its first step."""
    import mindspore as ms
    from mindspore import nn, ops, Parameter, ParameterTuple, Tensor
    from ms_gradaccum.cells.grad_accumulation import GradientOf, _hand_over

    weights = ParameterTuple(optimizer.parameters)
    buffers = ParameterTuple([Parameter(ops.zeros_like(w), name="probe." + w.name, requires_grad=False)
                              for w in weights])
    add_into = ops.MultitypeFuncGraph("add_into")

    @add_into.register("Tensor", "Tensor")
    def _add(buffer, grad):
        return ops.assign_add(buffer, grad)

    class Loop(nn.Cell):
        """The micro-batch loop, opaque to the outer gradient; returns the mean loss."""

        def __init__(self):
            super().__init__()
            self.net, self.buffers, self.hyper_map = net, buffers, ops.HyperMap()
            self.zeros_like = ops.ZerosLike()

        def construct(self, ids, labels):
            ids = ids.reshape((micro_size, -1) + ids.shape[1:])
            labels = labels.reshape((micro_size, -1) + labels.shape[1:])
            i, total = Tensor(0, ms.int32), Tensor(0.0, ms.float32)
            while i < micro_size:
                micro = (ops.gather(ids, i, 0), ops.gather(labels, i, 0))
                loss, grads = ms.value_and_grad(self.net, None, weights)(*micro)
                total = total + ops.depend(loss, self.hyper_map(add_into, self.buffers, grads))
                i = i + 1
            return total / micro_size

        def bprop(self, ids, labels, out, dout):
            return self.zeros_like(ids), self.zeros_like(labels)

    class Floor(nn.Cell):
        """Loss from the loop; each weight's gradient is its buffer / micro_size (GradientOf)."""

        def __init__(self):
            super().__init__()
            self.loop, self.buffers, self.gradient_of, self.hyper_map = Loop(), buffers, GradientOf(), ops.HyperMap()

        def construct(self, ids, labels):
            loss = ops.stop_gradient(self.loop(ids, labels))
            divisor = ops.stop_gradient(ops.depend(Tensor(float(micro_size), ms.float32), loss))
            zeros = self.hyper_map(ops.partial(_hand_over, self.gradient_of, divisor), weights, self.buffers)
            return loss + ops.stack(zeros).sum()

    return nn.TrainOneStepCell(Floor(), optimizer)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _data(model: str, batch: int):
    rng = np.random.RandomState(0)
    if model.startswith("lm"):
        ids = rng.randint(0, LM_VOCAB, (batch, LM_SEQ + 1)).astype(np.int32)
        return ids[:, :-1].copy(), ids[:, 1:].copy()
    shape = (batch, DENSE[model][0]) if model in DENSE else (batch, 3, 16, 16) if model == "convbn" else \
        (batch, 1, 28, 28)
    return rng.randn(*shape).astype(np.float32), rng.randint(0, CLASSES, batch).astype(np.int32)


def _time_steps(step, steps: int):
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return first, float(np.median(times))


def mindspore_step(model: str, kind: str, micro_size: int, x, y):
    import mindspore as ms
    from mindspore import nn, Tensor
    from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell

    ms.set_context(mode=ms.GRAPH_MODE)
    if os.environ.get("MS_GRADACCUM_DEVICE"):   # the device of a test run (pytest --device); else MindSpore's default
        ms.set_context(device_target=os.environ["MS_GRADACCUM_DEVICE"])
    if os.environ.get("DATA_PARALLEL") == "1":
        from mindspore.communication import init  # pylint: disable=import-outside-toplevel
        init()
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(0)   # the same initial weights on every rank
    if model.startswith("lm"):
        net = None
    elif model in DENSE:
        inputs, width = DENSE[model]
        net = nn.SequentialCell(nn.Dense(inputs, width), nn.ReLU(), nn.Dense(width, width), nn.ReLU(),
                                nn.Dense(width, width), nn.ReLU(), nn.Dense(width, CLASSES))
    elif model == "convbn":
        layers, channels = [], 3
        for _ in range(4):
            layers += [nn.Conv2d(channels, 16, 3, pad_mode="same"), nn.BatchNorm2d(16), nn.ReLU()]
            channels = 16
        net = nn.SequentialCell(*layers, nn.AvgPool2d(16, 16), nn.Flatten(), nn.Dense(16, CLASSES))
    else:
        net = nn.SequentialCell(nn.Conv2d(1, 16, 3, pad_mode="same"), nn.ReLU(), nn.Conv2d(16, 32, 3, pad_mode="same"),
                                nn.ReLU(), nn.MaxPool2d(2, 2), nn.Flatten(), nn.Dense(32 * 14 * 14, CLASSES))
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    sens = None
    if net is None:   # the language model computes its loss itself
        if kind not in ("plain", "accumulate", "accumulate_unchecked", "accumulate_in_graph", "accumulate_steps",
                        "steps", "floor"):
            raise SystemExit(f"kind {kind!r} is not measured on the language model")
        net = loss_net = _LanguageModel(int(model[2:]))
    else:
        if kind.endswith("_o2"):
            kind, sens = kind[:-len("_o2")], MIXED_PRECISION_SCALE
            net = ms.amp.auto_mixed_precision(net, "O2")
            loss_fn = _Float32Loss(loss_fn)
        loss_net = nn.WithLossCell(net, loss_fn)
    per_token_loss = kind == "tokens"
    if per_token_loss:   # the same loss as a sum and a count: the token path's bookkeeping, nothing else
        kind, loss_net = "accumulate", _SumAndCount(net)
    optimizer = nn.SGD(net.trainable_params(), 0.01, loss_scale=sens or 1.0)
    weight_bytes = sum(p.size * p.itemsize for p in net.trainable_params())
    tx, ty = Tensor(x), Tensor(y)
    if kind == "floor":
        cell = floor_cell(net, optimizer, micro_size)
        step = lambda: cell(tx, ty).asnumpy()  # noqa: E731
        compile_inputs = (tx, ty)
    elif kind == "accumulate_steps":
        cell = AccumulatingTrainOneStepCell(loss_net, optimizer, 1, micro_size=micro_size)
        step = lambda: cell(tx, ty).asnumpy()  # noqa: E731
        compile_inputs = (tx, ty)
    elif kind == "steps":
        cell = AccumulatingTrainOneStepCell(loss_net, optimizer, micro_size)
        rows = len(x) // micro_size
        parts = [(Tensor(x[i * rows:(i + 1) * rows]), Tensor(y[i * rows:(i + 1) * rows])) for i in range(micro_size)]
        step = lambda: [cell(*part) for part in parts][-1].asnumpy()  # noqa: E731
        compile_inputs = parts[0]
    else:
        if kind in ("accumulate", "accumulate_in_graph"):
            loss_net = GradAccumulationCell(loss_net, micro_size, per_token_loss=per_token_loss)
        elif kind == "accumulate_bn_micro":
            loss_net = GradAccumulationCell(loss_net, micro_size, batch_norm="micro")
        elif kind == "accumulate_unchecked":   # without the loss contract's check (its forward copy): what it costs
            loss_net = GradAccumulationCell(loss_net, micro_size, check_loss=False)
        elif kind == "mindspore":
            loss_net = nn.GradAccumulationCell(loss_net, micro_size)
        elif kind != "plain":
            raise SystemExit(f"unknown MindSpore kind {kind!r}")
        train_cell = nn.TrainOneStepCell
        if kind == "accumulate_in_graph":
            class OwnTrainCell(nn.TrainOneStepCell):
                """A train cell of one's own: GradAccumulationCell cannot see its inputs before the graph compiles (a
                subclass may change them); the loss contract is read from the compiled step's graph."""
            train_cell = OwnTrainCell
        cell = train_cell(loss_net, optimizer, sens=sens)
        if model == "convbn":
            cell.set_train()   # BatchNorm on batch statistics, moving its moving ones (as Model.train sets it)
        step = lambda: cell(tx, ty).asnumpy()  # noqa: E731
        compile_inputs = (tx, ty)
    # Cell.compile builds the graph the first call then finds in MindSpore's cache (same cell, same input shapes).
    return step, lambda: cell.compile(*compile_inputs), lambda: _parameter_bytes(cell), weight_bytes


def _parameter_bytes(cell) -> int:
    # Counted after training has run: GradAccumulationCell creates its buffers when its graph compiles (for the
    # weights then trained), so before the first step they would be missing from the count.
    return sum(p.size * p.itemsize for p in cell.get_parameters())


def torch_step(model: str, kind: str, micro_size: int, x, y):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model in DENSE:
        inputs, width = DENSE[model]
        net = nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, CLASSES))
    else:
        net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 14 * 14, CLASSES))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    k = micro_size if kind == "accumulate" else 1
    if kind not in ("plain", "accumulate"):
        raise SystemExit(f"unknown PyTorch kind {kind!r}")
    parts = list(zip(torch.from_numpy(x).chunk(k), torch.from_numpy(y).long().chunk(k)))

    def step():
        optimizer.zero_grad(set_to_none=True)
        for data, label in parts:           # the standard accumulation loop
            loss = loss_fn(net(data), label) / k
            loss.backward()
        optimizer.step()
        return loss.item()
    # PyTorch has no memory pool to add them to: its weights, .grad and optimizer state are all in the RSS.
    weight_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    return step, None, None, weight_bytes


def main(framework: str, model: str, kind: str, micro_size: int, batch: int, steps: int) -> None:
    # The baseline is taken after the framework is imported and the data exists, so growth is training's.
    __import__("mindspore" if framework == "mindspore" else "torch")
    if os.environ.get("BENCH_COMPILE_PROFILE"):
        # MindSpore's compile profile: the time of each phase of its pipeline, printed when a compile ends (read when
        # MindSpore's executor starts: set before any cell exists).
        from mindspore.graph._parse import compile_config  # pylint: disable=import-outside-toplevel
        compile_config.COMPILE_PROFILE = "1"
    x, y = _data(model, batch)
    rss_base = _rss_mb()
    build = mindspore_step if framework == "mindspore" else torch_step
    step, compile_graph, count_parameter_bytes, weight_bytes = build(model, kind, micro_size, x, y)
    compile_s = compile_cpu_s = None
    if compile_graph is not None:
        start, start_cpu = time.perf_counter(), time.process_time()
        compile_graph()
        compile_s, compile_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    first, steady = _time_steps(step, steps)
    parameter_bytes = None if count_parameter_bytes is None else count_parameter_bytes()
    result = dict(framework=framework, model=model, kind=kind, micro_size=micro_size, batch=batch,
                  param_mb=None if parameter_bytes is None else parameter_bytes / 2 ** 20,
                  weight_mb=weight_bytes / 2 ** 20,
                  compile_s=compile_s, compile_cpu_s=compile_cpu_s, first_step_s=first, steady_step_s=steady,
                  samples_per_s=batch / steady,
                  rss_base_mb=rss_base, rss_peak_mb=_rss_mb(), rss_growth_mb=_rss_mb() - rss_base,
                  input_mb=(x.nbytes + y.nbytes) / 2 ** 20)
    print("BENCH " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
