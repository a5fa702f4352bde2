"""The micro-batch loop is compiled once, not unrolled micro_size times (so compile time stays flat), and the graph
holds one copy of the network's forward and backward per micro-batch shape (compile time close to the plain step's).

Counted on the compiled graph itself (MindSpore's saved IR), not timed: the number of MatMul kernels in the
validated training graph. MindSpore's own Python-unrolled cell is the control.
"""
import glob
import os

import pytest

from launch import run_worker


# 4 Dense layers: 4 forward MatMuls and 7 backward ones (no input gradient for the first layer).
NETWORK, FORWARD = 11, 4


def matmul_count(kind: str, micro_size: int, directory: str, batch: int = 64) -> int:
    run_worker("mlp", kind, micro_size, batch, steps=1, MS_DEV_SAVE_GRAPHS="1", MS_DEV_SAVE_GRAPHS_PATH=directory)
    validated = glob.glob(os.path.join(directory, "**", "*_validate_*.ir"), recursive=True)
    # The train step's graph, and the loss contract's compile of the forward alone where it read the graph (with
    # MS_DEV_SAVE_GRAPHS set MindSpore dumps every compile): the step's holds the most MatMuls.
    assert 1 <= len(validated) <= 2, f"expected the step's validated graph IR under {directory}, found {validated}"
    counts = []
    for path in validated:
        with open(path, encoding="utf-8") as handle:
            counts.append(handle.read().count("MatMul("))
    return max(counts)


@pytest.mark.slow
def test_graph_loop_is_not_unrolled_and_holds_the_network_once(tmp_path):
    small = matmul_count("accumulate", 2, str(tmp_path / "k2"))
    large = matmul_count("accumulate", 16, str(tmp_path / "k16"))
    # Every micro-batch goes through the one loop body; the plain step holds the network once too. The loss contract's
    # check ran eagerly, before the graph compiled: nothing of it is in the graph.
    plain = matmul_count("plain", 1, str(tmp_path / "plain"))
    assert small == large == plain == NETWORK


@pytest.mark.slow
def test_graph_ragged_batch_holds_one_copy_per_micro_batch_shape(tmp_path):
    # 66 rows in 4 micro-batches: 2 of 17 rows and 2 of 16, one loop (one copy of the network) for each shape.
    assert matmul_count("accumulate", 4, str(tmp_path / "ragged"), batch=66) == 2 * NETWORK
    assert matmul_count("accumulate_steps", 4, str(tmp_path / "ragged_steps"), batch=66) == 2 * NETWORK


@pytest.mark.slow
def test_graph_train_cell_of_ones_own_holds_no_contract_check(tmp_path):
    # Inside a train cell of one's own (a subclass of nn.TrainOneStepCell, which may change its inputs), the cell cannot
    # reach the batch before the graph compiles: the contract is read from the compiled step's graph before it runs,
    # so the graph holds no forward copy of its own for it (it held one on two micro-batches, FORWARD more MatMuls).
    assert matmul_count("accumulate_in_graph", 4, str(tmp_path / "own")) == NETWORK
    assert matmul_count("accumulate_unchecked", 4, str(tmp_path / "unchecked")) == NETWORK


@pytest.mark.slow
def test_graph_unrolled_loop_is_detected(tmp_path):
    # Negative control: MindSpore's nn.GradAccumulationCell unrolls a Python for loop; the count grows.
    small = matmul_count("mindspore", 2, str(tmp_path / "k2"))
    large = matmul_count("mindspore", 16, str(tmp_path / "k16"))
    assert large > 4 * small, (small, large)
