"""A job whose work is done exits 0, every time (issue 48): torchrun, a scheduler and an elastic agent judge it by
that code alone, and an abort in interpreter teardown after the checkpoint was written marks it failed."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time

import pytest
from conftest import torch_env
from launching import ROOT, torchrun_command

PLAIN_SAVE = ROOT / "tests" / "workers" / "plain_save.py"
LAUNCHES = 20


def _spin() -> None:
    while True:
        pass


@pytest.mark.slow
def test_plain_save_script_exits_zero_under_load(tmp_path):
    # the abort came on a busy machine: a burner on every core while the launches run
    burners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(multiprocessing.cpu_count())]
    for burner in burners:
        burner.start()
    codes, tails = [], []
    try:
        for launch in range(LAUNCHES):
            cmd = torchrun_command(2, PLAIN_SAVE, tmp_path / f"ckpt{launch}")
            start = time.monotonic()
            proc = subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=600)
            codes.append(proc.returncode)
            print(f"launch {launch}: exit {proc.returncode} in {time.monotonic() - start:.1f} s", file=sys.stderr)
            if proc.returncode != 0:
                tails.append(f"launch {launch}:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))
    finally:
        for burner in burners:
            burner.terminate()
            burner.join()
    assert codes == [0] * LAUNCHES, f"exit codes {codes}\n" + "\n\n".join(tails)
