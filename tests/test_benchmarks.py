"""The benchmarks keep working: smoke runs at tiny sizes and the shortened loss-continuity run, which checks numbers
(`-m bench`, which `.ci/run` runs after the default suite)."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT, torch_env
from s3server import s3rver_binary

PROGRESS = re.compile(r"^(== |source |  resume at |  resume |  convert )")


def run_benchmark(script: str, *args: str, capsys: pytest.CaptureFixture, smoke: bool = True) -> str:
    """Run a benchmark script (`--smoke`, its tiny sizes, unless `smoke` is false); echo its progress lines as they
    come (a run takes minutes, and pytest alone would show one dot); fail with the output's tail if it fails or runs
    past 15 minutes."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *(["--smoke"] if smoke else []), *args]
    lines: list[str] = []
    with subprocess.Popen(cmd, env=torch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        watchdog = threading.Timer(900, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout or ():
                lines.append(line)
                if PROGRESS.match(line):
                    with capsys.disabled():
                        print(f"  {Path(script).stem}: {line.strip()}", flush=True)
        finally:
            watchdog.cancel()
    output = "".join(lines)
    assert proc.returncode == 0, output[-6000:]
    return output


@pytest.mark.bench
def test_benchmark_smoke(tmp_path, capsys):
    output = run_benchmark("bench_convert.py", "--work", str(tmp_path), capsys=capsys)
    for source in ("z1-dp2-0.5M", "z1-tp2-dp1-0.5M", "z1-pp2-dp1-0.5M", "z1-moe-ep2-dp2-0.5M"):
        assert f"| {source} (" in output, source
    assert "resharded load at ZeRO-2" in output


@pytest.mark.bench
def test_an_async_save_stalls_training_less_than_a_synchronous_one(tmp_path, capsys):
    """Side by side on one engine (10M, 1 rank): the check fails the run if the async save stops gaining."""
    output = run_benchmark("bench_async.py", "--work", str(tmp_path), capsys=capsys)
    assert "PASS the async save stalls training less" in output and "| DCP async_save, process |" in output


@pytest.mark.bench
def test_checkn_run_benchmark_smoke(tmp_path, capsys):
    output = run_benchmark("bench_checkn_run.py", "--work", str(tmp_path), capsys=capsys)
    assert "| intermittent | 4 |" in output and "restored from adaptive-4 bits" in output


@pytest.mark.bench
def test_torchrec_benchmark_smoke(tmp_path, capsys):
    pytest.importorskip("torchrec", reason="TorchRec is not installed (the `torchrec` extra)")
    output = run_benchmark("bench_torchrec.py", "--work", str(tmp_path), capsys=capsys)
    assert "| ours, one-shot delta after 5 steps" in output and "refused: `ValueError: Size mismatch" in output


@pytest.mark.bench
def test_loss_continuity_short(tmp_path, capsys):
    """The paper's loss-continuity run, shortened: a resharding regression splits the curves and fails here."""
    out = tmp_path / "out"
    run_benchmark(
        "loss_continuity.py", "--work", str(tmp_path / "work"), "--out", str(out), "--bound", "1", capsys=capsys
    )
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["target"] for r in runs] == ["TP=1 PP=1 DP=2 ZeRO-1", "TP=1 PP=2 DP=2 ZeRO-1", "TP=1 PP=1 DP=3 ZeRO-3"]
    for run in runs:  # fp32: only the reduction order differs when TP or DP changes
        assert run["max_abs"] <= 2e-6, run
    with (out / "losses.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 20 + 3 * 10
    assert (out / "one_to_many.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.bench
def test_resume_benchmark_smoke(tmp_path, capsys):
    """Every row of the time-to-resume benchmark runs; a direct load writes no checkpoint bytes."""
    output = run_benchmark("bench_resume.py", "--work", str(tmp_path), capsys=capsys)
    rows = [line.split(" | ") for line in output.splitlines() if line.startswith("| z")]
    for source in ("z1-dp2-0.5M", "z3-dp2-0.5M"):
        mine = [r for r in rows if r[0] == f"| {source}"]
        assert {(r[1], r[2]) for r in mine} >= {
            ("same layout", "native load, same layout (the floor)"),
            *(
                (target, row)
                for target in ("DP 1", "ZeRO-3" if source[1] == "1" else "ZeRO-1")
                for row in ("ours, direct", "ours, `ucp convert` + load")
            ),
        }, mine
        for r in mine:
            if r[2] == "ours, direct":
                assert r[9].endswith("kB") and r[11] == "0.0 kB", r  # log lines at most; no checkpoint bytes


@pytest.mark.bench
def test_a_direct_reshard_is_not_slower_than_the_native_load(tmp_path, capsys):
    """A direct reshard of 80M parameters to DP 1 (at the same ZeRO stage and at the other one) against DeepSpeed's
    own load of a checkpoint saved at that layout, medians of fresh launches: a time-to-resume regression fails
    here (the script exits non-zero above 1.5x), not in a user's job."""
    output = run_benchmark("bench_ratio.py", "--work", str(tmp_path), capsys=capsys, smoke=False)
    ratios = re.findall(r"\*\*(\d+\.\d+)x\*\* \((\d+\.\d+)x\)", output)
    assert len(ratios) == 4 and "PASS every direct reshard" in output, output[-3000:]


@pytest.mark.bench
def test_scale_benchmark_smoke(capsys):
    output = run_benchmark("bench_scale.py", capsys=capsys)
    assert "| shrink to 3/4, ZeRO-1 | 64 | 48 |" in output
    assert "| 64 | 8 |" in output and "1T parameters" in output


@pytest.mark.bench
@pytest.mark.skipif(s3rver_binary() is None, reason="s3rver is not installed (benchmarks/setup.sh; needs npm)")
def test_object_store_benchmark_smoke(tmp_path, capsys):
    """Every row of the object-store benchmark runs on s3rver, against its floor and beside DCP's readers, and a
    reshard fetches from the store what it reads from disk."""
    output = run_benchmark("bench_object_store.py", "--work", str(tmp_path), capsys=capsys)
    for zero, other in ((1, 3), (3, 1)):
        for store in ("local disk", "S3 (s3rver)", "S3, 16 key prefixes"):
            assert f"| {zero} | {store} | save, DP 2 |" in output
            assert f"| {zero} | {store} | reshard to DP 1, ZeRO-{other} (resharded) |" in output
    ratios = [float(r) for r in re.findall(r"the store fetched ([0-9.]+)x the bytes", output)]
    assert len(ratios) == 2 and all(r <= 1.1 for r in ratios), ratios
    assert "Server floor (obstore): ZeRO-1: GET" in output
    # a load from the store has its ranks' and the server's CPU seconds, and the least time they allow
    assert len(re.findall(r"\| [0-9.]+ \+ [0-9.]+ \([0-9.]+\) \|$", output, re.M)) == 8, output
    for reader in ("ours, direct reshard", "DCP FsspecReader (s3fs)", "s3torchconnector S3StorageReader"):
        assert f"| {reader} |" in output
    assert "| 7B | 82 |" in output  # the 1,024-rank projection
