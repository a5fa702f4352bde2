"""Data parallel on CPU with 2 processes started by msrun: ranks identical, equal to one process on the
concatenated global batch, and gradients all-reduced once per optimizer step whatever micro_size is."""
import glob
import os
import subprocess
import sys

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor

from dp_worker import MAX_GRAD_NORM

from helpers import (assert_params_close, assert_params_moved, ce, ClippedStep, make_mlp, make_optimizer,
                     make_token_net, max_abs_diff, params_of, TokenLoss, train_steps, ZerosLikeLoss)
from launch import msrun, repo_env, side_by_side

pytestmark = [pytest.mark.lowest, pytest.mark.multiprocess, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "dp_worker.py")
RANKS = 2


# The module's msrun jobs: (task, parallel mode) for dp_worker.py.
JOBS = {"data_parallel": ("train", "data_parallel"), "stand_alone": ("train_model", "stand_alone"),
        "graphs": ("graphs", "data_parallel")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each job's output folder; the jobs run side by side (a failed one raises with its ranks' log tails)."""
    outs = {name: tmp_path_factory.mktemp(f"{task}_{mode}") for name, (task, mode) in JOBS.items()}
    side_by_side({name: (msrun, (WORKER, [str(out), *JOBS[name]], RANKS, str(out / "logs")))
                  for name, out in outs.items()})
    return outs


def _load_ranks(out):
    return [dict(np.load(out / f"rank_{rank}.npz")) for rank in range(RANKS)]


def _params(rank_arrays, prefix):
    return {key.split(":", 1)[1]: value for key, value in rank_arrays.items() if key.startswith(prefix + ":")}


@pytest.fixture(scope="module")
def data_parallel(launched):
    return _load_ranks(launched["data_parallel"])


@pytest.fixture(scope="module")
def stand_alone(launched):
    return _load_ranks(launched["stand_alone"])


def _single_process_reference(ranks, prefix, optimizer, loss=lambda net: nn.WithLossCell(net, ce())):
    """One process, plain nn.TrainOneStepCell, on each step's global batch: the ranks' batches concatenated."""
    global_batches = [(np.concatenate([r[f"{prefix}_x"][step] for r in ranks]),
                       np.concatenate([r[f"{prefix}_y"][step] for r in ranks]))
                      for step in range(len(ranks[0][f"{prefix}_x"]))]
    net = make_mlp()
    loss_net = loss(net)
    losses = train_steps(nn.TrainOneStepCell(loss_net, make_optimizer(optimizer, net.trainable_params())),
                         global_batches)
    return params_of(net), losses


@pytest.mark.parametrize("path", ["model", "loop", "steps", "bprop"])
def test_data_parallel_ranks_are_bit_identical(data_parallel, path):
    rank0, rank1 = (_params(r, f"{path}_param") for r in data_parallel)
    assert_params_close(rank1, rank0, rtol=0, atol=0)
    assert not np.array_equal(data_parallel[0][f"{path}_x"], data_parallel[1][f"{path}_x"]), "shards must differ"


@pytest.mark.parametrize("path, optimizer", [("model", "momentum"), ("loop", "adam")])
def test_data_parallel_matches_single_process_on_global_batch(data_parallel, path, optimizer):
    expected, expected_losses = _single_process_reference(data_parallel, path, optimizer)
    actual = _params(data_parallel[0], f"{path}_param")
    assert_params_moved(actual, _params(data_parallel[0], "initial"))
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    # Each rank reports its own shard's mean loss; their mean is the global batch's loss.
    rank_mean = np.mean([r[f"{path}_losses"] for r in data_parallel], axis=0)
    np.testing.assert_allclose(rank_mean, expected_losses, rtol=1e-5)


def test_data_parallel_bprop_calling_zeros_like_matches_single_process_on_global_batch(data_parallel):
    # MindFormers' pattern (a bprop calling mindspore.ops.zeros_like) through GradAccumulationCell in graph mode.
    expected, expected_losses = _single_process_reference(data_parallel, "bprop", "momentum", ZerosLikeLoss)
    actual = _params(data_parallel[0], "bprop_param")   # named net.* by ZerosLikeLoss, as the reference's are
    assert_params_moved(actual, {f"net.{name}": value for name, value in _params(data_parallel[0], "initial").items()})
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.mean([r["bprop_losses"] for r in data_parallel], axis=0), expected_losses, rtol=1e-5)


def test_data_parallel_recognised_token_mean_is_the_global_batch_token_mean(data_parallel):
    # nn.CrossEntropyLoss told nothing, rank 0 ignoring every 2nd label, rank 1 every 3rd: the ranks equal one process
    # on the global batch (its mean over all valid labels), every rank reporting its loss. Control: plain data
    # parallel's mean of the ranks' means.
    expected, expected_losses = _single_process_reference(data_parallel, "ce", "momentum",
                                                          lambda net: nn.WithLossCell(net, nn.CrossEntropyLoss()))
    rank0, rank1 = (_params(r, "ce_param") for r in data_parallel)
    assert_params_close(rank1, rank0, rtol=0, atol=0)
    assert_params_moved(rank0, _params(data_parallel[0], "initial"))
    assert_params_close(rank0, expected, rtol=1e-5, atol=1e-6)
    for rank in data_parallel:
        np.testing.assert_allclose(rank["ce_losses"], expected_losses, rtol=1e-5)
    net = make_mlp()
    control = nn.TrainOneStepCell(_MeanOfRankMeans(net, lambda: nn.CrossEntropyLoss()),
                                  make_optimizer("momentum", net.trainable_params()))
    for step in range(len(data_parallel[0]["ce_x"])):
        control(*(Tensor(r[f"ce_{name}"][step]) for r in data_parallel for name in ("x", "y")))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(params_of(net), expected, rtol=1e-5, atol=1e-6)


def test_data_parallel_accumulating_steps_match_single_process_on_global_window(data_parallel):
    # Each window: 4 consecutive batches on each of 2 ranks = one global batch of all 8, in one process.
    per_rank = [(r["steps_x"], r["steps_y"]) for r in data_parallel]
    windows = len(per_rank[0][0]) // 4
    global_batches = [(np.concatenate([xs[w * 4:(w + 1) * 4].reshape(-1, xs.shape[-1]) for xs, _ in per_rank]),
                       np.concatenate([ys[w * 4:(w + 1) * 4].reshape(-1) for _, ys in per_rank]))
                      for w in range(windows)]
    net = make_mlp()
    loss_net = nn.WithLossCell(net, ce())
    train_steps(nn.TrainOneStepCell(loss_net, make_optimizer("momentum", net.trainable_params())), global_batches)
    actual = _params(data_parallel[0], "steps_param")
    assert_params_moved(actual, _params(data_parallel[0], "initial"))
    assert_params_close(actual, params_of(net), rtol=1e-5, atol=1e-6)


class _ClipEachRank(nn.Cell):
    """Control: each rank clips its own shard's gradient, then the clipped gradients are averaged."""

    def __init__(self, loss_net, optimizer, max_norm):
        super().__init__(auto_prefix=False)
        self.loss_net, self.optimizer, self.max_norm = loss_net, optimizer, max_norm
        self.weights = optimizer.parameters

    def construct(self, x0, y0, x1, y1):
        _, g0 = ms.value_and_grad(self.loss_net, None, self.weights)(x0, y0)
        _, g1 = ms.value_and_grad(self.loss_net, None, self.weights)(x1, y1)
        g0 = ops.clip_by_global_norm(g0, self.max_norm)
        g1 = ops.clip_by_global_norm(g1, self.max_norm)
        mean = ()
        for a, b in zip(g0, g1):
            mean += ((a + b) / 2,)
        return self.optimizer(mean)


