"""Gradient accumulation on MNIST-format data: the MindSpore distributed tutorial's job, accumulating.

The tutorial's shape: ``ds.MnistDataset(DATA_PATH)`` with Rescale/Normalize/HWC2CHW, the 784-512-512-10
Dense/ReLU network, SGD 1e-2, CrossEntropyLoss, ``LossMonitor(100)`` and ``Model.train(10, ...)``, with
``GradAccumulationCell(nn.WithLossCell(net, loss_fn), 4)`` as the training network.

Runs stand-alone (``python train.py``) or as one rank of a job started by ``run.sh`` (msrun or mpirun),
where each rank reads its own shard of the data. Without ``DATA_PATH`` it uses the built-in handwritten
digits (see builtin_digits.py), written once to a cache directory and read through ``ds.MnistDataset``.

Every image is trained on stand-alone and data parallel: ``GradAccumulationCell`` splits an epoch's short last
batch as evenly as possible. Under semi-auto/auto parallel (GPU, Ascend) MindSpore's parallel pass does the
accumulation and needs ``micro_size`` micro-batches of equal size, so there the sample batches with
``drop_remainder=True`` and says how many rows each epoch leaves out (the cell would refuse the short batch with
the same advice; see ``drop_remainder`` below).
"""
import argparse
import os
import socket
import sys
import time
import warnings

import mindspore as ms
import mindspore.dataset as ds
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init
from mindspore.dataset import transforms, vision
from mindspore.train import Model

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell, check_equivalence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from builtin_digits import FILES, ensure_digits_mnist  # noqa: E402  (sits next to this script)
from checkpoints import (AlignedLossMonitor, EpochAndStepCheckpoint, StartAt, newest_common, rank_folder,  # noqa: E402
                         remove_checkpoints, settings_changes, valid_checkpoints, write_settings)

SEED = 1   # the same initial weights on every rank (data-parallel ranks must start as one model)

