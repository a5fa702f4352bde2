"""The sample trains end to end on the built-in dataset, through the same ds.MnistDataset path as MNIST."""
import os
import re
import struct
import subprocess
import sys

import pytest

from launch import REPO, repo_env, suite_device

SAMPLE = os.path.join(REPO, "sample_code", "distributed_gradient_accumulation")
sys.path.insert(0, SAMPLE)
from builtin_digits import FILES, ensure_digits_mnist  # noqa: E402


def test_sample_builtin_dataset_is_written_once_in_idx_format(tmp_path):
    directory = ensure_digits_mnist(str(tmp_path / "digits"))
    sizes = {}
    for split, (image_file, label_file) in FILES.items():
        with open(os.path.join(directory, image_file), "rb") as handle:
            magic, count, rows, cols = struct.unpack(">IIII", handle.read(16))
            pixels = handle.read()
        with open(os.path.join(directory, label_file), "rb") as handle:
            label_magic, label_count = struct.unpack(">II", handle.read(8))
            labels = handle.read()
        assert (magic, label_magic, rows, cols) == (2051, 2049, 28, 28)
        assert count == label_count == len(labels) and len(pixels) == count * 28 * 28
        assert set(labels) == set(range(10))
        sizes[split] = count
    assert sizes == {"train": 1437, "test": 360}  # all 1,797 digits, 80/20
    stamp = os.path.getmtime(os.path.join(directory, FILES["train"][0]))
    assert ensure_digits_mnist(directory) == directory
    assert os.path.getmtime(os.path.join(directory, FILES["train"][0])) == stamp


