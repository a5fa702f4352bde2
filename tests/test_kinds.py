"""Loss kinds as objects: a kind defined here, in the test file alone, trains exactly the full batch's update."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import nn, ops, Tensor
from mindspore.common import dtype as mstype

from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell, LossKind, RowMean, RowSum, TokenMean
from helpers import assert_params_close, assert_params_moved, make_mlp, make_optimizer, max_abs_diff, params_of

TOLERANCE = dict(rtol=1e-5, atol=1e-6)


@ms.jit_class
class WeightedRowMean(LossKind):
    """A mean over the rows weighted per row by an input of the network: ``sum(w * l) / sum(w)``. A micro-batch
    weighs the sum of its row weights; across devices the sums are added up, as the whole batch's would be."""
    sums_across_ranks = True
    description = "a mean over the rows weighted by an input"

    def __init__(self, weights_input: int):
        self.weights_input = weights_input

    def tally(self, loss, count, rows, count_unit, inputs):
        weight = ops.cast(inputs[self.weights_input], mstype.float32).sum()
        return weight, loss * weight, weight


class WeightedLoss(nn.Cell):
    """Per-row squared error of `net`, averaged with the row weights `w`."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x, y, w):
        rows = ops.square(self.net(x) - y).mean(axis=1)
        return (rows * w).sum() / w.sum()


def _batches(steps, rows, seed=5):
    rng = np.random.RandomState(seed)
    return [(rng.randn(rows, 16).astype(np.float32), rng.randn(rows, 4).astype(np.float32),
             rng.uniform(0.1, 3.0, rows).astype(np.float32)) for _ in range(steps)]


def _train(step, batches):
    return [float(step(*(Tensor(a) for a in batch)).asnumpy()) for batch in batches]


def _reference(optimizer, batches):
    net = make_mlp()
    step = nn.TrainOneStepCell(WeightedLoss(net), make_optimizer(optimizer, net.trainable_params()))
    losses = _train(step, batches)
    return params_of(net), losses


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_kinds_new_kind_in_a_test_file_trains_the_full_batch_update(optimizer):
    batches = _batches(3, 14)   # 14 rows in 4 micro-batches: 4, 4, 3, 3 (uneven: the weights are not the rows)
    expected, expected_losses = _reference(optimizer, batches)
    net = make_mlp()
    cell = GradAccumulationCell(WeightedLoss(net), micro_size=4, kind=WeightedRowMean(2))
    initial = params_of(net)
    losses = _train(nn.TrainOneStepCell(cell, make_optimizer(optimizer, net.trainable_params())), batches)
    assert_params_moved(params_of(net), initial)
    assert_params_close(params_of(net), expected, **TOLERANCE)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)

    # The same network with nothing declared: its graph shows the weights' sum (input 2), which the cell counts
    # itself, as the kind of one's own does ...
    read = make_mlp()
    undeclared = GradAccumulationCell(WeightedLoss(read), micro_size=4)
    _train(nn.TrainOneStepCell(undeclared, make_optimizer(optimizer, read.trainable_params())), batches)
    assert undeclared.kind.position == 2, undeclared.kind
    assert_params_close(params_of(read), expected, **TOLERANCE)
    # ... and without the check (negative control) it trains another update.
    control = make_mlp()
    unchecked = GradAccumulationCell(WeightedLoss(control), micro_size=4, check_loss=False)
    _train(nn.TrainOneStepCell(unchecked, make_optimizer(optimizer, control.trainable_params())), batches)
    assert max_abs_diff(params_of(control), expected) > 1e-4


@pytest.mark.slow
def test_kinds_new_kind_over_windows_of_short_batches_under_the_train_cell():
    batches = _batches(4, 6) + _batches(2, 3, seed=6)      # the last window: two 3-row batches, split 2 + 1
    windows = [tuple(np.concatenate(parts) for parts in zip(*batches[i:i + 2])) for i in (0, 2, 4)]
    expected, _ = _reference("momentum", windows)
    net = make_mlp()
    step = AccumulatingTrainOneStepCell(WeightedLoss(net), make_optimizer("momentum", net.trainable_params()), 2,
                                        micro_size=2, kind=WeightedRowMean(2))
    _train(step, batches)
    assert_params_close(params_of(net), expected, **TOLERANCE)
    assert step.pending_batches == 0


@pytest.mark.parametrize("kind, arguments", [(RowMean(), {}), (RowSum(), dict(reduction="sum")),
                                             (TokenMean(1.0), dict(per_token_loss=True, min_count=1.0)),
                                             (TokenMean(0.0, times_rows=True),
                                              dict(per_token_loss=True, reduction="sum"))])
def test_kinds_built_in_kinds_are_the_arguments_that_select_them(kind, arguments):
    from_arguments = GradAccumulationCell(WeightedLoss(make_mlp()), 2, check_loss=False, **arguments)
    given = GradAccumulationCell(WeightedLoss(make_mlp()), 2, check_loss=False, kind=kind)
    assert from_arguments.kind == given.kind == kind
    assert (given.per_token_loss, given.reduction, given.min_count) == \
        (from_arguments.per_token_loss, from_arguments.reduction, from_arguments.min_count)
    assert TokenMean(1.0) != TokenMean(2.0) and RowMean() != RowSum()   # control: equality is not vacuous


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(kind="sum"), TypeError, r"'kind' must be None or an ms_gradaccum.LossKind, but got 'sum' \(str\)"),
    (dict(kind=RowSum(), reduction="sum"), ValueError, r"'kind' is RowSum\(\), and reduction is given as well"),
    (dict(kind=TokenMean(), per_token_loss=True, min_count=1.0), ValueError,
     r"and per_token_loss, min_count is given as well"),
])
def test_kinds_bad_kind_arguments_rejected(kwargs, error, message):
    with pytest.raises(error, match=message):
        GradAccumulationCell(WeightedLoss(make_mlp()), 2, **kwargs)


def test_kinds_a_kind_given_twice_must_agree():
    cell = GradAccumulationCell(WeightedLoss(make_mlp()), 2, kind=WeightedRowMean(2))
    opt = nn.SGD(cell.network.trainable_params(), 0.1)
    assert AccumulatingTrainOneStepCell(cell, opt, 1, kind=WeightedRowMean(2)).kind == WeightedRowMean(2)
    with pytest.raises(ValueError, match=r"the argument 'kind' is WeightedRowMean\(weights_input=1\) but the "
                                         r"GradAccumulationCell given as 'network' has kind="):
        AccumulatingTrainOneStepCell(cell, opt, 1, kind=WeightedRowMean(1))


def _numbers(values) -> list:
    return [float(np.asarray(v.asnumpy() if hasattr(v, "asnumpy") else v).reshape(())) for v in values]


# The design's table (docs/design.md, "Loss kinds"), one micro-batch of 6 rows where the largest has 8 (count unit 8),
# loss 2.0, count 3.0 (where the network returns or the cells count one): (weight, value, count), then the loss and
# the divisor of a batch whose sums are value 5.0, count 2.5 over 20 rows, scale 4, devices factor 1.
_TABLE = [
    ("RowMean", RowMean(), (6 / 8, 2.0 * 6 / 8, 6 / 8), (5.0 / 2.5, 4 * 2.5)),
    ("RowSum", RowSum(), (1 / 8, 2.0 / 8, 6 / 8), (5.0 / 2.5 * 2.5 * 8, 4 * 2.5 / (2.5 * 8))),
    ("TokenMean", TokenMean(), (1.0, 2.0, 3.0), (5.0 / 2.5, 4 * 2.5)),
    ("TokenMean(min_count=4)", TokenMean(4.0), (1.0, 2.0, 3.0), (5.0 / 4.0, 4 * 4.0)),
    ("TokenMean(times_rows)", TokenMean(0.0, times_rows=True), (1.0, 2.0, 3.0), (20 * 5.0 / 2.5, 4 * 2.5 / 20)),
    ("CountedMean", None, (3 / 8, 2.0 * 3 / 8, 3 / 8), (5.0 / 2.5, 4 * 2.5)),
]


@pytest.mark.parametrize("name, kind, tally, normalised", _TABLE, ids=[row[0] for row in _TABLE])
def test_kinds_built_in_tally_and_normalise_are_the_design_table(name, kind, tally, normalised):
    # A bug in a built-in kind's arithmetic fails here, by the kind's name, not only as "your loss does not combine".
    if kind is None:
        from ms_gradaccum.core.tokens import CountedMean   # pylint: disable=import-outside-toplevel
        kind = CountedMean(("loss",))
    f32 = lambda v: Tensor(v, mstype.float32)   # noqa: E731
    got = kind.tally(f32(2.0), f32(3.0), 6, f32(8.0), ())
    np.testing.assert_allclose(_numbers(got), tally, rtol=1e-6, err_msg=f"{name}.tally")
    got = kind.normalise(f32(4.0), f32(5.0), f32(2.5), 1.0, 20, f32(8.0))
    np.testing.assert_allclose(_numbers(got), normalised, rtol=1e-6, err_msg=f"{name}.normalise")
    # Control: the comparison sees a wrong value (a RowMean weighed by rows, not rows per unit, is caught).
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(_numbers(RowMean().tally(f32(2.0), f32(3.0), 6, f32(1.0), ())), (0.75, 1.5, 0.75))


def _kind_type_branches(source: str, kinds: set) -> list:
    """Where `source` branches on a kind's type: ``isinstance(x, K)`` with K a kind class, or ``getattr(..kind.., "name"
    , default)`` (an attribute a kind may lack)."""
    import ast   # pylint: disable=import-outside-toplevel
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id == "isinstance" and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(isinstance(c, ast.Name) and c.id in kinds for c in classes):
                found.append(ast.unparse(node))
        elif node.func.id == "getattr" and len(node.args) == 3 and "kind" in ast.unparse(node.args[0]):
            found.append(ast.unparse(node))
    return found


def test_kinds_no_other_module_branches_on_a_kinds_type():
    """core/kinds.py's claim: the other modules read what a kind declares, never its type (a kind of one's own is then
    treated as what it declares)."""
    import pathlib   # pylint: disable=import-outside-toplevel
    import ms_gradaccum   # pylint: disable=import-outside-toplevel
    from ms_gradaccum.core import input_count, kinds, tokens   # pylint: disable=import-outside-toplevel
    names = {name for module in (kinds, input_count, tokens) for name, value in vars(module).items()
             if isinstance(value, type) and issubclass(value, LossKind)}
    root = pathlib.Path(ms_gradaccum.__file__).parent
    branches = {str(path.relative_to(root)): _kind_type_branches(path.read_text(), names)
                for path in root.rglob("*.py") if path.name != "kinds.py"}
    assert {path: found for path, found in branches.items() if found} == {}
    # Negative control: the branches the package used to hold are found.
    assert _kind_type_branches("if isinstance(kind, RowMean) or isinstance(f, (TokenMean, Other)):\n"
                               "    x = getattr(spec.kind, 'cells', ())\n", names) == [
        "isinstance(kind, RowMean)", "isinstance(f, (TokenMean, Other))", "getattr(spec.kind, 'cells', ())"]
