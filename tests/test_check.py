"""check_equivalence: PASS where accumulation is exact, FAIL with the likely cause where it is not."""
import io
import re

import numpy as np
import pytest
from mindspore import nn

from ms_gradaccum import EquivalenceReport, check_equivalence
from helpers import classification_batches, make_mlp


def _ce(reduction="mean"):
    return nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction=reduction)


def _run(make_loss_network, micro_size=4, **kwargs):
    stream = io.StringIO()
    report = check_equivalence(make_loss_network, classification_batches(3, 32), micro_size, stream=stream, **kwargs)
    return report, stream.getvalue()


def test_check_passes_for_a_mean_loss_mlp():
    report, text = _run(lambda: nn.WithLossCell(make_mlp(seed=np.random.randint(1000)), _ce()))
    assert isinstance(report, EquivalenceReport) and report.passed and bool(report)
    assert len(report.parameters) == 6
    assert all(0 <= row.relative < 1e-3 and row.max_update > 0 for row in report.parameters)
    assert re.search(r"^equivalence check: PASS \(tolerance 0.001", text, re.M), text
    assert "2.weight" in text and "likely cause" not in text


def test_check_fails_for_batch_norm_and_names_it():
    def make():
        net = nn.SequentialCell(nn.Dense(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dense(32, 4))
        return nn.WithLossCell(net, _ce())
    with pytest.warns(UserWarning, match="batch normalisation"):
        report, text = _run(make)
    assert not report.passed
    assert "equivalence check: FAIL" in text
    assert any("batch normalisation (_backbone.1 (BatchNorm1d))" in cause for cause in report.causes), report.causes


def test_check_fails_for_a_sum_loss_and_says_so():
    report, text = _run(lambda: nn.WithLossCell(make_mlp(), _ce("sum")), make_optimizer=lambda p: nn.SGD(p, 1e-4))
    assert not report.passed
    assert any("not a mean over the batch" in cause for cause in report.causes), text


def test_check_fails_for_dropout_and_names_it():
    def make():
        net = nn.SequentialCell(nn.Dense(16, 32), nn.Dropout(p=0.5), nn.ReLU(), nn.Dense(32, 4))
        return nn.WithLossCell(net, _ce())
    report, text = _run(make)
    assert not report.passed
    assert any(cause.startswith("random draws (Dropout.dropout (Dropout))") for cause in report.causes), text


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(micro_size=0), ValueError, "For 'check_equivalence', the argument 'micro_size' must be a positive int"),
    (dict(micro_size=True), TypeError, "For 'check_equivalence', the argument 'micro_size' must be a positive int"),
    (dict(batches=[]), ValueError, "the argument 'batches' must hold at least one batch"),
    (dict(tolerance=0), ValueError, "the argument 'tolerance' must be a positive float, but got 0"),
])
def test_check_bad_arguments_rejected(kwargs, error, message):
    arguments = dict(make_loss_network=lambda: nn.WithLossCell(make_mlp(), _ce()),
                     batches=classification_batches(1, 8), micro_size=2)
    arguments.update(kwargs)
    with pytest.raises(error, match=re.escape(message)):
        check_equivalence(**arguments)
