"""The benchmarks keep working: smoke runs at tiny sizes (numbers are not checked here)."""
from __future__ import annotations

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