def test_data_parallel_clipping_after_all_reduce_matches_single_process(data_parallel):
    # The loop batches under AccumulatingTrainOneStepCell(GradAccumulationCell(.., 4), sgd, 1,
    # scale_sense=1024, max_grad_norm=0.05): the global batch's gradient clipped once, in one process.
    steps = len(data_parallel[0]["loop_x"])
    global_batches = [(np.concatenate([r["loop_x"][s] for r in data_parallel]),
                       np.concatenate([r["loop_y"][s] for r in data_parallel])) for s in range(steps)]
    net = make_mlp()
    ref = ClippedStep(nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()), MAX_GRAD_NORM)
    for x, y in global_batches:
        ref(Tensor(x), Tensor(y))
    rank0, rank1 = (_params(r, "clip_param") for r in data_parallel)
    assert_params_close(rank1, rank0, rtol=0, atol=0)
    assert_params_moved(rank0, _params(data_parallel[0], "initial"))
    assert_params_close(rank0, params_of(net), rtol=1e-5, atol=1e-6)

    # Negative control: clipping each rank's gradient before the reduction is a different update.
    control_net = make_mlp()
    control = _ClipEachRank(nn.WithLossCell(control_net, ce()), make_optimizer("sgd", control_net.trainable_params()),
                            MAX_GRAD_NORM)
    for s in range(steps):
        control(*(Tensor(r[f"loop_{v}"][s]) for r in data_parallel for v in "xy"))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(params_of(control_net), params_of(net), rtol=1e-5, atol=1e-6)


