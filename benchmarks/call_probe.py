"""Which of the package's Python functions run on a step, counted with ``sys.setprofile`` (no timing: exact counts).

    python benchmarks/call_probe.py            # GRAPH_MODE
    python benchmarks/call_probe.py --pynative

Prints, for ``nn.TrainOneStepCell(GradAccumulationCell(...))`` and ``AccumulatingTrainOneStepCell`` on a small MLP:
the package functions a steady call runs (the third call; no check is due on it), the frames read per call, the
package functions a plain ``nn.TrainOneStepCell`` compiled afterwards in the same process runs on its first and on a
steady call, and the package functions and modules one whole step runs (construction and three calls), with
``check_loss=False`` and ``True``.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
PACKAGE = os.path.join(os.path.dirname(HERE), "ms_gradaccum")


class Calls:
    """The package functions entered while it is active (a set of ``module:function``), and how often the package read
    a frame (``sys._getframe``)."""

    def __init__(self):
        self.functions, self.calls, self.frame_reads = set(), 0, 0

    def __enter__(self):
        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
                name = os.path.relpath(frame.f_code.co_filename, PACKAGE)
                self.functions.add(f"{name}:{frame.f_code.co_name}")
                self.calls += 1
            elif event == "c_call" and getattr(arg, "__name__", "") == "_getframe" and \
                    frame.f_code.co_filename.startswith(PACKAGE):   # the package's (MindSpore's logging reads some)
                self.frame_reads += 1
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    @property
    def modules(self) -> set:
        return {name.split(":")[0] for name in self.functions}


def _data(seed: int = 0):
    import mindspore as ms
    rng = np.random.default_rng(seed)
    return (ms.Tensor(rng.standard_normal((32, 16)).astype(np.float32)),
            ms.Tensor(rng.integers(0, 4, 32).astype(np.int32)))


def _net():
    from mindspore import nn
    return nn.SequentialCell(nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4))


def _step(which: str, check_loss: bool):
    from mindspore import nn
    from ms_gradaccum import AccumulatingTrainOneStepCell, GradAccumulationCell
    net = _net()
    loss_net = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))
    opt = nn.SGD(net.trainable_params(), 0.01)
    if which == "GradAccumulationCell":
        return nn.TrainOneStepCell(GradAccumulationCell(loss_net, 4, check_loss=check_loss), opt)
    return AccumulatingTrainOneStepCell(loss_net, opt, 2, micro_size=4, check_loss=check_loss)


def probe(which: str, checks: tuple) -> dict:
    from mindspore import nn
    x, y = _data()
    found = {}
    for check_loss in checks:
        with Calls() as whole:
            step = _step(which, check_loss)
            for _ in range(2):
                step(x, y).asnumpy()
        with Calls() as steady:   # the third call: the contract was read on the first
            step(x, y).asnumpy()
        found[check_loss] = (len(whole.functions | steady.functions),
                             len(whole.modules | steady.modules), steady, whole.frame_reads + steady.frame_reads)
    net = _net()
    plain = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True,
                                                                                     reduction="mean")),
                                nn.SGD(net.trainable_params(), 0.01))
    with Calls() as plain_first:
        plain(x, y).asnumpy()
    with Calls() as plain_steady:
        plain(x, y).asnumpy()
    return {"check": found, "plain_first": plain_first, "plain_steady": plain_steady}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pynative", action="store_true", help="PYNATIVE_MODE instead of GRAPH_MODE")
    parser.add_argument("--cell", choices=("GradAccumulationCell", "AccumulatingTrainOneStepCell"), default=None)
    parser.add_argument("--check-loss", choices=("True", "False"), default=None)
    parser.add_argument("--verbose", action="store_true", help="name the functions a steady call runs")
    args = parser.parse_args()
    if args.cell is None or args.check_loss is None:
        # Each cell and setting in a process of its own: the first to run would count the package's imports.
        import subprocess   # pylint: disable=import-outside-toplevel
        for which in ("GradAccumulationCell", "AccumulatingTrainOneStepCell"):
            for check_loss in ("True", "False"):
                command = [sys.executable, __file__, "--cell", which, "--check-loss", check_loss]
                command += (["--pynative"] if args.pynative else []) + (["--verbose"] if args.verbose else [])
                out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                print(out, end="")
        return
    import mindspore as ms
    import ms_gradaccum  # noqa: F401  (imported before counting)
    ms.set_context(mode=ms.PYNATIVE_MODE if args.pynative else ms.GRAPH_MODE)
    for which in [args.cell]:
        check_loss = args.check_loss == "True"
        found = probe(which, (check_loss,))
        steady = found["check"][check_loss][2]
        print(f"{which} ({'PyNative' if args.pynative else 'GRAPH_MODE'}, check_loss={check_loss}):")
        print(f"  a steady call: {len(steady.functions)} package functions ({steady.calls} calls), "
              f"{steady.frame_reads} frame reads")
        if args.verbose:
            for name in sorted(steady.functions):
                print(f"    {name}")
        functions, modules, _, frames = found["check"][check_loss]
        print(f"  construction and three calls: {functions} package functions in {modules} modules, {frames} frame "
              f"reads")
        print(f"  a plain nn.TrainOneStepCell compiled afterwards: {len(found['plain_first'].functions)} package "
              f"functions on its first call, {len(found['plain_steady'].functions)} on a steady one")


if __name__ == "__main__":
    main()
