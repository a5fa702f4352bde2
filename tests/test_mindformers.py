"""MindFormers' own Trainer with ms_gradaccum.adapters.mindformers.GradAccumulationWrapper, on a tiny LLaMA on CPU,
against the plain full batch: micro-batches, windows of several dataset steps, the token route on ragged rows, a
dynamic loss scale with a binding clip, a resume from the Trainer's own checkpoint taken mid-window, data parallel on
2 ranks; every key MindFormers passes, checked. Each Trainer runs in a fresh process (tests/tools/mf_trainer.py):
MindFormers sets process-wide context. Skipped, saying why, without MindFormers."""
import json
import os
import subprocess
import sys

import numpy as np
import mindspore as ms
import pytest
import ms_gradaccum
from mindspore import nn, ops, Tensor

from helpers import (assert_params_equal, assert_params_moved, assert_updates_close, make_llama, make_optimizer,
                     params_of, update_ratios)
from launch import import_without, msrun, REPO, repo_env, require_ranks

pytest.importorskip("mindformers", reason="MindFormers is not installed (.ci/run installs 2.1.0)")
from mindformers.core.clip_grad import ClipGradNorm  # noqa: E402
from mindformers.tools.register import MindFormerConfig  # noqa: E402
from mindformers.wrapper.adaptive_loss_scale import AdaptiveLossScaleUpdateCell  # noqa: E402

from ms_gradaccum.mindformers import check_trainer_config, GradAccumulationWrapper  # noqa: E402
from mf_trainer import token_rows  # noqa: E402

pytestmark = pytest.mark.realmodels

TOOL = os.path.join(REPO, "tests", "tools", "mf_trainer.py")
FRACTION = 1e-3   # of each parameter's own update, as in test_real_models (float32 summation order)


