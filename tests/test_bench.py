"""The benchmark command keeps working: its quick mode runs end to end (no timing assertions)."""
import importlib.util
import json
import os
import subprocess
import sys

from probe import REPO


def test_bench_quick_mode_writes_table_json_and_plot(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "run.py"), "--quick", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
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
    assert all(row.get("above_floor_x_weights") is not None for row in result["rows"] if not row["kind"].endswith("_o2"))
    assert any(line.startswith("mlp: fp16 (O2, loss scale) K=8 vs fp16 full batch") for line in result["targets"])
    assert any(line.startswith("mlp: token path (loss_sum, count) vs mean loss") for line in result["targets"])
    assert "| mlp | GradAccumulationCell K=8 |" in done.stdout and "above floor, in parameter bytes" in done.stdout
    assert (tmp_path / "benchmark_mlp.png").stat().st_size > 10_000
