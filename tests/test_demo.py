"""The README's first command, `bash launch/demo.sh`, run step by step (without its install) as a user runs it: the
reference script resumes at other layouts, and `ucp diff` finds the checkpoints saved right after each resume
identical to the one saved."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT, torch_env


def test_demo_runs_and_shows_what_it_promises() -> None:
    env = torch_env()
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # torchrun and ucp
    proc = subprocess.run(
        ["bash", str(ROOT / "launch" / "demo.sh"), "--no-install"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    resumes = [line for line in out.splitlines() if line.startswith("resumed from step")]
    assert resumes == [
        "resumed from step 4: resharded zero2 dp=2 fp32 -> zero3 dp=3 fp32, read in place",
        "resumed from step 3: resharded zero1 dp=1 tp=2 pp=2 fp32 -> zero1 dp=2 fp32, read in place",
    ], out
    compared = [line for line in out.splitlines() if "tensor states compared" in line]
    assert len(compared) == 2 and all(line.endswith("checkpoints are identical") for line in compared), out
    assert "no converted copy written" in out and "deepspeed checkpoint:" in out, out


def test_gpu_smoke_refuses_to_start_without_cuda() -> None:
    """launch/gpu_smoke.sh is for a machine with GPUs: here it says so and stops, before any launch."""
    proc = subprocess.run(
        ["bash", str(ROOT / "launch" / "gpu_smoke.sh")], env=torch_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_smoke: needs CUDA and at least 1 GPU" in proc.stderr and "==" not in proc.stdout
