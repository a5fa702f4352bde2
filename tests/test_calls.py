"""What a step runs of the package's Python (diagnostics.calls): after the first call, a GRAPH_MODE call runs the step
counter alone (and AccumulatingTrainOneStepCell's own __call__); a plain cell compiled afterwards runs nothing of the
package; no call reads a frame. Counted with sys.setprofile, as benchmarks/call_probe.py."""
import json
import os
import subprocess
import sys

import mindspore as ms
import pytest
from mindspore import nn, Tensor

import ms_gradaccum
from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
from helpers import ce, classification_batches, make_mlp, make_optimizer
from launch import repo_env

PACKAGE = os.path.dirname(os.path.abspath(ms_gradaccum.__file__))


def _run_counting(cell, x, y) -> tuple:
    """``(package functions entered, frames the package read)`` while ``cell(x, y)`` runs (its result read)."""
    functions, frames = [], []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            functions.append(frame.f_code.co_name)
        elif event == "c_call" and getattr(arg, "__name__", "") == "_getframe" and \
                frame.f_code.co_filename.startswith(PACKAGE):   # MindSpore's own logging reads frames too
            frames.append(arg)
    sys.setprofile(profile)
    try:
        cell(x, y).asnumpy()
    finally:
        sys.setprofile(None)
    return functions, len(frames)


def _step(which: str, check_loss: bool = True):
    net = make_mlp()
    loss_net = nn.WithLossCell(net, ce())
    opt = make_optimizer("sgd", net.trainable_params())
    if which == "GradAccumulationCell":
        return nn.TrainOneStepCell(GradAccumulationCell(loss_net, 4, check_loss=check_loss), opt)
    return AccumulatingTrainOneStepCell(loss_net, opt, 2, micro_size=4, check_loss=check_loss)


def _graph_counts() -> None:
    """Run in a fresh process (no package cell of another test waiting for its first compile): prints, per cell and
    check_loss, the package functions of the first call, of a steady one (step 3: no re-check is due) and of a plain
    train cell's first and second call afterwards."""
    ms.set_context(mode=ms.GRAPH_MODE)
    x, y = (Tensor(a) for a in classification_batches(1, 32)[0])
    found = {}
    for which in ("GradAccumulationCell", "AccumulatingTrainOneStepCell"):
        for check_loss in (True, False):
            step = _step(which, check_loss)
            first, _ = _run_counting(step, x, y)
            step(x, y).asnumpy()   # step 2: a re-check is due
            steady, frames = _run_counting(step, x, y)
            net = make_mlp()
            plain = nn.TrainOneStepCell(nn.WithLossCell(net, ce()), make_optimizer("sgd", net.trainable_params()))
            plain_first, _ = _run_counting(plain, x, y)
            plain_steady, _ = _run_counting(plain, x, y)
            found[f"{which} {check_loss}"] = [len(set(first)), steady, frames, plain_first, plain_steady]
    print("COUNTS", json.dumps(found))


@pytest.mark.slow
def test_calls_a_steady_graph_call_runs_no_package_function():
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path[:0] = [{here!r}, {os.path.join(here, 'tools')!r}]; import test_calls; " \
           f"test_calls._graph_counts()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False,
                          env=repo_env(GLOG_v="3"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    found = json.loads(done.stdout.split("COUNTS ", 1)[1])
    for key, (first, steady, frames, plain_first, plain_steady) in found.items():
        assert first > 20, (key, first)   # control: the first call (the compile) runs the package's checks
        # No step counter any more: the package cell inside a train cell runs nothing; AccumulatingTrainOneStepCell,
        # the cell called, its __call__ alone (PyNative's probe entry, a mode test in graph mode).
        expected = [] if key.startswith("GradAccumulationCell") else ["__call__"]
        assert steady == expected and frames == 0, (key, steady)
        # A plain train cell compiled afterwards runs nothing of the package, its compile neither.
        assert plain_first == plain_steady == [], (key, plain_first, plain_steady)


def test_calls_no_pynative_call_reads_a_frame():
    # PyNative mode hands over no root: the cell binds from its arguments (0.3.0 read the stack on the first call).
    ms.set_context(mode=ms.PYNATIVE_MODE)
    x, y = (Tensor(a) for a in classification_batches(1, 32)[0])
    step = _step("GradAccumulationCell")
    first, first_frames = _run_counting(step, x, y)
    step(x, y).asnumpy()
    functions, frames = _run_counting(step, x, y)
    assert first_frames == frames == 0 and first and functions, (first, functions)
    # Control: the counter sees a frame read by the package where there is one.
    code = compile("lambda *args: Tensor(sys._getframe(0).f_lineno)", os.path.join(PACKAGE, "probe.py"), "eval")
    assert _run_counting(eval(code, {"Tensor": Tensor, "sys": sys}), x, y)[1] == 1  # pylint: disable=eval-used