def run_trainer(out, **spec) -> dict:
    """Train through MindFormers' Trainer in a fresh process; what tests/tools/mf_trainer.py writes."""
    os.makedirs(out, exist_ok=True)
    done = subprocess.run([sys.executable, TOOL, str(out), json.dumps(spec)], env=repo_env(GLOG_v="3"),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(np.load(os.path.join(out, "result.npz")))


def weights(result: dict) -> dict:
    return {key.split(":", 1)[1]: value for key, value in result.items() if key.startswith("param:")}


def dataset_batches(result: dict) -> list:
    """The batches the Trainer fed the train cell, in order, as (input_ids[, labels])."""
    steps = sorted({int(key.split(":")[1]) for key in result if key.startswith("batch:")})
    return [tuple(result[f"batch:{step}:{column}"] for column in ("input_ids", "labels")
                  if f"batch:{step}:{column}" in result) for step in steps]


def joined(batches: list, window: int) -> list:
    """Consecutive `window` batches as one (the full batch of a window of dataset steps)."""
    return [tuple(np.concatenate(parts) for parts in zip(*batches[start:start + window]))
            for start in range(0, len(batches), window)]


class FullBatchStep(nn.Cell):
    """The plain full batch, as MFTrainOneStepCell trains it in float32: the gradient, MindFormers' ClipGradNorm when
    `max_grad_norm` is set, the optimizer. Returns (loss, global norm)."""

    def __init__(self, model, optimizer, max_grad_norm=None):
        super().__init__(auto_prefix=False)
        self.model, self.optimizer, self.weights = model, optimizer, optimizer.parameters
        self.clip = max_grad_norm is not None
        self.clip_grad_norm = ClipGradNorm(max_norm=max_grad_norm or 1.0)
        self.grad = ops.GradOperation(get_by_list=True)   # as nn.TrainOneStepCell (the model has defaulted inputs)

    def construct(self, *inputs):
        loss = self.model(*inputs)
        grads = self.grad(self.model, self.weights)(*inputs)
        norm = ops.zeros((1,), ms.float32)
        if self.clip:
            grads, norm = self.clip_grad_norm(grads)
        return ops.depend(loss, self.optimizer(grads)), norm


def reference(batches, optimizer="momentum", max_grad_norm=None):
    """(weights, initial weights, losses, global norms) of the plain full batch."""
    model = make_llama()
    initial = params_of(model)
    step = FullBatchStep(model, make_optimizer(optimizer, model.trainable_params()), max_grad_norm)
    outputs = [step(*(Tensor(a) for a in batch)) for batch in batches]
    return (params_of(model), initial, [float(loss.asnumpy().reshape(-1)[0]) for loss, _ in outputs],
            [float(norm.asnumpy().reshape(-1)[0]) for _, norm in outputs])


@pytest.mark.slow
def test_mindformers_trainer_micro_batches_train_like_the_full_batch(tmp_path):
    result = run_trainer(tmp_path / "trainer", rows="plain", count=24, batch=8, keys={"micro_size": 4})
    expected, initial, losses, _ = reference(dataset_batches(result))
    assert bool(result["graph_mode"]) and int(result["steps"]) == 3
    assert_params_moved(expected, initial, min_change=1e-6)
    assert_updates_close(weights(result), expected, initial, fraction=FRACTION)
    # What MindFormers' loss monitor prints: the full batch's loss.
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    # Negative control: training on one micro-batch of each batch.
    control, _, _, _ = reference([(ids[:2],) for (ids,) in dataset_batches(result)])
    with pytest.raises(AssertionError, match="differs from the reference by"):
        assert_updates_close(weights(result), control, initial, fraction=FRACTION)


# 6 dataset steps of 4 rows, 2 micro-batches each, an optimizer step every 3: two full batches of 12 rows.
WINDOWS = dict(rows="plain", count=24, batch=4, keys={"micro_size": 2, "accumulate_steps": 3})


@pytest.fixture(scope="module")
def windows_run(tmp_path_factory):
    """The Trainer over WINDOWS, uninterrupted: the windows test's run and the resume test's reference."""
    return run_trainer(tmp_path_factory.mktemp("windows"), **WINDOWS)


@pytest.mark.slow
def test_mindformers_trainer_windows_of_dataset_steps_train_like_their_full_batch(windows_run):
    result = windows_run
    expected, initial, _, _ = reference(joined(dataset_batches(result), 3))
    assert int(result["steps"]) == 2
    assert_updates_close(weights(result), expected, initial, fraction=FRACTION)
    control, _, _, _ = reference(dataset_batches(result)[2::3])   # the windows' last batches alone
    with pytest.raises(AssertionError, match="differs from the reference by"):
        assert_updates_close(weights(result), control, initial, fraction=FRACTION)


@pytest.mark.slow
def test_mindformers_trainer_token_route_on_ragged_rows(tmp_path):
    # Right-padded rows of different lengths with -100 prompts: the full batch's loss is the mean over all its valid
    # tokens. MindFormers' calculate_per_token_loss (the Trainer's and the model's) gives (loss_sum, count).
    result = run_trainer(tmp_path / "trainer", rows="ragged", count=16, batch=8, keys={"micro_size": 4},
                         per_token=True, args={"calculate_per_token_loss": True})
    expected, initial, losses, _ = reference(dataset_batches(result))
    assert_updates_close(weights(result), expected, initial, fraction=FRACTION)
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    # Negative control: MindFormers' token mean per micro-batch, weighted by rows (declared so: no warning; the contract
    # check, which would stop it, off).
    control = run_trainer(tmp_path / "control", rows="ragged", count=16, batch=8,
                          keys={"micro_size": 4, "per_token_loss": False, "check_loss": False})
    with pytest.raises(AssertionError, match="differs from the reference by"):
        assert_updates_close(weights(control), expected, initial, fraction=FRACTION)


@pytest.mark.slow
def test_mindformers_trainer_dynamic_loss_scale_with_a_binding_clip(tmp_path):
    # MindFormers' default scale_sense (DynamicLossScaleUpdateCell, 65536) and its ClipGradNorm, clipping every step.
    result = run_trainer(tmp_path / "trainer", rows="plain", count=24, batch=8, keys={"micro_size": 4},
                         args={"use_clip_grad": True, "max_grad_norm": 0.3})
    batches = dataset_batches(result)
    expected, initial, _, norms = reference(batches, max_grad_norm=0.3)
    assert min(norms) > 0.3, norms   # the clip binds at every step
    assert_updates_close(weights(result), expected, initial, fraction=FRACTION)
    # The global norm MindFormers prints: the full batch's, before clipping.
    np.testing.assert_allclose(result["norms"], norms, rtol=1e-4)
    assert not result["overflows"].any()
    unclipped, _, _, _ = reference(batches)
    with pytest.raises(AssertionError, match="differs from the reference by"):
        assert_updates_close(weights(result), unclipped, initial, fraction=FRACTION)


@pytest.mark.slow
def test_mindformers_trainer_resumed_mid_window_ends_like_the_uninterrupted_run(tmp_path, windows_run):
    # Windows of 3 dataset steps; the first run stops after 4 steps, with a checkpoint there (one step into the second
    # window); the resumed run reads it with MindFormers' resume_training and trains steps 5 and 6. The uninterrupted
    # run is the windows test's.
    spec, full = WINDOWS, windows_run
    first = dict(spec, count=16, args={"save_steps": 4})

    def resumed(name, keys):
        run_trainer(tmp_path / f"{name}_first", **dict(first, keys=keys))
        checkpoints = str(tmp_path / f"{name}_first" / "output" / "checkpoint")
        return run_trainer(tmp_path / name, **dict(spec, keys=keys, args={
            "resume_training": True, "resume_from_checkpoint": checkpoints}))

    result = resumed("resumed", spec["keys"])
    assert int(result["steps"]) == int(full["steps"]) == 2
    assert len(result["losses"]) == 2    # steps 5 and 6 only
    assert_params_equal(weights(result), weights(full))
    # Negative control: buffers named as MindFormers' CheckpointMonitor leaves them out lose the window's gradients.
    control = resumed("control", dict(spec["keys"], buffer_prefix="accu_grads"))
    assert max(update_ratios(weights(control), weights(full), params_of(make_llama())).values()) > 0.01


@pytest.mark.slow
@pytest.mark.multiprocess
def test_mindformers_trainer_data_parallel_on_two_ranks(tmp_path):
    require_ranks(2)
    spec = dict(rows="plain", count=32, batch=4, keys={"micro_size": 2, "accumulate_steps": 2}, parallel=True)
    msrun(TOOL, [str(tmp_path), json.dumps(spec)], 2, str(tmp_path / "logs"), timeout=600)
    ranks = [dict(np.load(tmp_path / f"result_rank{rank}.npz")) for rank in range(2)]
    assert_params_equal(weights(ranks[1]), weights(ranks[0]))
    # Each optimizer step: 2 dataset steps on each of 2 ranks, one global batch of 16 rows.
    per_step = [tuple(np.concatenate(parts) for parts in zip(*(dataset_batches(r)[step] for r in ranks)))
                for step in range(len(dataset_batches(ranks[0])))]
    expected, initial, _, _ = reference(joined(per_step, 2))
    assert int(ranks[0]["steps"]) == 2
    assert_updates_close(weights(ranks[0]), expected, initial, fraction=FRACTION)


# --- the keys, in the process (no Trainer: the wrapper as MindFormers builds it)
# ---------------------------------------

def _wrapper(**keys):
    model = make_llama()
    return model, GradAccumulationWrapper(model, make_optimizer("sgd", model.trainable_params()), **keys)


@pytest.mark.slow
def test_mindformers_wrapper_adaptive_loss_scale_and_the_outputs_monitors_read():
    batch = Tensor(np.stack([row[0] for row in token_rows("plain", 8, 1)]))
    model, wrapper = _wrapper(micro_size=4, scale_sense=AdaptiveLossScaleUpdateCell(2 ** 12, 2, 20))
    initial = params_of(model)
    loss, overflow, scale, learning_rate, norm = wrapper(batch)
    assert loss.shape == (1,) and not bool(overflow.asnumpy()) and float(scale.asnumpy()) == 2 ** 12
    assert float(learning_rate.asnumpy()) == pytest.approx(0.1) and norm is None
    expected, _, _, _ = reference([(batch.asnumpy(),)], optimizer="sgd")
    assert_updates_close(params_of(model), expected, initial, fraction=FRACTION)


@pytest.mark.slow
@pytest.mark.parametrize("threshold, steps", [(1e-3, 0), (1e3, 1)])
def test_mindformers_wrapper_skips_a_window_whose_global_norm_spikes(threshold, steps):
    batch = Tensor(np.stack([row[0] for row in token_rows("plain", 8, 1)]))
    model, wrapper = _wrapper(micro_size=2, use_skip_data_by_global_norm=True,
                              global_norm_spike_threshold=threshold)
    initial = params_of(model)
    *_, norm = wrapper(batch)
    assert float(norm.asnumpy()[0]) > 1e-3                  # the window gradient's norm, reported either way
    assert int(wrapper.optimizer.global_step.asnumpy().reshape(-1)[0]) == steps
    moved = any(not np.array_equal(value, initial[name]) for name, value in params_of(model).items())
    assert moved == bool(steps)


@pytest.mark.parametrize("keys, error, match", [
    ({"micro_size": 0}, ValueError, r"the argument 'micro_size' must be a positive int, but got 0 \(int\)"),
    ({"accumulate_steps": True}, TypeError, r"'accumulate_steps' must be a positive int, but got True \(bool\)"),
    ({"use_clip_grad": "yes"}, TypeError, r"the argument 'use_clip_grad' must be a bool, but got 'yes' \(str\)"),
    ({"max_grad_norm": -1.0}, ValueError, r"the argument 'max_grad_norm' must be a positive float, but got -1.0"),
    ({"global_norm_spike_threshold": "1"}, TypeError, r"'global_norm_spike_threshold' must be a positive float"),
    ({"sens": 1024}, TypeError, r"the runner_wrapper key\(s\) 'sens' are not known\. It takes this package's keys "
                                r"\(micro_size, accumulate_steps"),
    ({"check_loss": "no"}, TypeError, r"For 'GradAccumulationWrapper', the argument 'check_loss' must be a bool"),
    ({"local_norm": True}, ValueError, r"local_norm=True is not supported"),
    ({"grouped_lr_scheduler": [{}]}, ValueError, r"grouped learning-rate schedules \(grouped_lr_scheduler\) are not"),
    ({"calculate_per_token_loss": True, "per_token_loss": False}, ValueError,
     r"'per_token_loss' is False but MindFormers' calculate_per_token_loss is True"),
    ({"scale_sense": nn.Dense(2, 2)}, TypeError, r"'scale_sense' must be a positive finite float, a scalar Tensor or "
                                                 r"one of DynamicLossScaleUpdateCell, FixedLossScaleUpdateCell, "
                                                 r"AdaptiveLossScaleUpdateCell"),
])
def test_mindformers_wrapper_bad_keys_are_refused_naming_them(keys, error, match):
    with pytest.raises(error, match=match):
        _wrapper(**keys)
    if "scale_sense" not in keys:   # checked when the keys are given, before any model exists
        with pytest.raises(error, match=match):
            GradAccumulationWrapper.with_keys(**keys)


def test_mindformers_wrapper_refuses_mcore_models_and_takes_the_keys_the_trainer_always_passes(monkeypatch):
    # The Trainer passes print_separate_loss (default True) and lr_scheduler to every wrapper; MFTrainOneStepCell reads
    # them only for mcore models and beside grouped schedules, which the wrapper refuses.
    model, wrapper = _wrapper(micro_size=2, print_separate_loss=True, lr_scheduler=0.1)
    assert wrapper.micro_size == 2
    import ms_gradaccum.adapters.mindformers as adapter   # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(adapter, "is_legacy_model", lambda: False)
    with pytest.raises(ValueError, match=r"MindFormers' context has use_legacy: False, but the wrapper takes legacy "
                                         r"models only .* Set use_legacy: True"):
        GradAccumulationWrapper(model, make_optimizer("sgd", model.trainable_params()), micro_size=2)


def test_mindformers_trainer_config_refuses_its_own_accumulation_beside_the_wrapper():
    config = MindFormerConfig(runner_wrapper={"type": "GradAccumulationWrapper"},
                              runner_config={"gradient_accumulation_steps": 4})
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps must be 1 \(or unset\) beside it, but got 4.*"
                                         r"micro_size=4 .* or accumulate_steps=4"):
        check_trainer_config(config)
    config.runner_config.gradient_accumulation_steps = 1
    config.runner_wrapper.type = GradAccumulationWrapper.with_keys(micro_size=2)
    check_trainer_config(config)   # fine
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    try:
        with pytest.raises(ValueError, match=r"must be stand_alone or data_parallel, but it is semi_auto_parallel"):
            check_trainer_config(config)
    finally:
        ms.reset_auto_parallel_context()
    # Other wrappers are MindFormers' business.
    check_trainer_config(MindFormerConfig(runner_wrapper={"type": "MFTrainOneStepCell"},
                                          runner_config={"gradient_accumulation_steps": 4}))


