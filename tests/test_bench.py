"""The benchmark command keeps working: its quick mode runs end to end (no timing assertions)."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from launch import REPO, repo_env


@pytest.mark.slow
def test_bench_quick_mode_writes_table_json_and_plot(tmp_path):
    env = repo_env()
    command = [sys.executable, os.path.join(REPO, "benchmarks", "run.py"), "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "benchmark.json", encoding="utf-8") as handle:
        result = json.load(handle)
    kinds = {(row["framework"], row["kind"], row["micro_size"], row["batch"]) for row in result["rows"]}
    assert {("mindspore", "plain", 1, 4096), ("mindspore", "plain", 1, 512), ("mindspore", "accumulate", 8, 4096),
            ("mindspore", "mindspore", 8, 4096), ("mindspore", "steps", 8, 4096),
            ("mindspore", "plain_o2", 1, 4096), ("mindspore", "accumulate_o2", 8, 4096),
            ("mindspore", "tokens", 8, 4096)} <= kinds
    assert any(kind[0] == "torch" for kind in kinds) == (importlib.util.find_spec("torch") is not None)
    for row in result["rows"]:
        assert row["steady_step_s"] > 0 and row["rss_peak_mb"] > 0
        if row["framework"] == "mindspore":
            assert row["pool_peak_mb"] > 0, row
    assert len(result["targets"]) >= 6
    assert any(line.startswith("mlp: K=8 memory above the one-micro-batch floor (pool + Parameters)")
               for line in result["targets"])
    assert all(row.get("above_floor_x_weights") is not None
               for row in result["rows"] if not row["kind"].endswith("_o2"))
    assert any(line.startswith("mlp: fp16 (O2, loss scale) K=8 vs fp16 full batch") for line in result["targets"])
    assert any(line.startswith("mlp: token path (loss_sum, count) vs mean loss") for line in result["targets"])
    # The BatchNorm model: batch_norm='per_step' beside 'micro', with its target line.
    assert {("mindspore", "accumulate", 4, 128), ("mindspore", "accumulate_bn_micro", 4, 128)} <= \
        {(row["framework"], row["kind"], row["micro_size"], row["batch"]) for row in result["rows"]
         if row["model"] == "convbn"}
    assert any(line.startswith("convbn: batch_norm='per_step' vs 'micro', K=4: step") for line in result["targets"])
    assert "| mlp | GradAccumulationCell K=8 |" in done.stdout and "above floor, in parameter bytes" in done.stdout
    assert (tmp_path / "benchmark_mlp.png").stat().st_size > 10_000
    # Compile time on the language model, each cell against the plain step, divisible and ragged batches.
    compiled = {(row["model"], row["kind"], row["micro_size"], row["batch"]): row for row in result["compile_rows"]}
    # Quick mode compiles the core configurations (the ragged batch and K=64 are the full run's; their target lines
    # are checked on given rows below).
    for key in (("lm2", "plain", 1, 16), ("lm2", "accumulate", 4, 16), ("lm2", "accumulate_unchecked", 4, 16),
                ("lm2", "accumulate_steps", 4, 16), ("lm2", "floor", 4, 16)):
        assert compiled[key]["compile_s"] > 0 and compiled[key]["compile_cpu_s"] > 0, key
    for prefix in ("lm2: compile, divisible batch, 16 rows, K=4: GradAccumulationCell",
                   "lm2: the loss contract's check: compile",
                   "lm2: compile CPU seconds, K=4, against the floor: GradAccumulationCell",
                   "mlp: compile K=64"):
        assert any(line.startswith(prefix) for line in result["targets"]), prefix
    assert "| lm2 | GradAccumulationCell in nn.TrainOneStepCell K=4 | 16 |" in done.stdout
    assert "| lm2 | floor (the mechanism alone, not the product) K=4 | 16 |" in done.stdout


def test_bench_compile_targets_of_a_full_run_are_written_from_its_rows():
    # Every configuration of a full run (COMPILE_CONFIGS), given as rows: each target line the full run writes.
    spec = importlib.util.spec_from_file_location("bench_run", os.path.join(REPO, "benchmarks", "run.py"))
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    rows = [dict(model="lm2", kind=kind, micro_size=k, batch=batch, compile_s=1.0 + k / 100, compile_cpu_s=1.5,
                 steady_step_s=0.1) for kind, k, batch in run.COMPILE_CONFIGS]
    targets = run.compile_targets(rows)
    for prefix in ("lm2: compile, divisible batch, 16 rows, K=4: GradAccumulationCell",
                   "lm2: compile, ragged batch, 18 rows, K=4: AccumulatingTrainOneStepCell", "lm2: compile K=64",
                   "lm2: the loss contract's check: compile", "lm2: a train cell of one's own",
                   "lm2: compile CPU seconds, K=4, against the floor: GradAccumulationCell", "lm2: step time K=4"):
        assert any(line.startswith(prefix) for line in targets), (prefix, targets)
    assert len(run.compile_targets(rows[:5])) < len(targets)   # control: fewer rows, fewer lines


def test_bench_failed_configuration_exits_non_zero_and_keeps_the_last_results(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_run", os.path.join(REPO, "benchmarks", "run.py"))
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    calls = []

    def run_one(framework, model, kind, micro_size, batch, steps, timeout):
        calls.append(kind)
        if kind == "accumulate":  # one worker fails, as when a configuration crashes or times out
            return None
        # The keys benchmarks/worker.py prints, plus what run_one adds from the log.
        return dict(framework=framework, model=model, kind=kind, micro_size=micro_size, batch=batch, param_mb=1.0,
                    weight_mb=0.5, compile_s=0.9, compile_cpu_s=1.2, first_step_s=1.0, steady_step_s=0.1,
                    samples_per_s=batch / 0.1,
                    rss_base_mb=400.0, rss_peak_mb=500.0, rss_growth_mb=100.0, input_mb=1.0, pool_peak_mb=10,
                    footprint_mb=11.0)

    monkeypatch.setattr(run, "run_one", run_one)
    (tmp_path / "benchmark.md").write_text("the last full run\n")
    assert run.main(["--quick", "--no-plots", "--out", str(tmp_path)]) == 1
    assert "accumulate" in calls and "plain" in calls
    assert "configuration(s) failed (see above); nothing written to" in capsys.readouterr().err
    assert (tmp_path / "benchmark.md").read_text() == "the last full run\n"
    assert not (tmp_path / "benchmark.json").exists()


@pytest.mark.slow
def test_bench_compile_probe_prints_the_floor_beside_the_package():
    # One repeat on the 2-layer LM: the table, and after one update the floor's loss is the package's (it is the
    # package's mechanism, not another computation) and the plain step's up to summation order; the update moved the
    # loss (control: the comparison is not of untrained weights).
    probe = os.path.join(REPO, "benchmarks", "compile_probe.py")
    command = [sys.executable, probe, "--models", "lm2", "--repeats", "1"]
    done = subprocess.run(command, env=repo_env(), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| lm2 |"))
    assert row.count("x)") == 4 and "(1.00x)" in row, row
    # The same compiles in wall seconds: a second table of the four, the plain step again 1.00x.
    rows = [line for line in done.stdout.split("in wall seconds")[0].splitlines() if line.startswith("| lm2 |")]
    assert len(rows) == 2 and rows[1].count("x)") == 4 and "(1.00x)" in rows[1], rows
    listed = re.findall(r"lm2 (\w+) ([-0-9.]+) \(([-0-9.]+)\)", done.stdout.split("losses after one update")[1])
    after = {kind: float(value) for kind, value, _ in listed}
    before = {kind: float(value) for kind, _, value in listed}
    assert set(after) == {"plain", "package", "package_unchecked", "floor"}, listed
    assert abs(after["floor"] - after["package"]) < 1e-6 and abs(after["package_unchecked"] - after["package"]) < 1e-6
    assert abs(after["plain"] - after["floor"]) < 1e-4, after
    assert abs(after["floor"] - before["floor"]) > 1e-3, (after, before)
    # The graph sizes after type inference: parsed from the IR MindSpore dumped, one row of four "subgraphs / nodes".
    # Ordered as the configurations are built: the floor adds the loop and the hand-over to the plain step, the
    # package its own graph code to the floor.
    sizes = next(line for line in done.stdout.split("subgraphs / nodes")[0].splitlines()[::-1]
                 if line.startswith("| lm2 |"))
    counts = [tuple(int(n) for n in cell.split(" / ")) for cell in sizes.strip("| ").split(" | ")[1:]]
    assert len(counts) == 4 and all(graphs > 100 and nodes > graphs for graphs, nodes in counts), sizes
    plain, package, unchecked, floor = counts
    assert plain[1] < floor[1] < unchecked[1] and floor[1] < package[1], sizes
