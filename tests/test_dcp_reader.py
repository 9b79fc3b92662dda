"""The DCP-reader benchmark worker loads the same values with either reader as one process finds in the whole folder:
its comparisons with our load stand on loads that are right (`-m bench`; s3rver and s3torchconnector needed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import s3server
import torch
import torch.distributed.checkpoint as dcp
from conftest import ROOT, torch_env
from launching import each, torchrun_command
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

BENCHMARKS = ROOT / "benchmarks"


def run(cmd: list[str]) -> str:
    """Run a launch or the CLI; fail with the output's tail if it fails."""
    proc = subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout


def whole_sum(url: str) -> tuple[float, int]:
    """The float64 sum and the elements of every tensor in the DCP folder, loaded whole in this one process."""
    reader = FsspecReader(url)
    state = {
        key: torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=FsspecReader(url), no_dist=True)
    return sum(t.double().sum().item() for t in state.values()), sum(t.numel() for t in state.values())


@pytest.mark.bench
def test_both_readers_load_the_folder_s_values():
    if s3server.s3rver_binary() is None:
        pytest.skip("s3rver is not installed (benchmarks/setup.sh)")
    if importlib.util.find_spec("s3torchconnector") is None:
        pytest.skip("s3torchconnector is not installed (the `bench` extra)")
    with s3server.s3rver_server(log=True) as s3:
        bucket = s3.bucket()
        ckpt, folder = f"s3://{bucket}/ckpt", f"s3://{bucket}/dcp"
        save = ["save", "--params-m", "0.5", "--zero", "1", "--out", ckpt, "--repeat", "0"]
        run(torchrun_command(2, BENCHMARKS / "synthetic.py", *save))
        run([sys.executable, "-m", "ucp_deepspeed.tools.cli", "export-dcp", ckpt, folder, "--no-progress"])
        log = ["--requests-log", str(s3.log)]
        loads = [["--source", folder, "--reader", r, *log] for r in ("fsspec", "s3torchconnector")]
        out = run(torchrun_command(2, BENCHMARKS / "dcp_reader.py", *each(loads)))
        fsspec, connector = (json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT "))
        expected, numel = whole_sum(folder)
    assert (fsspec["reader"], connector["reader"]) == ("fsspec", "s3torchconnector")
    assert fsspec["check"] == connector["check"]  # one sharding, one order of addition: the same bits
    assert fsspec["check"] == pytest.approx(expected, rel=1e-9, abs=1e-6)  # the halves are added apart
    assert fsspec["numel"] == connector["numel"] >= numel  # replicas count on every rank
    for result in (fsspec, connector):
        assert result["requests"] > 0 and result["served"] > 0, result
