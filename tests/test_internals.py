"""The MindSpore internals the package relies on (ms_gradaccum/_internals.py), checked on the installed version.

CI runs this module on the lowest and the highest supported MindSpore, so each version difference handled in
_internals has a test that fails if the handling is wrong for the version at hand.
"""
import subprocess
import sys

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, Parameter, Tensor

from ms_gradaccum import _buffers, _internals
from launch import repo_env


@pytest.mark.parametrize("text, parsed", [("2.10.0", (2, 10, 0)), ("2.7.0", (2, 7, 0)), ("2.9.0rc1", (2, 9, 0)),
                                          ("2.11", (2, 11, 0))])
def test_internals_version_parsed(text, parsed):
    assert _internals.mindspore_version(text) == parsed


@pytest.mark.parametrize("text, supported", [("2.6.0", False), ("2.7.0", True), ("2.7.2", True), ("2.10.0", True),
                                             ("2.11.0", False), ("3.0.0", False)])
def test_internals_supported_range(text, supported):
    if supported:
        _internals.check_mindspore_version(text)
    else:
        with pytest.raises(ImportError, match=f"ms_gradaccum supports mindspore>=2.7.0,<2.11, but MindSpore {text} is "
                                              f"installed"):
            _internals.check_mindspore_version(text)


def test_internals_import_refuses_an_unsupported_mindspore():
    code = "import mindspore; mindspore.__version__ = '2.6.0'; import ms_gradaccum"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          env=repo_env())
    assert done.returncode == 1
    assert ("ImportError: ms_gradaccum supports mindspore>=2.7.0,<2.11, but MindSpore 2.6.0 is installed" in
            done.stderr), done.stderr[-2000:]


class _Divide(nn.Cell):
    """Divides a Parameter the way the package divides its buffers, in a graph."""

    def __init__(self, how):
        super().__init__()
        self.p = Parameter(Tensor(np.full(3, 6.0, np.float32)), name="p")
        self.how = how

    def construct(self, divisor):
        if self.how == "augmented":
            buffer = self.p
            buffer /= divisor
            return buffer
        return _buffers.divide_in_place((self.p,), divisor)[0]


def test_internals_in_place_division_flag_matches_this_mindspore():
    # `p /= d` writes the Parameter from 2.8 on and not in 2.7: the flag must say which, or the optimizer that reads
    # the buffers after the in-place all-reduce and division would see undivided sums (seen on 2.7.0).
    cell = _Divide("augmented")
    assert float(cell(Tensor(2.0, ms.float32)).asnumpy()[0]) == 3.0
    assert (float(cell.p.asnumpy()[0]) == 3.0) == _internals.AUGMENTED_ASSIGNMENT_IN_PLACE, ms.__version__


@pytest.mark.parametrize("in_place", [True, False])
def test_internals_divide_in_place_writes_the_buffer_either_way(monkeypatch, in_place):
    if in_place and not _internals.AUGMENTED_ASSIGNMENT_IN_PLACE:
        pytest.skip(f"MindSpore {ms.__version__} does not divide Parameters in place")
    monkeypatch.setattr(_buffers, "AUGMENTED_ASSIGNMENT_IN_PLACE", in_place)
    cell = _Divide("package")
    assert float(cell(Tensor(2.0, ms.float32)).asnumpy()[0]) == 3.0
    assert float(cell.p.asnumpy()[0]) == 3.0


class _ReadsAtCompile(nn.Cell):
    calls = 0

    @_internals.compile_time
    def value(self):
        type(self).calls += 1
        return float(len(self.trainable_params()) + 1)   # a call the graph parser could not compile

    def construct(self, x):
        return x * self.value


def test_internals_compile_time_attribute_is_read_in_python_when_the_graph_compiles():
    cell = _ReadsAtCompile()
    out = cell(Tensor(np.ones(2, np.float32)))
    assert out.asnumpy().tolist() == [1.0, 1.0] and _ReadsAtCompile.calls >= 1


class _Checked(nn.Cell):
    def __init__(self):
        super().__init__()
        self.compile_checks = _internals.CompileChecks(self)

    def check_at_compile(self):
        raise ValueError("the owner's own message")

    def construct(self, x):
        _internals.run_compile_checks(self.compile_checks)
        return x * 2


def test_internals_compile_checks_reach_the_user_unchanged():
    with pytest.raises(ValueError, match="the owner's own message"):
        _Checked()(Tensor(np.ones(2, np.float32)))


def test_internals_model_routes_by_class_name():
    # What ROUTED_NAMES stands for: Model picks MindSpore's accumulating train cell by cls_name.
    from mindspore.train.amp import _is_grad_accumulation  # pylint: disable=import-outside-toplevel

    class GradAccumulation(nn.Cell):
        def construct(self, x):
            return x
    assert _is_grad_accumulation(GradAccumulation()) and GradAccumulation().cls_name in _internals.ROUTED_NAMES
    assert not _is_grad_accumulation(_internals.ParallelPassMarkers(nn.Dense(2, 2), 2))


def test_internals_enclosing_cells_found_from_the_stack():
    inner = nn.Dense(2, 2)
    optimizer = nn.SGD(inner.trainable_params(), 0.1)
    wrapper = nn.TrainOneStepCell(nn.WithLossCell(inner, nn.MSELoss()), optimizer)

    class Frame(nn.Cell):
        def __init__(self, top):
            super().__init__()
            self.top = top

        def look(self):
            return _internals.enclosing_train_cell(inner), _internals.enclosing_optimizer(inner)

    assert Frame(wrapper).look() == (wrapper, optimizer)
    assert _internals.enclosing_train_cell(inner) is None and _internals.enclosing_optimizer(inner) is None


def test_internals_differentiated_weights_found_from_the_grad_call():
    # PyNative: value_and_grad's after_grad frame is on the stack while the function runs.
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        dense = nn.Dense(2, 1)
        weights = [dense.weight]
        seen = []

        def forward(x):
            seen.append(_internals.differentiated_weights())
            return dense(x).sum()

        ms.value_and_grad(forward, None, weights)(Tensor(np.ones((1, 2), np.float32)))
        assert seen and seen[0] == weights and seen[0][0] is dense.weight
        # Gradients with respect to the inputs only: no weights; and outside any grad call, nothing.
        seen.clear()
        ms.value_and_grad(forward, 0)(Tensor(np.ones((1, 2), np.float32)))
        assert seen == [None]
        assert _internals.differentiated_weights() is None
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
