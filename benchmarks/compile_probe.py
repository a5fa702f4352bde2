"""How far the package's compile time is from the least an accumulating step can cost, side by side in one run.

    python benchmarks/compile_probe.py              # lm2 and lm6, 3 repeats each (about 5 min on 2 cores)
    python benchmarks/compile_probe.py --models lm2 --repeats 5
    python benchmarks/compile_probe.py --before /tmp/old-checkout   # the package of another checkout beside this one

Cell.compile of the training step on the benchmark's language model (batch 16, micro_size 4), in process CPU seconds
(MindSpore's own threads included; steadier than wall on a shared machine) and, in a second table, wall seconds, each
configuration in a process of its own, REPEATS times round-robin, the minimum counted:

- plain: ``nn.TrainOneStepCell`` on the full batch (the reference);
- package: ``nn.TrainOneStepCell(GradAccumulationCell(lm, 4))``, with the loss contract's check and with
  ``check_loss=False``;
- with ``--before PATH``: ``package@before`` and ``package_unchecked@before``, the same cells from the checkout at
  PATH (its ``ms_gradaccum`` first on the path), in the same round robin;
- floor: the same structure with nothing but the mechanism, a probe that is not the product: a graph-mode while loop
  over the micro-batches running ``value_and_grad`` and adding the gradients into Parameter buffers in place, inside a
  cell whose bprop returns zeros (opaque to the outer gradient), and the package's ``GradientOf`` handing each buffer
  to the optimizer. No input planning, tallies, loss checks, loss scale or uneven splits: it is exact only for a mean
  loss on a batch micro_size divides.

The gap between "package" and "floor" is what the package's own graph code costs to compile; "floor" against "plain"
is what the mechanism costs (docs/measurements.md, "Compile time", "Where it goes").

The loss contract's reading is also timed on its own inside the package's compile (the step's graph read after it; in
a checkout given with --before that reads the network's own graph before the step, that compile): what it costs,
without the difference of two noisy compiles.

Compile times on a shared machine spread by 0.3-0.5 s between identical runs; the graph's size does not. So each
configuration is also compiled once more with MindSpore's IR dumped after type inference only (``MS_DEV_SAVE_GRAPHS``,
``MS_DEV_DUMP_IR_PASSES``, into a temporary folder, about 10 MB, deleted after), and the probe prints how many
subgraphs and nodes the inferred graph holds: the same on every run, and what type inference and the optimizer passes
scale with, so a cut in the package's graph code shows there whatever the noise.
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
KINDS = ["plain", "package", "package_unchecked", "floor"]
BEFORE = "@before"   # a kind of the checkout given with --before
MICRO_SIZE, BATCH = 4, 16


def build(kind: str, model: str):
    """The train cell of `kind` and its inputs."""
    import mindspore as ms
    from mindspore import nn, ParameterTuple, Tensor
    import worker
    from ms_gradaccum import GradAccumulationCell

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    x, y = worker._data(model, BATCH)   # pylint: disable=protected-access
    net = worker._LanguageModel(int(model[2:]))   # pylint: disable=protected-access
    optimizer = nn.SGD(ParameterTuple(net.trainable_params()), 0.01)
    if kind == "plain":
        cell = nn.TrainOneStepCell(net, optimizer)
    elif kind.startswith("package"):
        checked = kind.split("@")[0] == "package"
        cell = nn.TrainOneStepCell(GradAccumulationCell(net, MICRO_SIZE, check_loss=checked), optimizer)
    else:
        cell = worker.floor_cell(net, optimizer, MICRO_SIZE)
    return cell, (Tensor(x), Tensor(y))


def _timed_reading() -> list:
    """Wraps the loss contract's reading (the step's graph read after its compile, and any compile of the network apart)
    to add its process CPU seconds to the list returned; `-1` where this checkout has no such reading."""
    try:
        from ms_gradaccum.diagnostics import contract, graph_contract
    except ImportError:
        return [-1.0]
    spent = [0.0]

    def timed(function):
        def wrapper(*args, **kwargs):
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[0] += time.process_time() - start
        return wrapper
    if hasattr(contract.LossContract, "read_step"):
        contract.LossContract.read_step = timed(contract.LossContract.read_step)
    else:   # a checkout that reads the network's own graph before the step
        graph_contract.forward_graph = timed(graph_contract.forward_graph)
    return spent


def measure(kind: str, model: str) -> None:
    """In a process of its own: compile, print the seconds (the loss contract's reading among them, timed on its own),
    and the loss of a second step (after one update: the floor must train as the package does)."""
    sys.path.insert(0, HERE)
    reading = _timed_reading() if kind.split("@")[0] == "package" else [0.0]
    cell, inputs = build(kind, model)
    start, start_wall = time.process_time(), time.perf_counter()
    cell.compile(*inputs)
    seconds, wall = time.process_time() - start, time.perf_counter() - start_wall
    first = float(cell(*inputs).asnumpy().reshape(-1)[0])
    second = float(cell(*inputs).asnumpy().reshape(-1)[0])
    print(f"PROBE {seconds:.3f} {second:.8f} {first:.8f} {wall:.3f} {reading[0]:.3f}", flush=True)


def run_measure(kind: str, model: str, env: dict) -> subprocess.CompletedProcess:
    """:func:`measure` of `kind` on `model` in a process of its own."""
    return subprocess.run([sys.executable, __file__, "--measure", kind, model], env=env, capture_output=True, text=True,
                          timeout=600, check=False)


def table_header() -> str:
    return f"| model | {' | '.join(KINDS)} |\n|---|{'---|' * len(KINDS)}"


def graph_size(ir_text: str) -> tuple:
    """``(subgraphs, nodes)`` of a MindSpore IR dump: its ``subgraph @name(...) {`` blocks and the CNodes in them."""
    return (len(re.findall(r"^subgraph @", ir_text, re.M)), len(re.findall(r"^  %\d+\(", ir_text, re.M)))


def inferred_size(kind: str, model: str, env: dict) -> tuple:
    """`kind`'s train step compiled in a process of its own with the IR dumped after type inference: its size."""
    with tempfile.TemporaryDirectory(prefix="compile_probe_ir_") as folder:
        done = run_measure(kind, model, dict(env, MS_DEV_SAVE_GRAPHS="1", MS_DEV_DUMP_IR_PASSES="type_inference",
                                             MS_DEV_SAVE_GRAPHS_PATH=folder))
        found = glob.glob(os.path.join(folder, "**", "*type_inference*.ir"), recursive=True)
        if done.returncode != 0 or not found:
            raise RuntimeError(f"{model} {kind}: no IR after type inference ({done.returncode}, {found}):\n"
                               f"{(done.stdout + done.stderr)[-1500:]}")
        # The train step's graph; the package also compiles the loss network's forward alone (the loss contract's
        # graph, diagnostics.graph_contract), a smaller one.
        sizes = []
        for path in found:
            with open(path, encoding="utf-8", errors="replace") as ir_file:
                sizes.append(graph_size(ir_file.read()))
        return max(sizes, key=lambda size: size[1])


def print_ratios(seconds: dict, models: list) -> None:
    """The table of `seconds` per (model, configuration), each with its ratio to the plain step."""
    print(table_header())
    for model in models:
        plain = seconds[model, "plain"]
        cells = [f"{seconds[model, kind]:.2f} s ({seconds[model, kind] / plain:.2f}x)" for kind in KINDS]
        print(f"| {model} | {' | '.join(cells)} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["lm2", "lm6"], help="lmN: the LM with N layers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", help="a checkout whose package is measured beside this one's")
    args = parser.parse_args(argv)
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    envs = {kind: env for kind in KINDS}
    if args.before:
        for kind in ("package", "package_unchecked"):
            KINDS.append(kind + BEFORE)
            envs[kind + BEFORE] = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [
                os.path.abspath(args.before), os.environ.get("PYTHONPATH")])))
    best, best_wall, losses, reading = {}, {}, {}, {}
    for _ in range(args.repeats):
        for model in args.models:
            for kind in KINDS:
                done = run_measure(kind, model, envs[kind])
                found = [line.split() for line in done.stdout.splitlines() if line.startswith("PROBE ")]
                if done.returncode != 0 or not found:
                    print(f"{model} {kind} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-1500:]}",
                          file=sys.stderr)
                    return 1
                seconds, wall = float(found[0][1]), float(found[0][4])
                best[model, kind] = min(best.get((model, kind), seconds), seconds)
                best_wall[model, kind] = min(best_wall.get((model, kind), wall), wall)
                reading.setdefault((model, kind), []).append(float(found[0][5]) if len(found[0]) > 5 else -1.0)
                losses[model, kind] = (float(found[0][2]), float(found[0][3]))
    print_ratios(best, args.models)
    print(f"(minimum of {args.repeats}, compile of the train step, batch {BATCH}, micro_size {MICRO_SIZE}; losses "
          f"after one update (before): " + ", ".join(f"{m} {k} {v[0]:.8f} ({v[1]:.8f})"
                                                     for (m, k), v in sorted(losses.items())) + ")")
    print()
    print_ratios(best_wall, args.models)
    print("(the same compiles in wall seconds, minimum of each; on CPU MindSpore's runtime threads spin while the "
          "first step's eager check runs, which counts twice in CPU seconds)")
    read = [kind for kind in KINDS if kind.startswith("package") and "unchecked" not in kind]
    print("\n| model | " + " | ".join(f"the reading, {kind}" for kind in read) + f" |\n|---|{'---|' * len(read)}")
    for model in args.models:
        cells = []
        for kind in read:
            median = sorted(reading[model, kind])[len(reading[model, kind]) // 2]
            cells.append(f"{median:.2f} s ({median / best[model, 'plain']:.2f}x)" if median >= 0 else "not timed")
        print(f"| {model} | {' | '.join(cells)} |")
    print("(timed inside the package's compile: the step's graph read after it, and any compile of the network apart; "
          "a compile of the step again for another kind is not part of it)")
    print("\n" + table_header())
    for model in args.models:
        sizes = {kind: inferred_size(kind, model, envs[kind]) for kind in KINDS}
        cells = [f"{sizes[kind][0]} / {sizes[kind][1]}" for kind in KINDS]
        print(f"| {model} | {' | '.join(cells)} |")
    print("(the graph after type inference, subgraphs / nodes: the same on every run)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--measure":
        measure(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
