"""mindcv's train.py flow with the one import changed: a small mindcv VisionTransformer on the built-in digits, K
batches per optimizer step, exact against one batch K times larger.

    python sample_code/mindcv_vit/train.py --gradient-accumulation-steps 4 --batch-size 8
    python sample_code/mindcv_vit/train.py --gradient-accumulation-steps 1 --batch-size 32   # the same run in one batch
    python sample_code/mindcv_vit/train.py --model resnet18 --batch-norm frozen   # a ResNet, its BatchNorm frozen

As mindcv's tools/train.py: create_loss, create_scheduler, create_optimizer, create_trainer, StateMonitor, then
trainer.train; only ``create_scheduler`` and ``create_trainer`` come from ``ms_gradaccum.mindcv``. The digits (8x8,
scikit-learn's, no download) are scaled to 16x16; no shuffle, so the two commands above see the same rows per window.
The last line prints the validation accuracy and a fingerprint of the final weights (equal for the two commands up to
float32 rounding). ``--model resnet18`` trains mindcv's ResNet-18 instead, whose BatchNorm layers take
``--batch-norm`` (``create_trainer``'s ``batch_norm``: ``frozen`` is exact, so the two commands above agree with it too;
``per_step``, the default, and ``micro`` normalise each batch by its own statistics: docs/design.md, "BatchNorm").
"""
import argparse
import os
import sys

import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindcv.loss import create_loss
from mindcv.models import create_model
from mindcv.models.vit import VisionTransformer
from mindcv.optim import create_optimizer
from mindcv.utils import StateMonitor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ms_gradaccum.mindcv import create_scheduler, create_trainer  # noqa: E402  (mindcv's: mindcv.scheduler, mindcv.utils)


def digits(split: str):
    """scikit-learn's digits as (N, 1, 16, 16) float32 in [0, 1] and int32 labels; 80/20 split, fixed seed."""
    from sklearn.datasets import load_digits   # pylint: disable=import-outside-toplevel
    data = load_digits()
    images = np.kron(data.images, np.ones((2, 2)))[:, None].astype(np.float32) / 16.0
    order = np.random.RandomState(0).permutation(len(images))
    cut = int(0.8 * len(images))
    rows = order[:cut] if split == "train" else order[cut:]
    return images[rows], data.target[rows].astype(np.int32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gradient-accumulation-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--train-rows", type=int, default=320, help="rows of the training split used (of 1,437)")
    parser.add_argument("--val-rows", type=int, default=None, help="rows of the validation split used (default: all)")
    parser.add_argument("--ema", action="store_true", help="mindcv's EMA (validated with it when mindcv can)")
    parser.add_argument("--ckpt-save-dir", default=os.path.join("output", "mindcv_vit"))
    parser.add_argument("--model", choices=("vit", "resnet18"), default="vit")
    parser.add_argument("--batch-norm", choices=("per_step", "frozen", "micro"), default=None,
                        help="what the ResNet's BatchNorm layers do under accumulation (create_trainer's batch_norm)")
    args = parser.parse_args(argv)
    for name in ("train_rows", "val_rows"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, but got {getattr(args, name)}")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)

    x, y = digits("train")
    loader_train = ds.NumpySlicesDataset({"image": x[:args.train_rows], "label": y[:args.train_rows]},
                                         shuffle=False).batch(args.batch_size, drop_remainder=False)
    vx, vy = digits("val")
    loader_eval = ds.NumpySlicesDataset({"image": vx[:args.val_rows], "label": vy[:args.val_rows]},
                                        shuffle=False).batch(64)
    num_batches = loader_train.get_dataset_size()

    if args.model == "vit":
        network = VisionTransformer(image_size=16, patch_size=4, in_channels=1, embed_dim=32, depth=2, num_heads=2,
                                    num_classes=10)
    else:
        network = create_model("resnet18", num_classes=10, in_channels=1)
    if args.batch_norm == "frozen" and args.gradient_accumulation_steps == 1:
        # The reference run in one batch, with the same frozen BatchNorm (create_trainer returns mindcv's own Model).
        for _, cell in network.cells_and_names():
            if isinstance(cell, ms.nn.BatchNorm2d):
                cell.use_batch_statistics = False
    loss = create_loss(name="CE", label_smoothing=0.0)
    lr_scheduler = create_scheduler(num_batches, scheduler="cosine_decay", lr=args.lr, min_lr=args.lr / 100,
                                    warmup_epochs=args.warmup_epochs, num_epochs=args.epochs,
                                    gradient_accumulation_steps=args.gradient_accumulation_steps)
    optimizer = create_optimizer(network.trainable_params(), opt="adamw", lr=lr_scheduler, weight_decay=0.05)
    trainer = create_trainer(network, loss, optimizer, {"accuracy"}, "O0", None, "fixed", 1.0, False, args.ema,
                             0.9999, False, 15.0, args.gradient_accumulation_steps,
                             **({} if args.gradient_accumulation_steps == 1 else {"batch_norm": args.batch_norm}))
    state_cb = StateMonitor(trainer, model_name="vit", model_ema=False, dataset_sink_mode=False,
                            dataset_val=loader_eval, metric_name=["accuracy"], ckpt_save_dir=args.ckpt_save_dir,
                            summary_dir=args.ckpt_save_dir, log_interval=max(num_batches // 2, 1))
    trainer.train(args.epochs, loader_train, callbacks=[state_cb], dataset_sink_mode=False)

    accuracy = trainer.eval(loader_eval, dataset_sink_mode=False)["accuracy"]
    weights = np.concatenate([p.asnumpy().ravel() for p in network.trainable_params()])
    print(f"final: accuracy {accuracy:.4f}, weights fingerprint {float(np.abs(weights).sum()):.6f}, optimizer steps "
          f"{int(optimizer.global_step.asnumpy().reshape(-1)[0])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
