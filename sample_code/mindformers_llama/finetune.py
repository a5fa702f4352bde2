"""Fine-tune a tiny LLaMA with MindFormers' own Trainer, accumulating with ms_gradaccum (finetune_llama.yaml).

    python sample_code/mindformers_llama/finetune.py [--epochs N] [--output-dir DIR]

The built-in data: 512 sequences of 33 tokens that count up from a random start with a random stride (modulo the
vocabulary), a language a small model learns in two epochs, so the falling loss shows training works. The YAML's
runner_wrapper selects GradAccumulationWrapper: each dataset step of 16 rows runs as 4 micro-batches, and the optimizer
steps once every 2 dataset steps with the update of their 32 rows.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))   # the checkout, for ms_gradaccum


def builtin_rows(count: int, length: int, vocab: int, seed: int = 0) -> list:
    """Counting sequences: token t + 1 = token t + stride (mod vocab - 1, skipping the pad id 0)."""
    rng = np.random.RandomState(seed)
    starts, strides = rng.randint(0, vocab - 1, count), rng.randint(1, 4, count)
    return [(((start + stride * np.arange(length)) % (vocab - 1) + 1).astype(np.int32),)
            for start, stride in zip(starts, strides)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=None, help="override runner_config.epochs")
    parser.add_argument("--output-dir", default=None, help="MindFormers' output folder (logs, checkpoints)")
    args = parser.parse_args(argv)

    import mindspore as ms   # pylint: disable=import-outside-toplevel
    import mindspore.dataset as ds   # pylint: disable=import-outside-toplevel
    from mindformers import (build_context, LlamaConfig, LlamaForCausalLM, MindFormerConfig,  # pylint: disable=C0415
                             Trainer)
    import ms_gradaccum.mindformers  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    config = MindFormerConfig(os.path.join(HERE, "finetune_llama.yaml"))
    if os.environ.get("MS_GRADACCUM_DEVICE"):   # the device of a test run (pytest --device)
        config.context.device_target = os.environ["MS_GRADACCUM_DEVICE"]
    if args.epochs is not None:
        config.runner_config.epochs = args.epochs
    if args.output_dir is not None:
        config.output_dir = args.output_dir
    build_context(config)   # the YAML's context (GRAPH_MODE), applied before the Trainer applies its own
    model_config = {key: value for key, value in config.model.model_config.items() if key != "type"}
    model = LlamaForCausalLM(config=LlamaConfig(**model_config))
    rows = builtin_rows(512, model_config["seq_length"] + 1, model_config["vocab_size"])
    dataset = ds.GeneratorDataset(rows, ["input_ids"], shuffle=True).batch(config.runner_config.batch_size,
                                                                          drop_remainder=True)
    losses = []

    class LastLoss(ms.train.Callback):
        def on_train_step_end(self, run_context):
            losses.append(float(np.mean(run_context.original_args().net_outputs[0].asnumpy())))

    trainer = Trainer(args=config, model=model, train_dataset=dataset, callbacks=[LastLoss()])
    trainer.train()
    wrapper = config.runner_wrapper
    steps = len(losses) // wrapper.accumulate_steps
    mode = "GRAPH_MODE" if ms.get_context("mode") == ms.GRAPH_MODE else "PYNATIVE_MODE"
    print(f"finetune: {len(losses)} dataset steps of {config.runner_config.batch_size} rows in {wrapper.micro_size} "
          f"micro-batches, {steps} optimizer steps of {wrapper.accumulate_steps} dataset steps each, {mode}; "
          f"loss {losses[0]:.4f} -> {np.mean(losses[-4:]):.4f} (mean of the last 4 steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