def _global_token_batches(ranks, steps):
    return [tuple(np.concatenate([r[f"token_{name}"][s] for r in ranks]) for name in ("x", "y", "mask"))
            for s in steps]


def _token_reference(batches, mode="mean"):
    net = make_token_net()
    losses = train_steps(nn.TrainOneStepCell(TokenLoss(net, mode), make_optimizer("sgd", net.trainable_params())),
                         batches)
    return params_of(net), losses


def test_data_parallel_token_loss_is_the_global_token_mean(data_parallel):
    # Ranks with 28 and 24 valid tokens per batch: one process on the concatenated batch, divided by all 52.
    steps = range(len(data_parallel[0]["token_x"]))
    expected, expected_losses = _token_reference(_global_token_batches(data_parallel, steps))
    rank0, rank1 = (_params(r, "token_param") for r in data_parallel)
    assert_params_close(rank1, rank0, rtol=0, atol=0)
    assert_params_moved(rank0, params_of(make_token_net()))
    assert_params_close(rank0, expected, rtol=1e-5, atol=1e-6)
    for rank in data_parallel:      # every rank reports the global token mean
        np.testing.assert_allclose(rank["token_losses"], expected_losses, rtol=1e-5)

    # Negative control: the mean of the per-rank token means (each rank normalising by its own count).
    control_net = make_token_net()
    control = nn.TrainOneStepCell(_MeanOfRankMeans(control_net), make_optimizer("sgd", control_net.trainable_params()))
    for s in steps:
        control(*(Tensor(r[f"token_{name}"][s]) for r in data_parallel for name in ("x", "y", "mask")))
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(params_of(control_net), expected, rtol=1e-5, atol=1e-6)


def test_data_parallel_token_windows_divide_by_the_global_window_count(data_parallel):
    steps = range(len(data_parallel[0]["token_x"]))
    global_batches = _global_token_batches(data_parallel, steps)
    windows = [tuple(np.concatenate(parts) for parts in zip(global_batches[i], global_batches[i + 1])) for i in (0, 2)]
    expected, expected_losses = _token_reference(windows)
    actual = _params(data_parallel[0], "window_param")
    assert_params_close(_params(data_parallel[1], "window_param"), actual, rtol=0, atol=0)
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert float(data_parallel[0]["window_last_loss"]) == pytest.approx(expected_losses[-1], rel=1e-5)


class _MeanOfRankMeans(nn.Cell):
    """Plain data parallel's loss: the mean of each rank's own mean (a token loss's, or a loss_fn's on a row net)."""

    def __init__(self, net, loss_fn=None):
        super().__init__(auto_prefix=False)
        self.loss = TokenLoss(net, "mean") if loss_fn is None else nn.WithLossCell(net, loss_fn())

    def construct(self, *inputs):
        half = len(inputs) // 2
        return (self.loss(*inputs[:half]) + self.loss(*inputs[half:])) / 2


def test_data_parallel_without_data_parallel_mode_ranks_diverge(stand_alone):
    # Negative control: the same launch without DATA_PARALLEL reduces nothing, so the ranks drift apart
    # and neither equals the global-batch reference.
    rank0, rank1 = (_params(r, "model_param") for r in stand_alone)
    assert max_abs_diff(rank1, rank0) > 1e-3
    expected, _ = _single_process_reference(stand_alone, "model", "momentum")
    with pytest.raises(AssertionError, match="differs from the reference"):
        assert_params_close(rank0, expected, rtol=1e-5, atol=1e-6)


