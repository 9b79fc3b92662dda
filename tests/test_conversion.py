"""Offline conversion: split over processes (`ucp convert --procs N`, or under torchrun) it writes what one process
writes, every byte any process read is checked, and the `ucp` command loads no training framework."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import nvme_unavailable, torch_env
from launching import torchrun_command

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.tools.compare import diff

FRAMEWORKS = ("deepspeed", "transformers", "megatron", "accelerate")


def ucp(*args: str, torchrun: int = 0) -> subprocess.CompletedProcess:
    cli = ["-m", "ucp_deepspeed.tools.cli", *args]
    cmd = torchrun_command(torchrun, *cli) if torchrun else [sys.executable, *cli]
    return subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=300)


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("params/*")}


# slow: the default run splits a conversion over processes in tests/faults/test_conversion_faults.py (--procs 2)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in ("z2", "nvmez3")])
def test_conversion_split_over_processes_writes_what_one_process_writes(sources, tmp_path, name):
    if name == "nvmez3" and nvme_unavailable():
        pytest.skip(nvme_unavailable())
    outs = {}
    for label, extra, world in (("one", [], 0), ("procs", ["--procs", "2"], 0), ("torchrun", [], 2)):
        out = tmp_path / label
        done = ucp("convert", str(sources[name]), "--output", str(out), "--no-progress", *extra, torchrun=world)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == [str(out)]  # under torchrun too: rank 0 alone prints the folder
        outs[label] = out
        if label == "procs":  # the work was split, not done twice or by one of them
            counts = re.search(r"2 processes wrote (\d+), (\d+) files", done.stderr)
            assert counts and min(int(c) for c in counts.groups()) > 0, done.stderr[-2000:]
    for label in ("procs", "torchrun"):
        assert digests(outs[label]) == digests(outs["one"]) and len(digests(outs["one"])) >= 7, label
        report = diff(str(outs["one"]), str(outs[label]))
        assert report.identical and len(report.states) >= 20, (label, report)


def test_checkpoint_errors_cross_processes_whole():
    """A child process's error reaches the parent as the same one-line error naming the file."""
    error = pickle.loads(pickle.dumps(CheckpointError("/ckpt/file.pt", "fails its crc32 check")))
    assert (type(error), error.path, error.reason) == (CheckpointError, "/ckpt/file.pt", "fails its crc32 check")


def test_ucp_command_loads_no_training_framework(sources, tmp_path):
    """Converting, inspecting and verifying import torch and the readers, never DeepSpeed (not even to unpickle
    its classes), transformers, megatron-core or accelerate."""
    src, out = str(sources["z1"]), str(tmp_path / "out")
    script = f"""
import json, sys
from ucp_deepspeed.tools.cli import main
codes = [main(a) for a in (["convert", {src!r}, "--output", {out!r}, "--no-progress"], ["inspect", {src!r}],
                           ["verify", {src!r}], ["inspect", {out!r}])]
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({FRAMEWORKS!r}))
print(json.dumps({{"codes": codes, "loaded": loaded}}))
"""
    done = subprocess.run([sys.executable, "-c", script], env=torch_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"codes": [0, 0, 0, 0], "loaded": []}, result
    assert Path(out, "manifest.json").is_file()
