"""mindone's Transformers Trainer on a small PreTrainedModel that runs on CPU (tests/test_mindone.py), in a fresh
process: ``mindone_trainer.py OUT`` writes, per optimizer (sgd, adamw), the final weights, global step and logged
losses of mindone's Trainer at K=1 on batches of 4 rows (full), this package's Trainer at K=2 on batches of 2 (ours)
and mindone's at K=1 on batches of 2 (plain), after trying mindone's at K=2 (prints MINDONE_K2: <error>);
the token-loss runs (full_tokens, ours_tokens; UNDECLARED: <error>); then ZERO3: <error> for this package's Trainer with
ZeRO-3 on."""
import glob
import os
import sys

import numpy as np
import mindspore as ms
from mindspore import nn, ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import ce, make_mlp  # noqa: E402

from transformers import PretrainedConfig  # noqa: E402
from mindone.transformers import PreTrainedModel, Trainer as MindoneTrainer, TrainingArguments  # noqa: E402
from mindone.transformers.mindspore_adapter.data import SequentialSampler  # noqa: E402

from ms_gradaccum.mindone.transformers import Trainer  # noqa: E402

ROWS = 10
# Rows whose labels are ignored in the token runs: micro-batches of 2 rows then count 1, 2, 0, 2, 1, 1 "tokens".
IGNORED = (1, 4, 5)


class TinyConfig(PretrainedConfig):
    model_type = "ms_gradaccum_tiny_mlp"


class TinyClassifier(PreTrainedModel):
    """A mindone.transformers PreTrainedModel of layers that run on CPU: (loss, logits), loss a mean over rows."""
    config_class = TinyConfig
    base_model_prefix = "tiny"

    def __init__(self, config):
        super().__init__(config)
        self.net = make_mlp()
        self.loss = ce()
        self.row_loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="none")
        self.mode = getattr(config, "loss_mode", "rows")

    def construct(self, x, labels):
        logits = self.net(x)
        if self.mode == "rows":
            return self.loss(logits, labels), logits
        # "Tokens": rows labelled -1 are ignored, as a causal LM ignores -100 labels.
        valid = (labels >= 0).astype(ms.float32)
        loss_sum = (self.row_loss(logits, ops.maximum(labels, 0)) * valid).sum()
        count = valid.sum()
        if self.mode == "token_mean":
            return loss_sum / ops.maximum(count, 1.0), logits
        return loss_sum, count, logits   # "token_sum": for per_token_loss=True


class Rows:
    def __init__(self, rows, seed=0, ignored=()):
        rng = np.random.RandomState(seed)
        self.x = rng.randn(rows, 16).astype(np.float32)
        self.y = rng.randint(0, 4, rows).astype(np.int32)
        self.y[list(ignored)] = -1

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index], "labels": self.y[index]}


def collate(features):
    return {key: np.stack([feature[key] for feature in features]) for key in features[0]}


class InOrder:
    """The rows in order (the tests compare against a full batch of known rows)."""

    def _get_train_sampler(self):
        return SequentialSampler(self.train_dataset)


def train(trainer_cls, out, accumulation, batch, optim, save=False, loss_mode="rows", **trainer_kwargs):
    model = TinyClassifier(TinyConfig(loss_mode=loss_mode))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation,
                             num_train_epochs=2, learning_rate=0.05, optim=optim, weight_decay=0.0, logging_steps=1,
                             save_strategy="steps" if save else "no", save_steps=3, save_only_model=True,
                             max_grad_norm=1.0, seed=0, report_to="none")
    rows = Rows(ROWS, ignored=IGNORED if loss_mode != "rows" else ())
    trainer = type("InOrderTrainer", (InOrder, trainer_cls), {})(model=model, args=args, train_dataset=rows,
                                                                  data_collator=collate, **trainer_kwargs)
    initial = {f"initial:{p.name}": p.asnumpy().copy() for p in model.trainable_params()}
    trainer.train()
    result = {f"param:{p.name}": p.asnumpy() for p in model.trainable_params()}
    result.update(initial)
    result["global_step"] = np.asarray(trainer.state.global_step)
    result["logged_loss"] = np.asarray([log["loss"] for log in trainer.state.log_history if "loss" in log])
    result["args_after"] = np.asarray([args.gradient_accumulation_steps, args.per_device_train_batch_size])
    return model, result


def zero3(out):
    """This package's Trainer with ZeRO-3 on: refused at train()."""
    trainer = type("T", (InOrder, Trainer), {})(
        model=TinyClassifier(TinyConfig()), train_dataset=Rows(ROWS), data_collator=collate,
        args=TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               optim="sgd", report_to="none", save_strategy="no", save_only_model=True),
        per_token_loss=False)
    trainer.use_zero3 = True
    try:
        trainer.train()
    except ValueError as error:
        print(f"ZERO3: ValueError {error}", flush=True)


def main(out):
    ms.set_context(mode=ms.GRAPH_MODE)
    # First, in a process where nothing else has compiled yet: mindone's own Trainer at K=2.
    try:
        train(MindoneTrainer, os.path.join(out, "mindone_k2"), 2, 2, "sgd")
        print("MINDONE_K2: trained", flush=True)
    except Exception as error:  # pylint: disable=broad-except  (the control reports whatever mindone raises)
        print(f"MINDONE_K2: {type(error).__name__} {error}", flush=True)
    # Token losses: the full batch's token mean (mindone, K=1), this package with per_token_loss=True and the model
    # returning (loss_sum, count), and this package with the loss kind left undeclared (refused).
    np.savez(os.path.join(out, "full_tokens.npz"), **train(MindoneTrainer, os.path.join(out, "full_tokens"), 1, 4,
                                                            "sgd", loss_mode="token_mean")[1])
    np.savez(os.path.join(out, "ours_tokens.npz"), **train(Trainer, os.path.join(out, "ours_tokens"), 2, 2, "sgd",
                                                            loss_mode="token_sum", per_token_loss=True)[1])
    try:
        np.savez(os.path.join(out, "undeclared_tokens.npz"), **train(Trainer, os.path.join(out, "undeclared"), 2, 2,
                                                                      "sgd", loss_mode="token_mean")[1])
        print("UNDECLARED: trained", flush=True)
    except Exception as error:  # pylint: disable=broad-except
        print(f"UNDECLARED: {type(error).__name__} {error}", flush=True)
    for optim, name in (("sgd", "sgd"), ("adamw_mindspore", "adamw")):
        np.savez(os.path.join(out, f"full_{name}.npz"), **train(MindoneTrainer, os.path.join(out, "full"), 1, 4,
                                                                  optim)[1])
        ours_dir = os.path.join(out, f"ours_{name}")
        model, ours = train(Trainer, ours_dir, 2, 2, optim, save=name == "sgd", per_token_loss=False)
        np.savez(os.path.join(out, f"ours_{name}.npz"), **ours)
        np.savez(os.path.join(out, f"plain_{name}.npz"), **train(MindoneTrainer, os.path.join(out, "plain"), 1, 2,
                                                                   optim)[1])
        if name == "sgd":
            last = sorted(glob.glob(os.path.join(ours_dir, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))
            fresh = TinyClassifier.from_pretrained(last[-1])
            np.savez(os.path.join(out, "ours_sgd_checkpoint.npz"),
                     **{f"param:{p.name}": p.asnumpy() for p in fresh.trainable_params()})
            print("CHECKPOINTS", [os.path.basename(p) for p in last], flush=True)
    zero3(out)


if __name__ == "__main__":
    main(sys.argv[1])
