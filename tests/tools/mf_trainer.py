"""MindFormers' own Trainer training the tests' tiny LLaMA through ms_gradaccum's GradAccumulationWrapper, in a fresh
process (MindFormers' build_context sets process-wide context); under msrun, one data-parallel rank.

Usage: python mf_trainer.py OUT_DIR SPEC_JSON, SPEC_JSON holding:
  rows        "plain" (input_ids only) or "ragged" (input_ids and labels: right padding and -100 prompt labels)
  count, seed the rows: how many, from which seed; batch: rows per dataset step (per rank under data parallel)
  keys        the runner_wrapper keys (GradAccumulationWrapper.with_keys); "buffer_prefix": a control that names
              the buffers as MindFormers' CheckpointMonitor leaves them out ("accu_grads")
  per_token   the model's own calculate_per_token_loss; optimizer: "sgd" or "momentum"
  args        further TrainingArguments (save_steps, resume_training, resume_from_checkpoint, ...)
  parallel    true: data parallel over the ranks msrun started (the dataset sharded)
Writes OUT_DIR/result[_rank<N>].npz: the weights ("param:<name>"), what MindFormers' monitors read at each step (loss,
overflow, global norm), the optimizer's step count, the mode trained in, and the batches the Trainer fed this rank
("batch:<step>:<column>", as the callbacks saw them).
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))   # tests/, for helpers

PAD = 0


def token_rows(kind: str, count: int, seed: int) -> list:
    """`count` rows for the LLaMA: (input_ids,) or, for "ragged", (input_ids, labels) right-padded to different
    lengths with their prompts labelled -100."""
    from helpers import LLAMA_SEQ, LLAMA_VOCAB   # pylint: disable=import-outside-toplevel
    rng = np.random.RandomState(seed)
    rows = []
    for index in range(count):
        ids = rng.randint(1, LLAMA_VOCAB, LLAMA_SEQ + 1).astype(np.int32)
        if kind == "plain":
            rows.append((ids,))
            continue
        labels = ids.copy()
        length = LLAMA_SEQ + 1 if index % 4 == 0 else rng.randint(3, LLAMA_SEQ + 2)
        ids[length:] = PAD
        labels[length:] = -100
        labels[:rng.randint(1, 4)] = -100
        rows.append((ids, labels))
    return rows


def columns(kind: str) -> list:
    return ["input_ids"] if kind == "plain" else ["input_ids", "labels"]


def main(out_dir: str, spec: dict) -> None:
    import mindspore as ms   # pylint: disable=import-outside-toplevel
    import mindspore.dataset as ds   # pylint: disable=import-outside-toplevel
    import mindformers   # pylint: disable=import-outside-toplevel
    from mindformers import Trainer, TrainingArguments   # pylint: disable=import-outside-toplevel
    from mindspore.train import Callback   # pylint: disable=import-outside-toplevel
    from helpers import make_llama, make_optimizer, params_of   # pylint: disable=import-outside-toplevel
    from ms_gradaccum.mindformers import GradAccumulationWrapper   # pylint: disable=import-outside-toplevel

    device = os.environ.get("MS_GRADACCUM_DEVICE", "CPU")
    parallel = bool(spec.get("parallel"))
    # MindFormers' Trainer applies its own context (PYNATIVE_MODE unless built first): graph mode is asked for here.
    context = {"context": {"mode": "GRAPH_MODE", "device_target": device}, "parallel": {}}
    if parallel:
        context.update(use_parallel=True, parallel={"parallel_mode": 0, "gradients_mean": True})
    mindformers.build_context(context)
    rank, ranks = 0, 1
    if parallel:
        from mindspore.communication import get_group_size, get_rank   # pylint: disable=import-outside-toplevel
        rank, ranks = get_rank(), get_group_size()

    class Outputs(Callback):
        """What MindFormers' monitors read from the train cell at each step."""

        def __init__(self):
            super().__init__()
            self.losses, self.overflows, self.norms, self.inputs = [], [], [], []

        def on_train_step_end(self, run_context):
            self.inputs.append([a.asnumpy() for a in run_context.original_args().train_dataset_element])
            outputs = run_context.original_args().net_outputs
            self.losses.append(float(np.mean(outputs[0].asnumpy())))
            self.overflows.append(bool(outputs[1].asnumpy()))
            self.norms.append(np.nan if outputs[4] is None else float(outputs[4].asnumpy().reshape(-1)[0]))

    rows = token_rows(spec["rows"], spec["count"], spec.get("seed", 0))
    shard = dict(num_shards=ranks, shard_id=rank) if parallel else {}
    dataset = ds.GeneratorDataset(rows, columns(spec["rows"]), shuffle=False, **shard).batch(spec["batch"])
    model = make_llama(per_token=spec.get("per_token", False))
    optimizer = make_optimizer(spec.get("optimizer", "momentum"), model.trainable_params())
    keys = dict(spec.get("keys", {}))
    wrapper = GradAccumulationWrapper
    if "buffer_prefix" in keys:   # the control: the wrapper's options with another prefix (this process only)
        import dataclasses   # pylint: disable=import-outside-toplevel
        from ms_gradaccum.adapters import mindformers as adapter   # pylint: disable=import-outside-toplevel
        adapter._OPTIONS = dataclasses.replace(adapter._OPTIONS, buffer_prefix=keys.pop("buffer_prefix"))  # pylint: disable=protected-access
    # TrainingArguments clips at 1.0 by default (use_clip_grad=True): off unless a test asks for it.
    args = dict(output_dir=os.path.join(out_dir, "output"), num_train_epochs=1, logging_steps=1, save_steps=1000,
                sink_mode=False, use_parallel=parallel, use_clip_grad=False)
    args.update(spec.get("args", {}))
    outputs = Outputs()
    trainer = Trainer(args=TrainingArguments(wrapper_type=wrapper.with_keys(**keys), **args),
                      model=model, train_dataset=dataset, optimizers=optimizer, callbacks=[outputs])
    trainer.train()
    result = {f"param:{name}": value for name, value in params_of(model).items()}
    result.update(losses=np.array(outputs.losses), overflows=np.array(outputs.overflows),
                  norms=np.array(outputs.norms), steps=int(optimizer.global_step.asnumpy().reshape(-1)[0]),
                  graph_mode=ms.get_context("mode") == ms.GRAPH_MODE)
    for step, batch in enumerate(outputs.inputs):
        for column, values in zip(columns(spec["rows"]), batch):
            result[f"batch:{step}:{column}"] = values
    np.savez(os.path.join(out_dir, f"result_rank{rank}.npz" if parallel else "result.npz"), **result)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
