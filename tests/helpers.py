"""Shared networks, data, reference training and tolerance helpers for the tests."""
import re
from typing import Callable, Dict, List, Sequence

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor
from mindspore.ops import functional as F

Params = Dict[str, np.ndarray]


def number_after(label: str, text: str) -> float:
    """The number printed after `label` in a message (``"ratio 2.0"`` -> 2.0), checked to be readable: at most 4
    significant digits. Messages are read as numbers, never as digit strings: a float32's last printed digit depends
    on the processor (``2.0`` on one machine, ``1.9999999`` on another)."""
    found = re.search(re.escape(label) + r" (-?(?:[0-9]+\.?[0-9]*(?:e[-+]?[0-9]+)?|inf|nan))", text)
    assert found, f"no number after {label!r} in: {text}"
    digits = re.sub(r"e.*$", "", found.group(1)).replace("-", "").replace(".", "").strip("0")
    assert len(digits) <= 4, f"{label} {found.group(1)} is printed to more than 4 significant digits in: {text}"
    return float(found.group(1))


def ce() -> nn.Cell:
    """The tests' mean loss: sparse softmax cross-entropy."""
    return nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def make_mlp(seed: int = 0, in_dim: int = 16, hidden: int = 32, classes: int = 4) -> nn.Cell:
    """A small MLP whose weights depend only on ``seed`` (twins built with the same seed are identical)."""
    net = nn.SequentialCell(nn.Dense(in_dim, hidden), nn.ReLU(), nn.Dense(hidden, hidden), nn.Tanh(),
                            nn.Dense(hidden, classes))
    return _seeded(net, seed)


def make_convnet(seed: int = 0, classes: int = 4) -> nn.Cell:
    """A small conv net for ``(N, 1, 8, 8)`` images: conv, pooling, flatten, dense."""
    net = nn.SequentialCell(
        nn.Conv2d(1, 4, 3, pad_mode="same", has_bias=True), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(4, 8, 3, pad_mode="valid", has_bias=True), nn.ReLU(), nn.Flatten(), nn.Dense(8 * 2 * 2, classes))
    return _seeded(net, seed)