def _sample(tmp_path, *args):
    env = repo_env(XDG_CACHE_HOME=str(tmp_path), GLOG_v="3", LOG_DIR=str(tmp_path / "logs"))   # checkpoints there
    env.pop("DATA_PATH", None)
    done = subprocess.run([sys.executable, os.path.join(SAMPLE, "train.py"), "--device-target", suite_device(), *args],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
def test_sample_trains_on_builtin_dataset(tmp_path):
    status, output = _sample(tmp_path, "--epochs", "2", "--max-steps", "20", "--loss-every", "10")
    assert status == 0, output[-3000:]
    assert "mode stand_alone, 1 rank(s)" in output
    assert os.path.isdir(os.path.join(str(tmp_path), "ms_gradaccum", "digits_mnist"))
    losses = [float(v) for v in re.findall(r"epoch: \d+ step: \d+, loss is ([0-9.e-]+)", output)]
    assert len(losses) == 4, output[-3000:]
    final = re.search(r"final loss ([0-9.]+) test accuracy ([0-9.]+) \(360 images\)", output)
    assert final, output[-3000:]
    assert losses[-1] < losses[0]
    # 40 SGD steps of batch 32 on real digits: well above the 10% of guessing, far from converged.
    assert float(final.group(2)) > 0.3


@pytest.mark.slow
def test_sample_logs_loss_lines_however_short_the_epoch(tmp_path):
    # 3 steps per epoch and no --loss-every: LossMonitor prints every min(100, 3) steps, so every run logs.
    status, output = _sample(tmp_path, "--epochs", "2", "--max-steps", "3")
    assert status == 0, output[-3000:]
    assert len(re.findall(r"epoch: \d+ step: 3, loss is", output)) == 2, output[-3000:]


@pytest.mark.slow
def test_sample_check_passes_and_batch_norm_control_fails(tmp_path):
    status, output = _sample(tmp_path, "--check", "--check-steps", "2")
    assert status == 0 and "[rank 0] equivalence check PASS" in output, output[-3000:]
    status, output = _sample(tmp_path, "--check", "--check-steps", "2", "--check-network", "batchnorm")
    assert status == 1 and "[rank 0] equivalence check FAIL" in output, output[-3000:]
    assert "likely cause: batch normalisation (_backbone.layers.1 (BatchNorm1d))" in output


@pytest.mark.slow
def test_sample_header_describes_an_uneven_split(tmp_path):
    status, output = _sample(tmp_path, "--epochs", "1", "--max-steps", "2", "--micro-size", "7")
    assert status == 0, output[-3000:]
    assert "of batch 32 = 7 micro-batches of 5 or 4 rows (4 x 5 + 3 x 4)" in output, output[-3000:]


def test_sample_semi_auto_batches_are_what_the_parallel_pass_accepts(tmp_path):
    # Semi-auto cannot run on CPU: this checks what the sample would hand the cell there. Its batches drop the short
    # last one, and each rank's batch passes the check GradAccumulationCell runs when the graph compiles (MindSpore
    # shows the graph every rank's rows together: rows x ranks).
    import train    # pylint: disable=import-outside-toplevel
    from ms_gradaccum.parallel.parallel_pass import check_parallel_pass_batch   # pylint: disable=import-outside-toplevel
    path = ensure_digits_mnist(str(tmp_path / "digits"))
    micro_size, batch = 4, 32
    for mode, ranks in (("semi_auto_parallel", 8), ("auto_parallel", 1)):
        assert train.drop_remainder(mode)
        for rank in sorted({0, ranks - 1}):
            dataset = train.create_dataset(path, "train", batch, rank, ranks, training=True, drop_last=True)
            rows = [image.shape[0] for image, _ in dataset.create_tuple_iterator(num_epochs=1)]
            assert rows and set(rows) == {batch}
            check_parallel_pass_batch(((batch * ranks, 1, 28, 28), (batch * ranks,)), (ranks,), micro_size, mode)
    assert train.dropped_rows(path, batch, 0, 8) == 180 % batch      # 1437 rows in 8 shards of 180
    assert train.dropped_rows(path, batch, 0, 1) == 1437 % batch     # 29
    # Stand-alone and data parallel train on every row; the short last batch of 29 is what the pass would refuse.
    assert not train.drop_remainder("stand_alone") and not train.drop_remainder("data_parallel")
    dataset = train.create_dataset(path, "train", batch, 0, 1, training=False)
    last = [image.shape[0] for image, _ in dataset.create_tuple_iterator(num_epochs=1)][-1]
    assert last == 29
    with pytest.raises(ValueError, match=r"holds 29 rows\. Batch the dataset with drop_remainder=True"):
        check_parallel_pass_batch(((last, 1, 28, 28), (last,)), (1,), micro_size, "semi_auto_parallel")


# --- checkpoints and --resume (stand-alone; 2 ranks killed and resumed: test_run_sh) -------------------------------

RUN = ("--epochs", "2", "--max-steps", "5", "--save-steps", "2", "--keep-checkpoints", "10", "--loss-every", "1")


def _final(output: str) -> tuple:
    found = re.search(r"final loss ([0-9.]+) test accuracy ([0-9.]+)", output)
    assert found, output[-3000:]
    return float(found.group(1)), float(found.group(2))


def _loss_lines(output: str) -> dict:
    return {(int(e), int(s)): float(v) for e, s, v in re.findall(r"epoch: (\d+) step: (\d+), loss is ([0-9.e-]+)",
                                                                 output)}


def _same_final(actual: str, expected: str) -> bool:
    return all(abs(a - b) <= 1e-6 for a, b in zip(_final(actual), _final(expected)))


def _weights(path: str) -> dict:
    import mindspore as ms   # pylint: disable=import-outside-toplevel
    return {name: value.asnumpy() for name, value in ms.load_checkpoint(path).items()}


def _assert_same_weights(actual: str, expected: str, tolerance: float = 1e-6) -> None:
    import numpy as np   # pylint: disable=import-outside-toplevel
    a, b = _weights(actual), _weights(expected)
    assert sorted(a) == sorted(b)
    worst = max(float(np.max(np.abs(a[name].astype(np.float64) - b[name]))) for name in b)
    assert worst <= tolerance, f"{actual} differs from {expected} by {worst:g}"


def _stopped_copy(source, target, last_step: int) -> None:
    """`target` holds what a run stopped after global step `last_step` would have left: the checkpoints up to it, and
    the record of the settings they were trained with."""
    import shutil   # pylint: disable=import-outside-toplevel
    os.makedirs(target)
    for name in os.listdir(source):
        found = re.match(r"train-(\d+)_(\d+)\.ckpt$", name)
        if name == "job.json" or found and (int(found.group(1)) - 1) * 5 + int(found.group(2)) <= last_step:
            shutil.copy(os.path.join(source, name), os.path.join(target, name))


@pytest.mark.slow
@pytest.mark.parametrize("accumulate_steps", ["1", "3"])
def test_sample_resume_mid_epoch_ends_as_the_uninterrupted_run(tmp_path, accumulate_steps):
    # 2 epochs of 5 steps, checkpoints every 2 steps and at each epoch's end. Stopped after global step 6 (epoch 2,
    # step 1; with windows of 3 batches (3 + 2 per epoch), inside the first window of epoch 2), resumed: the same
    # loss lines from there on, the same final line, the same final weights (optimizer state and buffers too).
    args = RUN + ("--accumulate-steps", accumulate_steps)
    status, reference = _sample(tmp_path / "a", *args)
    assert status == 0, reference[-3000:]
    folder = tmp_path / "a" / "logs" / "checkpoints" / "rank_0"
    assert sorted(os.listdir(folder)) == ["job.json", "train-1_2.ckpt", "train-1_4.ckpt", "train-1_5.ckpt",
                                          "train-2_1.ckpt", "train-2_3.ckpt", "train-2_5.ckpt", "train-graph.meta"]
    _stopped_copy(folder, tmp_path / "b" / "logs" / "checkpoints" / "rank_0", 6)
    status, resumed = _sample(tmp_path / "b", *args, "--resume")
    assert status == 0, resumed[-3000:]
    assert re.search(r"resumed from \S+train-2_1\.ckpt: global step 6 \(epoch 2, step 1 of 5\)", resumed), resumed
    lines = _loss_lines(resumed)
    assert sorted(lines) == [(2, 2), (2, 3), (2, 4), (2, 5)], lines   # nothing before the checkpoint is trained again
    expected = _loss_lines(reference)
    assert all(abs(lines[key] - expected[key]) <= 1e-6 for key in lines), (lines, expected)
    assert _same_final(resumed, reference)
    _assert_same_weights(str(tmp_path / "b" / "logs" / "checkpoints" / "rank_0" / "train-2_5.ckpt"),
                         str(folder / "train-2_5.ckpt"))
    # Control: the checkpoint resumed from is not the end state (the resumed run trained).
    import numpy as np   # pylint: disable=import-outside-toplevel
    start, end = _weights(str(folder / "train-2_1.ckpt")), _weights(str(folder / "train-2_5.ckpt"))
    assert max(float(np.max(np.abs(start[name] - end[name]))) for name in end if "layers" in name) > 1e-4


@pytest.mark.slow
def test_sample_resume_skips_a_damaged_checkpoint_and_says_when_there_is_none(tmp_path):
    status, reference = _sample(tmp_path / "a", *RUN)
    assert status == 0, reference[-3000:]
    folder = tmp_path / "a" / "logs" / "checkpoints" / "rank_0"
    target = tmp_path / "b" / "logs" / "checkpoints" / "rank_0"
    _stopped_copy(folder, target, 6)
    damaged = target / "train-2_1.ckpt"
    damaged.write_bytes(damaged.read_bytes()[:-100])   # a write cut short
    status, resumed = _sample(tmp_path / "b", *RUN, "--resume")
    assert status == 0, resumed[-3000:]
    assert f"skipping checkpoint {damaged}: it cannot be read" in resumed, resumed
    assert "resumed from" in resumed and "train-1_5.ckpt: global step 5 (epoch 1, step 5 of 5)" in resumed, resumed
    assert _same_final(resumed, reference)
    _assert_same_weights(str(target / "train-2_5.ckpt"), str(folder / "train-2_5.ckpt"))
    # Nothing to resume: said, and training starts from the beginning (the same run as without --resume).
    status, fresh = _sample(tmp_path / "c", *RUN, "--resume")
    assert status == 0, fresh[-3000:]
    assert re.search(r"--resume: no checkpoint that every rank completed in \S+: starting from the beginning", fresh)
    assert (1, 1) in _loss_lines(fresh) and _same_final(fresh, reference)
    # --no-save: no checkpoint at all; and it cannot be combined with --resume.
    status, output = _sample(tmp_path / "d", *RUN, "--no-save")
    assert status == 0 and not (tmp_path / "d" / "logs" / "checkpoints").exists(), output[-3000:]
    status, output = _sample(tmp_path / "d", *RUN, "--no-save", "--resume")
    assert status == 2 and "argument --resume: not allowed with --no-save" in output, output[-3000:]


def test_sample_progress_times_the_pace_after_the_compile(monkeypatch):
    # The first epoch's first step compiles (60 s here); the time left comes from the steps after it. Control: the
    # epoch's whole time over its steps (the compile counted) would say 9 min 36 s. An epoch of one step has no pace.
    import train    # pylint: disable=import-outside-toplevel
    clock = [0.0]
    monkeypatch.setattr(train.time, "monotonic", lambda: clock[0])
    printed = []
    monkeypatch.setattr("builtins.print", lambda *args, **kwargs: printed.append(" ".join(map(str, args))))

    class Args:
        def __init__(self, step, epoch):
            self.cur_step_num, self.cur_epoch_num, self.net_outputs = step, epoch, train.ms.Tensor(1.5)

    class Context:
        def __init__(self, step, epoch=1):
            self.args = Args(step, epoch)

        def original_args(self):
            return self.args

    progress = train.Progress(0, 10, 5, 32)
    progress.on_train_epoch_begin(Context(0))
    for step, at in zip(range(1, 6), (60, 61, 62, 63, 64)):
        clock[0] = at
        progress.on_train_step_end(Context(step))
    progress.on_train_epoch_end(Context(5))
    assert printed[-1] == ("[rank 0] epoch 1/10: step 5/50, loss 1.5000, 32 samples/s, about 0 min 45 s left (this "
                           "epoch compiled the graphs)"), printed
    progress.on_train_epoch_begin(Context(5, 2))
    for step in range(6, 11):
        clock[0] += 2.0
        progress.on_train_step_end(Context(step, 2))
    progress.on_train_epoch_end(Context(10, 2))
    assert printed[-1].endswith("16 samples/s, about 1 min 20 s left"), printed   # 2 s a step from now on
    single = train.Progress(0, 10, 1, 32)
    single.on_train_epoch_begin(Context(0))
    clock[0] += 60
    single.on_train_step_end(Context(1))
    single.on_train_epoch_end(Context(1))
    assert printed[-1].endswith("time left: estimated after the next epoch (this epoch compiled the graphs)"), printed
