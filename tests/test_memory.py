"""Peak memory follows the micro-batch: measured from MindSpore's memory pool in fresh processes.

The pool does not hold Parameters, so where parameters (and buffers held as Parameters) matter, memory is the
pool peak plus the bytes of every Parameter the train cell holds.
"""
import re

import pytest

from launch import run_worker, run_worker_ranks, side_by_side

BATCH = 16384


def _pool_peak_mb(output: str) -> int:
    # The larger of the pool's "peak used mem" and its "actual peak used mem" (which counts fragmentation).
    peaks = [int(v) for v in re.findall(r"peak used mem:(\d+)M", output)]
    assert peaks, f"no 'peak used mem' line from MindSpore's pool statistics:\n{output[-3000:]}"
    return max(peaks)


STATISTICS = dict(MS_DEV_RUNTIME_CONF="memory_statistics:True")


def pool_peak_mb(kind: str, micro_size: int) -> int:
    """MindSpore's reported pool peak, in MB, for training steps on the activation-heavy MLP."""
    return _pool_peak_mb(run_worker("mlp", kind, micro_size, BATCH, **STATISTICS)[1])


def footprint_mb(kind: str, micro_size: int, batch: int, log_dir: str = ""):
    """(pool peak + bytes of the train cell's Parameters, bytes of the weights), in MB, on the parameter-heavy MLP
    (three 1024 x 1024 Dense layers, 12 MB). With `log_dir`, measured on rank 0 of a 2-rank data-parallel run."""
    if log_dir:
        result, output = run_worker_ranks("wide1024", kind, micro_size, batch, log_dir, **STATISTICS)
    else:
        result, output = run_worker("wide1024", kind, micro_size, batch, **STATISTICS)
    return _pool_peak_mb(output) + result["param_mb"], result["weight_mb"], result["param_mb"]


@pytest.fixture(scope="module")
def plain_peak():
    return pool_peak_mb("plain", 1)


@pytest.mark.slow
def test_memory_micro_size_8_peak_at_least_3x_below_full_batch(plain_peak):
    accumulated = pool_peak_mb("accumulate", 8)
    assert plain_peak >= 3 * accumulated, f"plain full batch {plain_peak}M vs micro_size=8 {accumulated}M"


@pytest.mark.slow
def test_memory_micro_size_1_costs_about_what_full_batch_costs(plain_peak):
    # Sanity check of the measurement itself: without splitting there is nothing to save.
    accumulated = pool_peak_mb("accumulate", 1)
    assert 0.8 * plain_peak <= accumulated <= 1.3 * plain_peak, (plain_peak, accumulated)


@pytest.mark.slow
def test_memory_parameter_heavy_model_costs_under_three_quarters_of_a_parameter_size():
    # Three 1024 x 1024 Dense layers (12 MB of weights), micro-batches of 16: here the gradient-sized buffers,
    # not the activations, decide memory. The floor is a plain step on one micro-batch. The code before this
    # test cost 1.67x the weights above it; now about 0.34x (GradAccumulationCell, and AccumulatingTrainOneStepCell
    # with micro_size=8: the accumulator, less the gradients a plain step holds all at once) and 0.0x
    # (AccumulatingTrainOneStepCell over 8 calls, whose window's mean, unscaling and reset are in place). The issue
    # asked for under 1.25x; the bound here is tighter, 0.75x, so that a second gradient-sized copy coming back fails.
    floor, weights, floor_parameters = footprint_mb("plain", 1, 16)
    for kind, micro_size, batch in (("accumulate", 8, 128), ("accumulate_steps", 8, 128), ("steps", 8, 128)):
        total, _, parameters = footprint_mb(kind, micro_size, batch)
        # The buffers are counted (they are created when the graph compiles: counted before it, they were not).
        assert parameters >= floor_parameters + 0.99 * weights, (kind, parameters, floor_parameters, weights)
        overhead = (total - floor) / weights
        message = f"{kind} K={micro_size}: {total:.1f} MB vs floor {floor:.1f} MB = {overhead:.2f}x the weights"
        assert overhead < 0.75, message


@pytest.mark.slow
def test_memory_parameter_heavy_model_data_parallel(tmp_path):
    # The same model on 2 ranks (rank 0 measured). GradAccumulationCell trained by AccumulatingTrainOneStepCell
    # (accumulate_steps=1), which all-reduces the buffers in place, one after another, and whose optimizer reads
    # them: measured +0.67x (pool 8 MB against the plain step's 12 MB, plus the 12 MB accumulator); +1.33x
    # before. Inside a stock nn.TrainOneStepCell the cell hands its buffers to that cell's reducer, whose reduced
    # copies all exist before the optimizer's first update: +1.33x here, which misses the 1.0x of issue 9
    # (docs/measurements.md says why: a MindSpore limit); that bound only keeps a further gradient-sized copy out.
    # The three runs are separate processes, so they run side by side (each reports its own pool peak).
    runs = {"floor": ("plain", 1, 16), "accumulate_steps": ("accumulate_steps", 8, 128),
            "accumulate": ("accumulate", 8, 128)}
    results = side_by_side({name: (footprint_mb, (*args, str(tmp_path / name))) for name, args in runs.items()})
    floor, weights, _ = results["floor"]
    for kind, bound in (("accumulate_steps", 1.0), ("accumulate", 1.5)):
        total = results[kind][0]
        overhead = (total - floor) / weights
        message = f"data parallel, {kind} K=8: {total:.1f} MB vs floor {floor:.1f} MB = {overhead:.2f}x the weights"
        assert overhead < bound, message
