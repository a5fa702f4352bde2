"""The micro-batch loop is compiled once, not unrolled micro_size times (so compile time stays flat).

Counted on the compiled graph itself (MindSpore's saved IR), not timed: the number of MatMul kernels in the
validated training graph must not depend on micro_size. MindSpore's own Python-unrolled cell is the control.
"""
import glob
import os

from launch import run_worker


def matmul_count(kind: str, micro_size: int, directory: str) -> int:
    run_worker("mlp", kind, micro_size, 64, steps=1, MS_DEV_SAVE_GRAPHS="1", MS_DEV_SAVE_GRAPHS_PATH=directory)
    validated = glob.glob(os.path.join(directory, "**", "*_validate_*.ir"), recursive=True)
    assert len(validated) == 1, f"expected one validated graph IR under {directory}, found {validated}"
    with open(validated[0], encoding="utf-8") as handle:
        return handle.read().count("MatMul(")


def test_graph_loop_is_not_unrolled(tmp_path):
    small = matmul_count("accumulate", 2, str(tmp_path / "k2"))
    large = matmul_count("accumulate", 16, str(tmp_path / "k16"))
    # 4 Dense layers: 4 forward MatMuls and 7 backward ones (no input gradient for the first layer), twice:
    # once in the loop body and once for micro-batch 0, which runs before the loop so that the kind of loss
    # (a mean, or (loss_sum, count)) is known when the graph compiles.
    assert small == large == 2 * 11


def test_graph_unrolled_loop_is_detected(tmp_path):
    # Negative control: MindSpore's nn.GradAccumulationCell unrolls a Python for loop; the count grows.
    small = matmul_count("mindspore", 2, str(tmp_path / "k2"))
    large = matmul_count("mindspore", 16, str(tmp_path / "k16"))
    assert large > 4 * small, (small, large)