@pytest.mark.slow
def test_mindformers_trainer_refuses_gradient_accumulation_steps_before_resetting_it(tmp_path):
    # MindFormers itself would warn and reset it to 1 (stand-alone): the Trainer stops with the package's error.
    done = subprocess.run([sys.executable, TOOL, str(tmp_path), json.dumps(dict(
        rows="plain", count=8, batch=4, keys={"micro_size": 2}, args={"gradient_accumulation_steps": 2}))],
        env=repo_env(GLOG_v="3"), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode != 0
    assert "gradient_accumulation_steps must be 1 (or unset) beside it, but got 2" in done.stderr, done.stderr[-3000:]


def test_mindformers_module_is_imported_only_by_whoever_uses_it_and_names_the_install():
    message = import_without("ms_gradaccum.mindformers", "mindformers")
    assert "MindFormers cannot be imported" in message and "pip install mindformers==2.1.0" in message


@pytest.mark.slow
def test_mindformers_sample_finetunes_through_the_trainer_in_graph_mode(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "sample_code", "mindformers_llama", "finetune.py"),
                           "--epochs", "1", "--output-dir", str(tmp_path / "output")],
                          env=repo_env(GLOG_v="3"), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = next(line for line in done.stdout.splitlines() if line.startswith("finetune: "))
    assert ("32 dataset steps of 16 rows in 4 micro-batches, 16 optimizer steps of 2 dataset steps each, GRAPH_MODE"
            in summary), summary
    first, last = (float(value) for value in summary.rsplit("loss ", 1)[1].split(" (")[0].split(" -> "))
    assert last < 0.9 * first, summary   # it learns


