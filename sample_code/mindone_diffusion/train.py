"""A mindone diffusion training script's shape (mindone's examples/*/train.py: network with its loss, optimizer, loss
scaler, EMA, ``TrainOneStepWrapper``, ``Model`` with ``OverflowMonitor`` and ``EvalSaveCallback``) with one import
changed, on a small noise-prediction network that runs on CPU (mindone's UNet/DiT need kernels MindSpore's CPU build
lacks). ``--check`` also trains the same model on the full batches with plain ``nn.TrainOneStepCell`` and says whether
the weights match.

    python sample_code/mindone_diffusion/train.py --gradient_accumulation_steps 4 --check
"""
import argparse
import math
import os
import sys

import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore import nn, ops, Tensor

from mindone.trainers.callback import EvalSaveCallback, OverflowMonitor
from mindone.trainers.ema import EMA
# from mindone.trainers.train_step import TrainOneStepWrapper      # mindone's: grad / K per batch, last window dropped
from ms_gradaccum.mindone import TrainOneStepWrapper               # the one line changed: exact accumulation


class NoisePrediction(nn.Cell):
    """DDPM's training objective on a small MLP: predict the noise added to x0 at a random timestep (MSE)."""

    def __init__(self, dim=8, hidden=64, timesteps=100):
        super().__init__()
        betas = np.linspace(1e-4, 0.02, timesteps, dtype=np.float32)
        alphas_cumprod = np.cumprod(1.0 - betas)
        self.sqrt_ac = Tensor(np.sqrt(alphas_cumprod).reshape(-1, 1))
        self.sqrt_1m_ac = Tensor(np.sqrt(1.0 - alphas_cumprod).reshape(-1, 1))
        self.time_embed = nn.Embedding(timesteps, hidden)
        self.inp = nn.Dense(dim, hidden)
        self.body = nn.SequentialCell(nn.SiLU(), nn.Dense(hidden, hidden), nn.SiLU(), nn.Dense(hidden, dim))
        self.loss = nn.MSELoss()

    def construct(self, x0, noise, t):
        xt = ops.gather(self.sqrt_ac, t, 0) * x0 + ops.gather(self.sqrt_1m_ac, t, 0) * noise
        return self.loss(self.body(self.inp(xt) + self.time_embed(t)), noise)


def builtin_data(rows, dim=8, timesteps=100, seed=0):
    """Two Gaussian blobs in `dim` dimensions, with the noise and timestep of each row drawn once (so runs compare)."""
    rng = np.random.RandomState(seed)
    centres = rng.randn(2, dim).astype(np.float32) * 2
    x0 = centres[rng.randint(0, 2, rows)] + 0.3 * rng.randn(rows, dim).astype(np.float32)
    return x0.astype(np.float32), rng.randn(rows, dim).astype(np.float32), rng.randint(0, timesteps, rows).astype(
        np.int32)


def build(args):
    ms.set_seed(args.seed)
    network = NoisePrediction()
    optimizer = nn.AdamWeightDecay(network.trainable_params(), learning_rate=args.lr, weight_decay=1e-2)
    return network, optimizer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_path", default="output/mindone_diffusion")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=200, help="200 rows of 8 per batch: 25 batches, a last window of 1")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ema_decay", type=float, default=0.9999)
    parser.add_argument("--clip_grad", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--check", action="store_true", help="also train on the full batches and compare")
    args = parser.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE, device_target=os.environ.get("MS_GRADACCUM_DEVICE", "CPU"))

    columns = builtin_data(args.rows)
    dataset = ds.NumpySlicesDataset(columns, ["x0", "noise", "t"], shuffle=False).batch(args.batch_size)
    steps_per_epoch = dataset.get_dataset_size()
    network, optimizer = build(args)
    ema = EMA(network, ema_decay=args.ema_decay, offloading=False)
    loss_scaler = nn.DynamicLossScaleUpdateCell(loss_scale_value=65536, scale_factor=2, scale_window=1000)
    net_with_grads = TrainOneStepWrapper(network, optimizer, scale_sense=loss_scaler, ema=ema,
                                         drop_overflow_update=True,
                                         gradient_accumulation_steps=args.gradient_accumulation_steps,
                                         clip_grad=args.clip_grad, clip_norm=1.0,
                                         steps_per_epoch=steps_per_epoch)   # closes each epoch's last window
    windows = math.ceil(steps_per_epoch / args.gradient_accumulation_steps)
    print(f"{steps_per_epoch} batches of {args.batch_size} rows an epoch, {windows} optimizer steps "
          f"(gradient_accumulation_steps={args.gradient_accumulation_steps}, the last window of each epoch applied)",
          flush=True)
    callbacks = [OverflowMonitor(), EvalSaveCallback(network=network, ckpt_save_dir=os.path.join(args.output_path,
                                                                                                   "ckpt"),
                                                     output_dir=args.output_path, ema=ema, record_lr=False,
                                                     ckpt_max_keep=2, log_interval=windows)]
    ms.Model(net_with_grads).train(args.epochs, dataset, callbacks=callbacks, dataset_sink_mode=False)
    print(f"optimizer steps: {int(optimizer.global_step.asnumpy().reshape(-1)[0])}, last window's loss "
          f"{net_with_grads.last_window_loss:.6f}", flush=True)
    if args.check:
        check(args, columns, network, steps_per_epoch)


def check(args, columns, network, steps_per_epoch):
    """The same model trained on each window's rows as one batch, with plain nn.TrainOneStepCell."""
    reference, optimizer = build(args)
    step = nn.TrainOneStepCell(reference, optimizer)
    rows = args.gradient_accumulation_steps * args.batch_size
    for _ in range(args.epochs):
        for start in range(0, steps_per_epoch * args.batch_size, rows):
            step(*(Tensor(column[start:start + rows]) for column in columns))
    diff = max(float(np.abs(a.asnumpy() - b.asnumpy()).max())
               for a, b in zip(network.trainable_params(), reference.trainable_params()))
    print(f"largest weight difference from the full batch: {diff:.3g}", flush=True)
    if diff > 1e-5:
        sys.exit("the weights do not match the full batch")
    print("matches the full batch", flush=True)


if __name__ == "__main__":
    main()
