"""Peak memory follows the micro-batch: measured from MindSpore's memory pool in fresh processes."""
import re

import pytest

from probe import run_train_probe

BATCH = 16384


def pool_peak_mb(kind: str, micro_size: int) -> int:
    """MindSpore's reported pool peak, in MB, for two training steps of the probe."""
    output = run_train_probe(kind, micro_size, BATCH, MS_DEV_RUNTIME_CONF="memory_statistics:True")
    peaks = [int(v) for v in re.findall(r"peak used mem:(\d+)M", output)]
    assert peaks, f"no 'peak used mem' line from MindSpore's pool statistics:\n{output[-3000:]}"
    return max(peaks)


@pytest.fixture(scope="module")
def plain_peak():
    return pool_peak_mb("plain", 1)


def test_memory_micro_size_8_peak_at_least_3x_below_full_batch(plain_peak):
    accumulated = pool_peak_mb("accumulate", 8)
    assert plain_peak >= 3 * accumulated, f"plain full batch {plain_peak}M vs micro_size=8 {accumulated}M"


def test_memory_micro_size_1_costs_about_what_full_batch_costs(plain_peak):
    # Sanity check of the measurement itself: without splitting there is nothing to save.
    accumulated = pool_peak_mb("accumulate", 1)
    assert 0.8 * plain_peak <= accumulated <= 1.3 * plain_peak, (plain_peak, accumulated)