def test_mindformers_trainer_check_is_undone_by_uninstall():
    # The one change to MindFormers (its trainer's check runs the package's first): installed on import, undone by
    # uninstall() (MindFormers' own method back), installed again idempotently.
    from mindformers.trainer.base_trainer import BaseTrainer   # pylint: disable=import-outside-toplevel
    from ms_gradaccum.adapters.mindformers import TRAINER_CHECK   # pylint: disable=import-outside-toplevel
    patched = BaseTrainer._check_grad_accumulation_steps  # pylint: disable=protected-access
    assert TRAINER_CHECK.installed and patched.__qualname__.startswith("TrainerCheck.")
    TRAINER_CHECK.uninstall()
    try:
        original = BaseTrainer._check_grad_accumulation_steps  # pylint: disable=protected-access
        assert not TRAINER_CHECK.installed and original.__module__ == "mindformers.trainer.base_trainer"
        TRAINER_CHECK.uninstall()   # nothing more
    finally:
        TRAINER_CHECK.install()
        TRAINER_CHECK.install()
    assert BaseTrainer._check_grad_accumulation_steps.__qualname__.startswith("TrainerCheck.")  # pylint: disable=protected-access
    # remove_patches() undoes it too, and says so; the control: a second call has nothing left to undo.
    try:
        assert "MindFormers trainer check" in ms_gradaccum.remove_patches()
        assert BaseTrainer._check_grad_accumulation_steps is original  # pylint: disable=protected-access
        assert "MindFormers trainer check" not in ms_gradaccum.remove_patches()
    finally:
        TRAINER_CHECK.install()
