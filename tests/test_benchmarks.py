"""The benchmarks keep working: smoke runs at tiny sizes (loss continuity also checks its numbers)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

from conftest import ROOT, torch_env


def test_benchmark_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_convert.py"), "--smoke", "--work", str(tmp_path)]
    proc = subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for source in ("z1-dp4-0.5M", "z3-dp4-0.5M", "z1-tp2-dp2-0.5M", "z1-moe-ep2-dp4-0.5M"):
        assert f"| {source} (" in proc.stdout, source
    assert "resharded load at ZeRO-2" in proc.stdout


def test_checkn_run_benchmark_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_checkn_run.py"), "--smoke", "--work", str(tmp_path)]
    proc = subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| intermittent | 4 |" in proc.stdout and "restored from adaptive-4 bits" in proc.stdout


def test_loss_continuity_short(tmp_path):
    """The paper's loss-continuity run, shortened: a resharding regression splits the curves and fails here."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "loss_continuity.py"),
        "--smoke",
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(out),
        "--bound",
        "1",
    ]
    proc = subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["target"] for r in runs] == ["TP=1 PP=1 DP=2 ZeRO-1", "TP=1 PP=2 DP=2 ZeRO-1", "TP=1 PP=1 DP=3 ZeRO-3"]
    for run in runs:  # fp32: only the reduction order differs when TP or DP changes
        assert run["max_abs"] <= 2e-6, run
    with (out / "losses.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 20 + 3 * 10
    assert (out / "one_to_many.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
