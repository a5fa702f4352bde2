"""Checkpoints for the sample: saved by MindSpore's ModelCheckpoint, resumed from the newest one every rank completed.

Each rank saves its whole train network (weights, optimizer state, the accumulation buffers and window state) into
its own folder, ``<save_dir>/rank_<N>/train-<epoch>_<step>.ckpt``, with a CRC and the global step it was taken after.
MindSpore writes a checkpoint to a temporary file and renames it when complete, so a killed write leaves no ``.ckpt``;
a file that is damaged anyway (truncated, copied in part) fails its CRC or its contents check and is skipped, with a
message naming it, never loaded.

Resuming continues at the step after the checkpoint's: the dataset is fast-forwarded there by MindSpore
(``Dataset.set_init_step``, which replays each epoch's shuffle, so the data order is the uninterrupted run's),
``Model.train`` starts at that epoch (``initial_epoch``) and the callbacks count from that step, so LossMonitor lines
and checkpoint names go on as they would have.
"""
import json
import os
import re
from typing import Dict, List, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor
from mindspore.train import Callback, CheckpointConfig, LossMonitor, ModelCheckpoint

PREFIX = "train"
_NAME = re.compile(rf"^{PREFIX}-(\d+)_(\d+)\.ckpt$")
# Each rank's folder records the settings its checkpoints were trained with (see settings_changes).
SETTINGS = "job.json"


def rank_folder(save_dir: str, rank: int) -> str:
    return os.path.join(save_dir, f"rank_{rank}")


class EpochAndStepCheckpoint(ModelCheckpoint):
    """ModelCheckpoint saving at the end of every epoch and every `save_steps` global steps (0: epochs only), and at
    the end of training, keeping the newest `keep`. The steps counted are global (across epochs and resumes)."""

    def __init__(self, folder: str, steps_per_epoch: int, save_steps: int, keep: int):
        config = CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=keep, append_info=["step_num"],
                                  crc_check=True)
        # A callable folder: MindSpore then keeps the prefix as it is when the folder already holds checkpoints (a
        # resumed run), instead of starting a second series (train_1-...) that keep_checkpoint_max does not count.
        super().__init__(prefix=PREFIX, directory=lambda _: folder, config=config)
        self.steps_per_epoch = steps_per_epoch
        self.save_steps = save_steps

    def step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        if step % self.steps_per_epoch == 0 or (self.save_steps and step % self.save_steps == 0):
            super().step_end(run_context)


class StartAt(Callback):
    """Makes the callbacks count from `step` (the global step of the checkpoint resumed): LossMonitor's epoch and step,
    ModelCheckpoint's file names. Model.train itself starts from step 0 of ``initial_epoch``; MindSpore's own fault
    recovery sets the same counter (``initial_step``), which the public ``train`` does not take."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_begin(self, run_context):
        run_context.original_args().cur_step_num = self.step


class AlignedLossMonitor(LossMonitor):
    """LossMonitor printing at every `every`-th global step, counted from the start of training: a resumed run prints
    the lines the uninterrupted run would have (LossMonitor itself counts from the step a run starts at)."""

    def __init__(self, every: int):
        super().__init__(1)
        self.every = every

    def step_end(self, run_context):
        if run_context.original_args().cur_step_num % self.every == 0:
            super().step_end(run_context)


def checkpoint_files(folder: str) -> List[Tuple[int, int, str]]:
    """``[(epoch, step in epoch, path), ...]`` of the checkpoints in `folder`, by their names."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = _NAME.match(name)
        if match:
            found.append((int(match.group(1)), int(match.group(2)), os.path.join(folder, name)))
    return sorted(found)


def valid_checkpoints(folder: str, names: List[str], say) -> Dict[int, Tuple[str, dict]]:
    """``{global step: (path, parameters)}`` of the checkpoints in `folder` that load (CRC checked) and hold every
    parameter in `names`; each one skipped is named through `say`, with the reason."""
    valid = {}
    for _, _, path in checkpoint_files(folder):
        try:
            params = ms.load_checkpoint(path, crc_check=True)
        except (ValueError, RuntimeError, OSError) as error:
            say(f"skipping checkpoint {path}: it cannot be read ({str(error).splitlines()[0]})")
            continue
        missing = [name for name in names if name not in params]
        if "step_num" not in params or missing:
            say(f"skipping checkpoint {path}: it does not hold this training's state (missing "
                f"{', '.join((['step_num'] if 'step_num' not in params else []) + missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}); was it written with other options?")
            continue
        valid[int(params["step_num"].asnumpy())] = (path, params)
    return valid


class _AllGather(nn.Cell):
    def __init__(self):
        super().__init__()
        self.all_gather = ops.AllGather()

    def construct(self, x):
        return self.all_gather(x)


def newest_common(steps: List[int], group: int, keep: int) -> Optional[int]:
    """The newest global step in `steps` that every rank of the job holds (an all-gather of each rank's steps)."""
    if group == 1:
        return max(steps) if steps else None
    width = keep + 2   # a rank holds at most `keep` checkpoints, and the last save may be caught mid-rename
    mine = np.full(width, -1, np.int32)
    newest = sorted(steps)[-width:]
    mine[:len(newest)] = newest
    gathered = _AllGather()(Tensor(mine)).asnumpy().reshape(group, width)
    common = set(gathered[0].tolist())
    for row in gathered[1:]:
        common &= set(row.tolist())
    common.discard(-1)
    return max(common) if common else None


def remove_checkpoints(folder: str, after: int = -1) -> int:
    """Removes the checkpoints in `folder` (only those taken after global step `after`, when given) and MindSpore's
    leftovers of killed writes; returns how many checkpoints."""
    removed = 0
    if not os.path.isdir(folder):
        return removed
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(".tmp"):
            os.remove(path)
            continue
        if not _NAME.match(name):
            continue
        if after >= 0:
            try:
                step = int(ms.load_checkpoint(path, specify_prefix="step_num")["step_num"].asnumpy())
            except (ValueError, RuntimeError, OSError, KeyError):
                continue   # unreadable: it was skipped already, and is left for the user to look at
            if step <= after:
                continue
        os.chmod(path, 0o600)   # MindSpore leaves its checkpoints read-only
        os.remove(path)
        removed += 1
    return removed


def write_settings(folder: str, settings: Dict[str, object]) -> None:
    """Records `settings` in `folder` (written whole, then renamed: a killed write leaves the old record or none)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, SETTINGS)
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(settings, handle, indent=1)
    os.replace(path + ".tmp", path)


def recorded_settings(folder: str) -> Optional[Dict[str, object]]:
    """The settings recorded in `folder`, or None where there is no readable record."""
    try:
        with open(os.path.join(folder, SETTINGS), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def settings_changes(folders: List[str], settings: Dict[str, object]) -> Optional[List[str]]:
    """What differs between `settings` and the record of each folder that holds checkpoints: ``["--batch-size:
    checkpoint 32, now 64", ...]``; ``[]`` when nothing differs or no folder holds a checkpoint; None where a folder
    holds checkpoints but no record of their settings (written by an older sample)."""
    changes = []
    for folder in folders:
        if not checkpoint_files(folder):
            continue
        recorded = recorded_settings(folder)
        if recorded is None:
            return None
        for name, value in settings.items():
            line = f"{name}: checkpoint {recorded.get(name, 'not recorded')}, now {value}"
            if recorded.get(name) != value and line not in changes:
                changes.append(line)
    return changes