PARALLEL_MODES = {
    "stand_alone": ms.ParallelMode.STAND_ALONE,
    "data_parallel": ms.ParallelMode.DATA_PARALLEL,
    "semi_auto_parallel": ms.ParallelMode.SEMI_AUTO_PARALLEL,
    "auto_parallel": ms.ParallelMode.AUTO_PARALLEL,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (split into micro-batches)")
    parser.add_argument("--micro-size", type=int, default=4, help="NUMBER of micro-batches per batch")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--device-target", default="CPU", choices=["CPU", "GPU", "Ascend"])
    parser.add_argument("--parallel-mode", default="auto", choices=["auto", *PARALLEL_MODES],
                        help="auto: stand_alone for one process; data_parallel on CPU and "
                             "semi_auto_parallel (with the parallel optimizer) on GPU/Ascend for several")
    parser.add_argument("--loss-every", type=int, default=None,
                        help="LossMonitor's per_print_times (default: min(100, steps per epoch), so every run logs)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    parser.add_argument("--data-path", default=os.environ.get("DATA_PATH", ""),
                        help="MNIST folder in idx format (default: $DATA_PATH, else the built-in digits)")
    parser.add_argument("--check", action="store_true",
                        help="instead of training: check that accumulation gives the full-batch update here "
                             "(same weights, same batches, a few steps); exit 0 on PASS, 1 on FAIL")
    parser.add_argument("--check-steps", type=int, default=3, help="optimizer steps the check runs")
    parser.add_argument("--check-network", default="mlp", choices=["mlp", "batchnorm"],
                        help="the network the check runs; 'batchnorm' adds a BatchNorm1d (it must FAIL)")
    parser.add_argument("--accumulate-steps", type=int, default=1,
                        help="batches per optimizer step (AccumulatingTrainOneStepCell, each epoch's last window "
                             "closed); 1: GradAccumulationCell, the tutorial's")
    parser.add_argument("--save-dir", default=os.path.join(os.environ.get("LOG_DIR", "log_output"), "checkpoints"),
                        help="checkpoints go to SAVE_DIR/rank_<N>/ (default: $LOG_DIR/checkpoints, run.sh's log "
                             "folder)")
    parser.add_argument("--save-steps", type=int, default=0,
                        help="save a checkpoint every this many steps as well as at the end of every epoch (0: epochs "
                             "only)")
    parser.add_argument("--keep-checkpoints", type=int, default=3, help="how many checkpoints each rank keeps")
    parser.add_argument("--no-save", action="store_true", help="save no checkpoint")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint every rank completed (same data order, same "
                             "result as a run never stopped); with none there, start from the beginning, saying so")
    parser.add_argument("--validate-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "micro_size", "check_steps", "accumulate_steps", "keep_checkpoints"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be a positive integer, but got "
                         f"{getattr(args, name)}")
    if args.micro_size > args.batch_size:
        parser.error(f"argument --micro-size: must be at most --batch-size ({args.batch_size}) so that every "
                     f"micro-batch holds at least one sample, but got {args.micro_size}")
    if args.save_steps < 0:
        parser.error(f"argument --save-steps: must be 0 (epochs only) or a positive integer, but got {args.save_steps}")
    if args.resume and args.no_save:
        parser.error("argument --resume: not allowed with --no-save (a resumed run that saves nothing cannot be "
                     "resumed again); drop one of them")
    if args.loss_every is not None and args.loss_every < 1:
        parser.error(f"argument --loss-every: must be a positive integer, but got {args.loss_every}")
    if args.data_path:
        missing = [name for pair in FILES.values() for name in pair
                   if not os.path.isfile(os.path.join(args.data_path, name))]
        if missing:
            found = "it does not exist" if not os.path.isdir(args.data_path) else "it lacks " + ", ".join(missing)
            parser.error(f"--data-path / DATA_PATH {args.data_path!r} must be a folder with MNIST's four idx files "
                         f"({', '.join(name for pair in FILES.values() for name in pair)}), but {found}. Unset "
                         f"DATA_PATH to use the built-in digits.")
    mode = resolve_parallel_mode(args.parallel_mode, args.device_target, launched_ranks())
    if args.device_target == "CPU" and mode in ("semi_auto_parallel", "auto_parallel"):
        parser.error(f"--parallel-mode {mode} cannot run on CPU (MindSpore compiles these modes for GPU and Ascend "
                     f"only); use data_parallel (the default for several CPU workers), or DEVICE_TARGET=GPU|Ascend")
    if args.validate_only and args.resume:
        refuse_changed_resume(args, mode, launched_ranks())
    if args.validate_only:
        try:   # a GPU/Ascend build's libraries missing, or a CPU-only MindSpore: say so before any rank starts
            ms.set_device(args.device_target) if hasattr(ms, "set_device") else ms.set_context(
                device_target=args.device_target)
        except (RuntimeError, ValueError) as error:
            parser.error(f"--device-target {args.device_target} cannot be used here: {str(error).splitlines()[0]}")
    return args


def job_settings(args, mode: str, ranks: int) -> dict:
    """What decides where the data stands at a global step and what the saved state means: a checkpoint resumes only
    under the same values. (--micro-size changes no arithmetic; --epochs only how far training goes; the rest only
    logging and saving.)"""
    data_path = args.data_path or ensure_digits_mnist()
    return {
        "workers (world size)": ranks,
        "--batch-size": args.batch_size,
        "--accumulate-steps": args.accumulate_steps,
        "--lr": args.lr,
        "--max-steps": args.max_steps,
        "--parallel-mode": mode,
        "training rows of --data-path / DATA_PATH": mnist_shard(data_path, "train", 0, 1, False).get_dataset_size(),
        "seed": SEED,
    }


def refuse_changed_resume(args, mode: str, ranks: int) -> None:
    """Exit 2, naming each setting that differs, where --resume would continue checkpoints trained with other
    settings (read from every rank folder of --save-dir on this machine)."""
    folders = [os.path.join(args.save_dir, name) for name in sorted(os.listdir(args.save_dir))
               if name.startswith("rank_")] if os.path.isdir(args.save_dir) else []
    changes = settings_changes(folders, job_settings(args, mode, ranks))
    if changes == []:
        return
    stop = "Resuming would not continue their run exactly: nothing was started or deleted."
    where = f"train.py: error: --resume: the checkpoints in {args.save_dir}"
    if changes is None:
        what = f"{where} hold no record of the settings they were trained with (written by an older sample). {stop}"
        way_out = "Start a new run"
    else:
        what = f"{where} were trained with other settings. {stop}\n  " + "\n  ".join(changes)
        way_out = "Either resume with the checkpoint's values, or start a new run"
    print(f"{what}\n{way_out} in another folder (LOG_DIR=<new folder> bash run.sh ..., or --save-dir); a run without "
          f"--resume replaces these checkpoints.", file=sys.stderr)
    sys.exit(2)


def launched_ranks() -> int:
    """How many ranks the launcher started (msrun and run.sh's mpirun both set MS_WORKER_NUM)."""
    return int(os.environ.get("MS_WORKER_NUM", "1"))


def resolve_parallel_mode(requested: str, device_target: str, ranks: int) -> str:
    if requested != "auto":
        return requested
    if ranks == 1:
        return "stand_alone"
    return "data_parallel" if device_target == "CPU" else "semi_auto_parallel"


def split_description(batch: int, micro_size: int) -> str:
    """How GradAccumulationCell splits a batch: "4 micro-batches of 8", or "7 micro-batches of 5 or 4 rows
    (4 x 5 + 3 x 4)" when they cannot be equal (sizes differ by at most one row)."""
    rows, extra = divmod(batch, micro_size)
    if extra == 0:
        return f"{micro_size} micro-batches of {rows}"
    return (f"{micro_size} micro-batches of {rows + 1} or {rows} rows ({extra} x {rows + 1} + "
            f"{micro_size - extra} x {rows})")


def setup_parallel(mode: str) -> tuple:
    """Initialise communication for a parallel mode; return (rank, group size)."""
    if mode == "stand_alone":
        return 0, 1
    init()
    context = dict(parallel_mode=PARALLEL_MODES[mode], gradients_mean=True)
    if mode in ("semi_auto_parallel", "auto_parallel"):
        context["enable_parallel_optimizer"] = True
    ms.set_auto_parallel_context(**context)
    return get_rank(), get_group_size()


def drop_remainder(mode: str) -> bool:
    """Whether the training batches drop an epoch's short last batch: only where MindSpore's parallel pass accumulates
    (it splits each batch into ``micro_size`` equal micro-batches); elsewhere every row is trained on."""
    return mode in ("semi_auto_parallel", "auto_parallel")


def mnist_shard(path: str, usage: str, rank: int, group: int, training: bool) -> ds.MnistDataset:
    shard = dict(num_shards=group, shard_id=rank) if group > 1 else {}
    return ds.MnistDataset(path, usage=usage, shuffle=training, **shard)


def create_dataset(path: str, usage: str, batch_size: int, rank: int, group: int, training: bool,
                   drop_last: bool = False) -> ds.Dataset:
    dataset = mnist_shard(path, usage, rank, group, training)
    image_ops = [vision.Rescale(1.0 / 255.0, 0.0), vision.Normalize(mean=(0.1307,), std=(0.3081,)),
                 vision.HWC2CHW()]
    dataset = dataset.map(image_ops, "image").map(transforms.TypeCast(ms.int32), "label")
    # drop_last=False: every image is used, and GradAccumulationCell splits a short last batch as evenly as possible
    # (one more compiled graph for that shape). True only under semi-auto/auto parallel (see drop_remainder).
    return dataset.batch(batch_size, drop_remainder=drop_last)


def dropped_rows(path: str, batch_size: int, rank: int, group: int) -> int:
    """Rows of this rank's training shard that ``drop_remainder=True`` leaves out of every epoch."""
    return mnist_shard(path, "train", rank, group, training=False).get_dataset_size() % batch_size


class Network(nn.Cell):
    """The tutorial's 784-512-512-10 MLP (with ``batch_norm``, a BatchNorm1d after the first layer: the
    equivalence check's negative control)."""

    def __init__(self, batch_norm: bool = False):
        super().__init__()
        self.flatten = nn.Flatten()
        norm = [nn.BatchNorm1d(512)] if batch_norm else []
        self.layers = nn.SequentialCell(nn.Dense(28 * 28, 512), *norm, nn.ReLU(), nn.Dense(512, 512), nn.ReLU(),
                                        nn.Dense(512, 10))

    def construct(self, x):
        return self.layers(self.flatten(x))


class Progress(ms.train.Callback):
    """One line per epoch (run.sh shows the first rank's on the terminal): the epoch, the global step, the last batch's
    loss, the job's throughput and the time left at that pace. The pace is timed from the end of the run's first
    step, which compiled the graphs: an epoch of one step has no pace yet, and says when the estimate comes."""

    def __init__(self, rank: int, epochs: int, steps_per_epoch: int, job_batch: int):
        super().__init__()
        self.rank, self.epochs, self.steps, self.job_batch = rank, epochs, steps_per_epoch, job_batch
        self.epoch_started = self.after_compile = None   # (time, global step) from which the pace is timed

    def on_train_epoch_begin(self, run_context):
        self.epoch_started = (time.monotonic(), run_context.original_args().cur_step_num)

    def on_train_step_end(self, run_context):
        if self.after_compile is None:   # the run's first step is done: its graphs are compiled
            self.after_compile = (time.monotonic(), run_context.original_args().cur_step_num)

    def on_train_epoch_end(self, run_context):
        args = run_context.original_args()
        done, total = args.cur_step_num, self.epochs * self.steps
        started, first_step = max(self.epoch_started, self.after_compile or self.epoch_started, key=lambda s: s[1])
        compiled = " (this epoch compiled the graphs)" if first_step != self.epoch_started[1] else ""
        if done > first_step:
            per_step = (time.monotonic() - started) / (done - first_step)
            left = int(round(per_step * (total - done)))
            pace = f"{self.job_batch / per_step:.0f} samples/s, about {left // 60} min {left % 60:02d} s left"
        else:
            pace = "time left: estimated after the next epoch"
        print(f"[rank {self.rank}] epoch {args.cur_epoch_num}/{self.epochs}: step {done}/{total}, loss "
              f"{float(args.net_outputs.asnumpy()):.4f}, {pace}{compiled}", flush=True)


class LauncherWatch(ms.train.Callback):
    """Stops this rank when the run.sh that started it is gone (killed where it could not stop the job itself): the
    rank does not train on as an orphan. Checked at most once a second, between steps."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        pid = os.environ.get("MS_GRADACCUM_RUN_SH_PID", "")
        same_host = os.environ.get("MS_GRADACCUM_RUN_SH_HOST", socket.gethostname()) == socket.gethostname()
        self.pid = int(pid) if pid.isdigit() and same_host else None
        self.checked = 0.0

    def on_train_step_end(self, run_context):
        if self.pid is None or time.monotonic() - self.checked < 1.0:
            return
        self.checked = time.monotonic()
        try:
            with open(f"/proc/{self.pid}/stat", encoding="ascii", errors="replace") as handle:
                gone = handle.read().rpartition(") ")[2].startswith("Z")   # killed, not yet reaped: gone too
        except OSError:
            gone = not _exists(self.pid)
        if gone:
            print(f"[rank {self.rank}] run.sh (pid {self.pid}) is gone: stopping this rank", flush=True)
            os._exit(143)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):   # none, or another user's process under the number now
        return False
    return True


class _LastLoss(ms.train.Callback):
    def __init__(self):
        super().__init__()
        self.loss = float("nan")

    def on_train_step_end(self, run_context):
        self.loss = float(run_context.original_args().net_outputs.asnumpy())


def accuracy(net: nn.Cell, dataset: ds.Dataset) -> tuple:
    correct = total = 0
    for image, label in dataset.create_tuple_iterator(num_epochs=1):
        predicted = net(image).asnumpy().argmax(axis=1)
        correct += int((predicted == label.asnumpy()).sum())
        total += len(predicted)
    return correct / max(total, 1), total


def run_check(args, data_path: str, rank: int, group: int) -> int:
    """The equivalence check on this rank's first --check-steps batches; 0 on PASS, 1 on FAIL."""
    train_set = create_dataset(data_path, "train", args.batch_size, rank, group, training=False)
    batches = [(image.asnumpy(), label.asnumpy())
               for image, label in train_set.take(args.check_steps).create_tuple_iterator(num_epochs=1)]
    print(f"[rank {rank}] checking on {len(batches)} batch(es) of {args.batch_size}", flush=True)
    batch_norm = args.check_network == "batchnorm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the BatchNorm warning: the check reports it as a likely cause
        report = check_equivalence(lambda: nn.WithLossCell(Network(batch_norm), nn.CrossEntropyLoss()), batches,
                                   args.micro_size, lambda params: nn.SGD(params, args.lr))
    print(f"[rank {rank}] equivalence check {'PASS' if report else 'FAIL'}", flush=True)
    return 0 if report else 1


def prepare_checkpoints(args, model: Model, rank: int, group: int, steps: int, settings: dict) -> int:
    """The global step training starts after: with --resume, that of the newest checkpoint every rank completed,
    loaded into the train network (0 when there is none, said so); else 0, this rank's old checkpoints removed. The
    rank's folder records `settings`; a resume under other settings stops (run.sh refuses it before launching)."""
    folder = rank_folder(args.save_dir, rank)
    say = lambda text: print(f"[rank {rank}] {text}", flush=True)   # noqa: E731
    if args.resume:
        changes = settings_changes([folder], settings)
        if changes:
            raise SystemExit(f"[rank {rank}] --resume: the checkpoints in {folder} were trained with other settings "
                             f"({'; '.join(changes)}); nothing was trained or deleted.")
        if changes is None:
            raise SystemExit(f"[rank {rank}] --resume: the checkpoints in {folder} hold no record of the settings they "
                             f"were trained with; nothing was trained or deleted.")
    if not args.resume:
        removed = remove_checkpoints(folder)
        write_settings(folder, settings)
        earlier = f": removed {removed} checkpoint(s) of an earlier run from {folder}" if removed else ""
        say(f"starting from the beginning{earlier}")
        return 0
    names = [param.name for param in model.train_network.get_parameters()]
    valid = valid_checkpoints(folder, names, say)
    step = newest_common(list(valid), group, args.keep_checkpoints)
    if step is None:
        removed = remove_checkpoints(folder)
        write_settings(folder, settings)
        say(f"--resume: no checkpoint that every rank completed in {args.save_dir}: starting from the beginning"
            f"{f' (the {removed} checkpoint(s) of this rank, of the same settings, are replaced)' if removed else ''}")
        return 0
    path, params = valid[step]
    not_loaded, _ = ms.load_param_into_net(model.train_network, params, strict_load=True)
    if not_loaded:
        raise RuntimeError(f"[rank {rank}] --resume: {path} does not hold {', '.join(not_loaded)}")
    removed = remove_checkpoints(folder, after=step)   # this rank's steps past what every rank completed
    epoch, in_epoch = divmod(step, steps)
    say(f"resumed from {path}: global step {step} (epoch {epoch + 1 if in_epoch else epoch}, step "
        f"{in_epoch or steps} of "
        f"{steps}){f'; removed {removed} newer checkpoint(s) not every rank completed' if removed else ''}")
    return step


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.validate_only:   # run.sh's check before it launches: the Python and the data the ranks are to use
        print(f"validated: python={sys.executable}\nvalidated: data={args.data_path or ensure_digits_mnist()}")
        return 0
    ms.set_context(mode=ms.GRAPH_MODE, device_target=args.device_target)
    ms.set_seed(SEED)
    mode = resolve_parallel_mode(args.parallel_mode, args.device_target, launched_ranks())
    rank, group = setup_parallel(mode)
    data_path = args.data_path or ensure_digits_mnist()
    if args.check:
        return run_check(args, data_path, rank, group)

    drop_last = drop_remainder(mode)
    train_set = create_dataset(data_path, "train", args.batch_size, rank, group, training=True, drop_last=drop_last)
    left_out = (f", short last batch of {dropped_rows(data_path, args.batch_size, rank, group)} rows dropped (the "
                f"parallel pass needs equal micro-batches)" if drop_last else "")
    if args.max_steps:
        train_set = train_set.take(args.max_steps)
    net = Network()
    loss_fn = nn.CrossEntropyLoss()
    optimizer = nn.SGD(net.trainable_params(), args.lr)
    steps = train_set.get_dataset_size()
    if args.accumulate_steps == 1:
        model = Model(GradAccumulationCell(nn.WithLossCell(net, loss_fn), args.micro_size), optimizer=optimizer)
    else:   # windows of several batches; each epoch's last window is closed, however many batches it has
        model = Model(AccumulatingTrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer, args.accumulate_steps,
                                                   micro_size=args.micro_size, steps_per_epoch=steps))
    last = _LastLoss()
    window = f", {args.accumulate_steps} batches per optimizer step" if args.accumulate_steps > 1 else ""
    print(f"[rank {rank}] mode {mode}, {group} rank(s), data {data_path}, {steps} steps "
          f"per epoch of batch {args.batch_size} = {split_description(args.batch_size, args.micro_size)}{window}"
          f"{left_out}", flush=True)
    settings = job_settings(args, mode, group)
    start = 0 if args.no_save else prepare_checkpoints(args, model, rank, group, steps, settings)
    # Every run logs loss lines, however few steps an epoch has (8 ranks on the built-in data: 5 per epoch).
    loss_every = args.loss_every or max(1, min(100, steps))
    callbacks = [StartAt(start), AlignedLossMonitor(loss_every), last,
                 Progress(rank, args.epochs, steps, args.batch_size * group), LauncherWatch(rank)]
    if not args.no_save:
        callbacks.append(EpochAndStepCheckpoint(rank_folder(args.save_dir, rank), steps, args.save_steps,
                                                args.keep_checkpoints))
    if start < args.epochs * steps:
        train_set.set_init_step(start)   # MindSpore replays each epoch's shuffle up to there: the same data order
        model.train(args.epochs, train_set, callbacks=callbacks, dataset_sink_mode=False,
                    initial_epoch=start // steps)
    else:
        print(f"[rank {rank}] the checkpoint is the end of training ({args.epochs} epochs): nothing left to train",
              flush=True)

    test_acc, test_images = accuracy(net, create_dataset(data_path, "test", 100, 0, 1, training=False))
    loss = f"{last.loss:.6f}" if start < args.epochs * steps else "none (no step left to train)"
    print(f"[rank {rank}] final loss {loss} test accuracy {test_acc:.4f} ({test_images} images); the loss is that of "
          f"this rank's last batch", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