def _all_reduce_counts(out, name):
    counts = []
    for path in sorted(glob.glob(str(out / "graphs" / name / "**" / "*_validate_*.ir"), recursive=True)):
        with open(path, encoding="utf-8") as handle:
            counts.append(handle.read().count("AllReduce("))
    assert len(counts) == RANKS, f"expected one validated graph per rank for {name}, got {counts}"
    return counts


def test_data_parallel_all_reduces_per_step_do_not_grow_with_micro_size(launched):
    out = launched["graphs"]
    plain = _all_reduce_counts(out, "plain")
    # The MLP has 6 parameters: DistributedGradReducer all-reduces each once, outside the micro-batch loop.
    assert plain == [6] * RANKS
    assert _all_reduce_counts(out, "micro_2") == plain
    assert _all_reduce_counts(out, "micro_8") == plain
    # Control: a collective inside the micro-batch forward shows up in the count: the loop body's copy of the network
    # (the loss contract's pass ran eagerly on each rank, collective included, before the graph: not in it).
    assert _all_reduce_counts(out, "control_micro_2") == [7] * RANKS
    # AccumulatingTrainOneStepCell: the reducer sits only in the window-closing branch, once per weight.
    assert _all_reduce_counts(out, "steps_4") == plain


@pytest.fixture(scope="module")
def unseeded(launched, tmp_path_factory):
    outs = {task: tmp_path_factory.mktemp(task) for task in ("unseeded", "unseeded_plain")}
    side_by_side({task: (msrun, (WORKER, [str(out), task, "data_parallel"], RANKS, str(out / "logs")))
                  for task, out in outs.items()})
    return outs


def test_data_parallel_ranks_starting_apart_stop_at_the_first_step(unseeded):
    for rank in range(RANKS):
        failures = (unseeded["unseeded"] / f"rank_{rank}.txt").read_text(encoding="utf-8").splitlines()
        assert len(failures) == 2, failures
        for name, failure in zip(("GradAccumulationCell", "AccumulatingTrainOneStepCell"), failures):
            assert failure.startswith(f"{name} raised: For '{name}', data-parallel ranks must start from the same "
                                      f"weights, but parameter '0.weight' differs between rank 0 and rank 1"), failure
            assert "mindspore.set_seed" in failure and failure.endswith("(weights unchanged: True)"), failure


def test_data_parallel_ranks_starting_apart_diverge_silently_in_plain_training(unseeded):
    # Negative control: the same unseeded job with nn.TrainOneStepCell trains on without an error, as two models.
    rank0, rank1 = (dict(np.load(unseeded["unseeded_plain"] / f"rank_{rank}.npz")) for rank in range(RANKS))
    assert max_abs_diff(rank1, rank0) > 1e-2


def test_data_parallel_without_init_is_a_clear_error(tmp_path):
    # In a fresh process (MindSpore segfaults at the first step without init(); here the cell refuses first).
    done = subprocess.run([sys.executable, WORKER, str(tmp_path), "no_init", "data_parallel"], capture_output=True,
                          text=True, timeout=300, check=False,
                          env=repo_env(GLOG_v="3"))
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert ("RuntimeError: For 'GradAccumulationCell', the parallel mode is data_parallel but "
            "mindspore.communication.init() has not been called") in done.stderr, done.stderr[-2000:]


def test_data_parallel_batch_norm_per_step_moves_each_rank_as_plain_data_parallel(data_parallel):
    # Plain data parallel normalises each rank's own batch: with batch_norm='per_step' each rank's moving statistics
    # move once per step from its own micro-batches combined, as the plain step on that rank's batch moves them.
    for rank, arrays in enumerate(data_parallel):
        plain, accumulated = _params(arrays, "bn_plain"), _params(arrays, "bn_accu")
        assert sorted(plain) == sorted(accumulated) and len(plain) == 4, sorted(plain)
        first = [name for name in plain if name.startswith("1.")]   # the first BatchNorm layer
        assert len(first) == 2, sorted(plain)
        for name in first:
            assert np.abs(plain[name] - accumulated[name]).max() < 2e-6, (rank, name)
    # The ranks' batches differ, so do their statistics (each rank its own, as plain data parallel).
    name = next(name for name in _params(data_parallel[0], "bn_plain") if "moving_mean" in name)
    assert np.abs(_params(data_parallel[0], "bn_plain")[name] - _params(data_parallel[1], "bn_plain")[name]).max() > 0.1
