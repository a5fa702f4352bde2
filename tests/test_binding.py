"""What a package cell trains with is bound outside any compile (ms_gradaccum.cells.binding): at construction, and
before the compile it waits for, from the root MindSpore hands that compile; a compile changes no Parameter and no
cell of the tree it compiles."""
import mindspore as ms
import pytest
from mindspore import nn, Tensor

from ms_gradaccum import GradAccumulationCell
from ms_gradaccum._mindspore.patches import CELL_GRAPH_EXECUTOR, GRAPH_COMPILE
from ms_gradaccum.cells import compile_hook
from helpers import assert_params_close, ce, classification_batches, make_mlp, make_optimizer, params_of, train_steps

K = 4
FIRST = ("0.weight", "0.bias")


def _tree(root: nn.Cell) -> tuple:
    """Every Parameter (by its name) and cell (by its path) of `root`'s tree, with its identity."""
    return (tuple((param.name, id(param)) for _, param in root.parameters_and_names()),
            tuple((name, id(cell)) for name, cell in root.cells_and_names()))


@pytest.fixture
def compiles(monkeypatch):
    """``[(root, tree before MindSpore's compile, tree after it), ...]`` of every compile from here on, recorded
    inside the package's compile hook (the hook wraps this recorder): what MindSpore's compile itself saw change."""
    compile_hook._WAITING.clear()   # pylint: disable=protected-access
    GRAPH_COMPILE.uninstall()       # no hook of an earlier test's cell outside the recorder
    seen = []
    original = CELL_GRAPH_EXECUTOR.compile

    def recorded(obj, *args, **kwargs):
        before = _tree(obj)
        result = original(obj, *args, **kwargs)
        seen.append((obj, before, _tree(obj)))
        return result

    monkeypatch.setattr(CELL_GRAPH_EXECUTOR, "compile", recorded)
    yield seen
    compile_hook._WAITING.clear()   # pylint: disable=protected-access
    GRAPH_COMPILE.uninstall()       # before the recorder is taken away


def test_binding_changes_nothing_while_a_graph_compiles_and_follows_a_new_train_cell(compiles):
    ms.set_context(mode=ms.GRAPH_MODE)
    batches = classification_batches(6, 32)

    def staged(wrap):
        net = make_mlp()
        loss_net = wrap(nn.WithLossCell(net, ce()))
        first = nn.TrainOneStepCell(loss_net, make_optimizer("sgd", net.trainable_params()))
        train_steps(first, batches[:3])
        for param in net.get_parameters():
            if param.name in FIRST:
                param.requires_grad = False
        second = nn.TrainOneStepCell(loss_net, make_optimizer("sgd", net.trainable_params()))
        train_steps(second, batches[3:])
        return params_of(net), first, second

    expected, _, _ = staged(lambda loss_net: loss_net)
    compiles.clear()
    actual, first, second = staged(lambda loss_net: GradAccumulationCell(loss_net, K))
    assert_params_close(actual, expected, rtol=1e-5, atol=1e-6)
    roots = [root for root, _, _ in compiles]
    assert first in roots and second in roots, roots   # control: both train cells compiled under the recorder
    for root, before, after in compiles:
        assert before == after, type(root).__name__
    # Control: the trees did change, between the compiles: the frozen layer's buffer was dropped before the second.
    buffers = [{name for name, _ in tree[0] if name.startswith("accu_grads.")}
               for root, tree, _ in compiles if root in (first, second)]
    assert {f"accu_grads.{name}" for name in FIRST} <= buffers[0]
    assert not {f"accu_grads.{name}" for name in FIRST} & buffers[-1]
    assert not GRAPH_COMPILE.installed   # no cell waits any more: the hook is gone


def test_binding_a_cell_bound_from_a_root_keeps_its_surroundings_and_a_foreign_tree_binds_nothing():
    net = make_mlp()
    cell = GradAccumulationCell(nn.WithLossCell(net, ce()), K)
    optimizer = make_optimizer("sgd", [p for p in net.trainable_params() if p.name.startswith("4.")])
    step = nn.TrainOneStepCell(cell, optimizer, sens=8.0)
    assert cell.bind(step)
    assert cell.surroundings.train_cell is step and cell.surroundings.optimizer is optimizer
    assert [w.name for w in cell.weights] == ["4.weight", "4.bias"] and cell.loss_scale.value == 8.0
    assert sorted(b.name for b in cell.accu_grads) == ["accu_grads.4.bias", "accu_grads.4.weight"]
    other = nn.TrainOneStepCell(nn.WithLossCell(make_mlp(), ce()), make_optimizer("sgd", make_mlp().trainable_params()))
    assert not cell.bind(other) and cell.surroundings.train_cell is step   # nothing bound from a tree without it
    cell.rebind()   # from its arguments: nothing around, every weight with requires_grad=True
    assert cell.surroundings.train_cell is None and len(cell.weights) == len(net.trainable_params())
    x, y = (Tensor(a) for a in classification_batches(1, 32)[0])
    step(x, y)   # the compile it waited for binds it from its root again
    assert cell.surroundings.train_cell is step and [w.name for w in cell.weights] == ["4.weight", "4.bias"]
