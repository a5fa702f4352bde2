"""The pure arithmetic of splitting and normalising (ms_gradaccum/core/microbatch.py, ms_gradaccum/core/buffers.py),
exactly."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor

from ms_gradaccum.core.buffers import count_unit, divisor, mean_loss
from ms_gradaccum.core.kinds import RowMean
from ms_gradaccum.core.microbatch import plan


def _row_mean_counts(batch, micro_size, unit):
    """``((micro-batches, count of each), ...)`` as the default kind tallies a mean loss over `plan`'s micro-batches."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    one = Tensor(1.0, ms.float32)
    return tuple((count, float(RowMean().tally(one, one, rows, Tensor(float(unit), ms.float32), ())[2].asnumpy()))
                 for count, rows in plan(batch, micro_size))


@pytest.mark.parametrize("batch, micro_size, expected", [
    (32, 4, ((4, 8),)),                  # divisible: one part
    (30, 4, ((2, 8), (2, 7))),           # 8, 8, 7, 7: the larger first, sizes differ by one
    (7, 3, ((1, 3), (2, 2))),
    (3, 4, ((3, 1),)),                   # smaller than micro_size: one-row micro-batches
    (1, 8, ((1, 1),)),
    (100, 3, ((1, 34), (2, 33))),
    (5, 1, ((1, 5),)),
])
def test_microbatch_plan(batch, micro_size, expected):
    parts = plan(batch, micro_size)
    assert parts == expected
    assert sum(count * rows for count, rows in parts) == batch                      # no row dropped
    assert sum(count for count, _ in parts) == min(micro_size, batch)
    assert max(rows for _, rows in parts) - min(rows for _, rows in parts) <= 1


@pytest.mark.parametrize("batch, micro_size, unit", [(32, 4, 8), (30, 4, 8), (3, 4, 1), (100, 3, 34)])
def test_microbatch_count_unit_is_the_largest_micro_batch(batch, micro_size, unit):
    assert count_unit(batch, micro_size) == unit


@pytest.mark.parametrize("batch, micro_size, expected", [
    (32, 4, ((4, 1.0),)),                # evenly split: each micro-batch counts exactly 1
    (30, 4, ((2, 1.0), (2, 0.875))),     # 7-row micro-batches count 7/8
    (100, 3, ((1, 1.0), (2, 33 / 34))),
])
def test_microbatch_counts_weight_rows_by_the_unit(batch, micro_size, expected):
    counts = _row_mean_counts(batch, micro_size, count_unit(batch, micro_size))
    assert [n for n, _ in counts] == [n for n, _ in expected]
    assert [c for _, c in counts] == pytest.approx([c for _, c in expected], rel=1e-6)
    # The total count times the unit is the batch: the mean over all rows, as the full batch.
    assert sum(n * c for n, c in counts) * count_unit(batch, micro_size) == pytest.approx(batch)


def test_microbatch_counts_in_a_window_use_the_first_batch_unit():
    # A short batch of 20 rows in a window whose unit is 32 (K=1) counts 20/32: its rows, not a whole batch.
    assert _row_mean_counts(20, 1, 32) == ((1, 20 / 32),)   # 0.625: exact in float32


def test_microbatch_divisor_and_mean_loss():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    scale, factor = Tensor(1024.0, ms.float32), Tensor(2.0, ms.float32)
    assert float(divisor(scale, Tensor(4.0, ms.float32), factor).asnumpy()) == 2048.0
    assert np.isinf(divisor(scale, Tensor(0.0, ms.float32), factor).asnumpy())       # no token: gradient 0, not 0/0
    assert float(mean_loss(Tensor(6.0, ms.float32), Tensor(4.0, ms.float32)).asnumpy()) == 1.5
    assert float(mean_loss(Tensor(0.0, ms.float32), Tensor(0.0, ms.float32)).asnumpy()) == 0.0
