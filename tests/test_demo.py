"""The README's first command, `bash launch/demo.sh`, run step by step (without its install) as a user runs it."""

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
    tiny = [line for line in out.splitlines() if line.startswith("[z") and " from z2:" in line]
    assert len(tiny) == 2 and all("bit-exactly" in line for line in tiny), out
    assert all("read in place" in line for line in tiny), out
    assert "no converted copy written" in out and "deepspeed checkpoint:" in out, out
    gpt = [line for line in out.splitlines() if line.startswith("[") and " from " in line and "differences" in line]
    assert gpt and all("resharded, 0 differences" in line for line in gpt), out