def make_bn_mlp(momentum: float = 0.9, seed: int = 0) -> nn.Cell:
    """A small MLP for ``(N, 5)`` inputs with two BatchNorm1d layers (training mode moves their moving statistics)."""
    return _seeded(nn.SequentialCell(nn.Dense(5, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU(),
                                     nn.Dense(8, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU(),
                                     nn.Dense(8, 3)), seed)


def _seeded(net: nn.Cell, seed: int) -> nn.Cell:
    rng = np.random.RandomState(seed)
    for param in net.trainable_params():
        scale = 1.0 / np.sqrt(max(1, int(np.prod(param.shape[1:]))))
        param.set_data(Tensor(rng.uniform(-scale, scale, param.shape).astype(np.float32)))
    return net


def classification_batches(steps: int, batch: int, in_shape: Sequence[int] = (16,), classes: int = 4,
                           seed: int = 1) -> List[tuple]:
    """``steps`` different batches of (float32 data, int32 labels)."""
    rng = np.random.RandomState(seed)
    return [(rng.randn(batch, *in_shape).astype(np.float32), rng.randint(0, classes, batch).astype(np.int32))
            for _ in range(steps)]


class _Rows:
    """Random-access rows of ``classification_batches`` (GeneratorDataset shards only such sources)."""

    def __init__(self, steps: int, batch: int):
        self.rows = [(x[i], y[i]) for x, y in classification_batches(steps, batch) for i in range(batch)]

    def __getitem__(self, index):
        return np.asarray(self.rows[index][0]), np.asarray(self.rows[index][1])

    def __len__(self):
        return len(self.rows)


def classification_dataset(steps: int, batch: int, num_shards: int = 1, shard_id: int = 0):
    """``classification_batches(steps, batch)`` as a ``mindspore.dataset`` of batches of ``batch // num_shards``
    rows, in order, optionally sharded like a data-parallel rank's input."""
    import mindspore.dataset as ds  # pylint: disable=import-outside-toplevel
    shard = dict(num_shards=num_shards, shard_id=shard_id) if num_shards > 1 else {}
    dataset = ds.GeneratorDataset(_Rows(steps, batch), ["data", "label"], shuffle=False, **shard)
    return dataset.batch(batch // num_shards, drop_remainder=True)


class RecordLoss(ms.train.Callback):
    """Records what Model hands to callbacks as each step's loss (what LossMonitor prints)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_step_end(self, run_context):
        self.losses.append(float(run_context.original_args().net_outputs.asnumpy()))


def params_of(net: nn.Cell) -> Params:
    """Name -> numpy copy of every trainable parameter."""
    return {p.name: p.asnumpy().copy() for p in net.trainable_params()}


def make_optimizer(name: str, params) -> nn.Optimizer:
    """The optimizers the equivalence tests run: plain SGD, Momentum, Adam with weight decay."""
    if name == "sgd":
        return nn.SGD(params, learning_rate=0.1)
    if name == "momentum":
        return nn.Momentum(params, learning_rate=0.05, momentum=0.9)
    if name == "adam":
        return nn.Adam(params, learning_rate=0.01, weight_decay=0.01)
    raise ValueError(f"unknown optimizer {name!r}")


def train_steps(train_step: nn.Cell, batches: Sequence[tuple]) -> List[float]:
    """Run one step per batch; return the losses the step cell returned."""
    return [float(train_step(*(Tensor(a) for a in batch)).asnumpy()) for batch in batches]


def reference_run(make_net: Callable[[], nn.Cell], loss_fn: nn.Cell, optimizer: str,
                  batches: Sequence[tuple]) -> tuple:
    """Full-batch training with a plain ``nn.TrainOneStepCell``: (final params, losses, initial params)."""
    net = make_net()
    initial = params_of(net)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), make_optimizer(optimizer, net.trainable_params()))
    losses = train_steps(step, batches)
    return params_of(net), losses, initial


def assert_params_close(actual: Params, expected: Params, *, rtol: float, atol: float) -> None:
    """Same names, same shapes, then values within tolerance; failures name the parameter."""
    assert sorted(actual) == sorted(expected), f"parameter names differ: {sorted(actual)} vs {sorted(expected)}"
    for name in expected:
        assert actual[name].shape == expected[name].shape, \
            f"{name}: shape {actual[name].shape} != {expected[name].shape}"
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=rtol, atol=atol,
                                   err_msg=f"parameter {name!r} differs from the reference")


def update_ratios(actual: Params, expected: Params, initial: Params) -> Dict[str, float]:
    """Per parameter: the largest difference from the reference, over the largest element of the reference's update."""
    return {name: float(np.abs(actual[name] - expected[name]).max()) /
            max(float(np.abs(expected[name] - initial[name]).max()), 1e-30) for name in expected}


def assert_updates_close(actual: Params, expected: Params, initial: Params, *, fraction: float) -> None:
    """Every parameter within `fraction` of its own full-batch update (for models whose weights differ in scale, where
    one absolute tolerance is either vacuous for some or too tight for others); names first, then values."""
    assert sorted(actual) == sorted(expected) == sorted(initial), "parameter names differ"
    worst = max(update_ratios(actual, expected, initial).items(), key=lambda item: item[1])
    assert worst[1] <= fraction, f"parameter {worst[0]!r} differs from the reference by {worst[1]:.3g} of its update"


def assert_params_equal(actual: Params, expected: Params) -> None:
    """Bit-exact comparison, with the parameter name in the failure message."""
    assert_params_close(actual, expected, rtol=0.0, atol=0.0)


def max_abs_diff(actual: Params, expected: Params) -> float:
    return max(float(np.max(np.abs(actual[name] - expected[name]))) for name in expected)


def assert_params_moved(after: Params, before: Params, *, min_change: float = 1e-4) -> None:
    """Negative control: training must have changed every parameter, so equality is not vacuous."""
    for name in before:
        change = float(np.max(np.abs(after[name] - before[name])))
        assert change > min_change, f"parameter {name!r} did not move (max change {change:g})"


def device_sinks() -> bool:
    """Whether ``dataset_sink_mode=True`` really sinks on this device: GPU and Ascend run ``sink_size`` steps (or the
    dataset) per call and callbacks see one step per sunk epoch; CPU falls back to running and reporting every step."""
    return ms.get_context("device_target") != "CPU"


def set_graph_mode() -> None:
    ms.set_context(mode=ms.GRAPH_MODE)


# --- MindFormers' LLaMA, tiny ----------------------------------------------------------------------------------------

LLAMA_SEQ, LLAMA_VOCAB = 8, 64


def make_llama(per_token: bool = False) -> nn.Cell:
    """A one-layer LLaMA in float32, the same weights every time. CPU has no RmsNorm kernel and no 4-D x 2-D
    BatchMatMul, hence fused_rms_norm=False and use_rope_slice=True; nor lazy_inline, which MindFormers turns on under
    data parallel unless the config (given as config=) disables it. The same model otherwise."""
    from mindformers import LlamaConfig, LlamaForCausalLM   # pylint: disable=import-outside-toplevel
    ms.set_seed(0)
    config = LlamaConfig(batch_size=1, seq_length=LLAMA_SEQ, hidden_size=32, num_layers=1, num_heads=2,
                         vocab_size=LLAMA_VOCAB, pad_token_id=0, compute_dtype="float32",
                         layernorm_compute_type="float32", softmax_compute_type="float32", rotary_dtype="float32",
                         param_init_type="float32", use_flash_attention=False, use_past=False, use_rope_slice=True,
                         fused_rms_norm=False, calculate_per_token_loss=per_token, disable_lazy_inline=True)
    model = LlamaForCausalLM(config=config)
    model.set_train(True)
    return model


# --- a loss whose bprop calls mindspore.ops.zeros_like (MindFormers' loss cells do)
# ------------------------------------

class ZerosLikeFunction(nn.Cell):
    """Log-softmax with its own backward, giving the integer label the gradient ``F.zeros_like(label)``."""

    def construct(self, logits, label):
        return ops.log_softmax(logits, -1), label

    def bprop(self, logits, label, out, dout):
        return dout[0] - ops.softmax(logits, -1) * dout[0].sum(-1, keepdims=True), F.zeros_like(label)


class ZerosLikeLoss(nn.Cell):
    """The tests' mean cross-entropy through ZerosLikeFunction; its weights are named ``net.*``."""

    def __init__(self, net: nn.Cell):
        super().__init__()
        self.net = net
        self.log_softmax = ZerosLikeFunction()

    def construct(self, x, y):
        logp, y = self.log_softmax(self.net(x), y)
        return -(logp * ops.one_hot(y, 4, Tensor(1.0), Tensor(0.0))).sum(-1).mean()


# --- token-normalised losses ---------------------------------------------------------------------------

TOKENS, FEATURES = 6, 8


class TokenLoss(nn.Cell):
    """A per-token classifier whose loss is normalised by the number of valid (mask = 1) tokens.

    ``mode="sum_count"`` returns ``(sum of masked token losses, number of valid tokens)``, the contract of
    GradAccumulationCell for token losses; ``mode="mean"`` returns their ratio (the full-batch reference, and,
    inside an accumulation cell, the mean-of-means bug used as the negative control).
    """

    def __init__(self, net: nn.Cell, mode: str = "sum_count"):
        super().__init__(auto_prefix=False)
        self.net = net
        self.mode = mode
        self.cross_entropy = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="none")

    def construct(self, x, y, mask):
        logits = self.net(x.reshape(-1, x.shape[-1]))
        per_token = self.cross_entropy(logits, y.reshape(-1)) * mask.reshape(-1)
        if self.mode == "mean":
            return per_token.sum() / mask.sum()
        return per_token.sum(), mask.sum()


def make_token_net(seed: int = 0) -> nn.Cell:
    return make_mlp(seed, in_dim=FEATURES)


def token_batches(steps: int, valid_per_sample, seed: int = 3) -> List[tuple]:
    """``steps`` batches of (x, y, mask); sample i has ``valid_per_sample[i]`` valid tokens (uneven counts)."""
    rng = np.random.RandomState(seed)
    batch = len(valid_per_sample)
    mask = np.zeros((batch, TOKENS), np.float32)
    for i, valid in enumerate(valid_per_sample):
        mask[i, :valid] = 1.0
    return [(rng.randn(batch, TOKENS, FEATURES).astype(np.float32),
             rng.randint(0, 4, (batch, TOKENS)).astype(np.int32), mask.copy()) for _ in range(steps)]


# --- mixed precision -------------------------------------------------------------------------------------------

SCALE = 2.0 ** 16   # a loss scale that keeps float16 gradients of SmallLoss from underflowing


class SmallLoss(nn.Cell):
    """Cross-entropy (in float32, as amp's loss wrapper computes it) times 1e-6: float16 gradients underflow."""

    def __init__(self):
        super().__init__()
        self.cross_entropy = ce()

    def construct(self, logits, label):
        return self.cross_entropy(ops.cast(logits, ms.float32), label) * 1e-6


def low_precision_mlp(dtype=ms.float16) -> nn.Cell:
    """helpers.make_mlp computing in `dtype` (float32 weights)."""
    return make_mlp().to_float(dtype)


def moved(after: Params, before: Params) -> int:
    """How many weights changed."""
    return sum(int((after[n] != before[n]).sum()) for n in before)


def _update_agreement(actual: Params, expected: Params, initial: Params) -> tuple:
    """(cosine, norm ratio) of the parameter updates, all parameters flattened together."""
    a = np.concatenate([(actual[n] - initial[n]).ravel() for n in initial]).astype(np.float64)
    e = np.concatenate([(expected[n] - initial[n]).ravel() for n in initial]).astype(np.float64)
    return float(a @ e / np.linalg.norm(a) / np.linalg.norm(e)), float(np.linalg.norm(a) / np.linalg.norm(e))


def assert_same_update(actual: Params, expected: Params, initial: Params) -> None:
    """Float16 training agrees with the full batch up to float16 rounding: nearly every weight moved in both,
    update directions within cosine 0.999 and norms within 1%."""
    total = sum(v.size for v in initial.values())
    assert moved(expected, initial) >= 0.99 * total  # the full batch moves (nearly) every weight
    assert moved(actual, initial) >= 0.98 * total
    cosine, ratio = _update_agreement(actual, expected, initial)
    assert cosine > 0.999 and abs(ratio - 1) < 0.01, (cosine, ratio)


def small_loss_train_cell(net: nn.Cell, network_of: Callable = lambda loss_net: loss_net, accumulate_steps: int = 1,
                          optimizer: str = "sgd", **kwargs) -> nn.Cell:
    """AccumulatingTrainOneStepCell on SmallLoss (SGD with a learning rate that makes its tiny gradients visible)."""
    from ms_gradaccum import AccumulatingTrainOneStepCell  # pylint: disable=import-outside-toplevel
    params = net.trainable_params()
    opt = nn.SGD(params, 1e4) if optimizer == "sgd" else make_optimizer(optimizer, params)
    return AccumulatingTrainOneStepCell(network_of(nn.WithLossCell(net, SmallLoss())), opt, accumulate_steps, **kwargs)


class ClippedStep(nn.TrainOneStepCell):
    """The clipping reference: full-batch gradient, ops.clip_by_global_norm once, then the optimizer."""

    def __init__(self, network, optimizer, max_norm):
        super().__init__(network, optimizer)
        self.max_norm = max_norm

    def construct(self, *inputs):
        loss, grads = ms.value_and_grad(self.network, None, self.weights)(*inputs)
        return ops.depend(loss, self.optimizer(ops.clip_by_global_norm(grads, self.max_norm)))


# --- The zoos' train steps (mindocr, mindone): the MLP trained in windows of batches --------------------------------

def zoo_batches(rows: Sequence[int], seed: int = 0) -> List[tuple]:
    """One ``(x, label)`` NumPy batch of the 16-feature MLP's data per entry of `rows`, of that many rows."""
    rng = np.random.RandomState(seed)
    return [(rng.randn(r, 16).astype(np.float32), rng.randint(0, 4, r).astype(np.int32)) for r in rows]


def window_reference(batches: Sequence[tuple], windows: Sequence[int], optimizer: str = "sgd",
                     make_ema: Callable = None, clip: float = None) -> tuple:
    """``(params, ema)``: plain ``nn.TrainOneStepCell`` (``ClippedStep`` with `clip`) on the MLP, one step on each
    window's rows concatenated (`windows`: batches per window, covering every batch), the EMA ``make_ema(net)``
    updated after each step."""
    net = make_mlp()
    loss_net, opt = nn.WithLossCell(net, ce()), make_optimizer(optimizer, net.trainable_params())
    step = nn.TrainOneStepCell(loss_net, opt) if clip is None else ClippedStep(loss_net, opt, clip)
    ema = make_ema(net) if make_ema is not None else None
    start = 0
    for size in windows:
        step(*(Tensor(np.concatenate([b[i] for b in batches[start:start + size]])) for i in range(2)))
        start += size
        if ema is not None:
            ema.ema_update()
    assert start == len(batches), f"windows {list(windows)} do not cover the {len(batches)} batches"
    return params_of(net), ema


def zoo_step_run(cls, batches: Sequence[tuple], steps: int, optimizer: str = "sgd", make_ema: Callable = None,
                 **kwargs) -> tuple:
    """``(params, ema, step, outputs)``: a zoo's train step `cls` (``cls(loss_net, optimizer, ema=...,
    gradient_accumulation_steps=steps, **kwargs)``) around the MLP, called once per batch."""
    net = make_mlp()
    ema = make_ema(net) if make_ema is not None else None
    step = cls(nn.WithLossCell(net, ce()), make_optimizer(optimizer, net.trainable_params()), ema=ema,
               gradient_accumulation_steps=steps, **kwargs)
    outputs = [step(Tensor(x), Tensor(y)) for x, y in batches]
    return params_of(net), ema, step, outputs
