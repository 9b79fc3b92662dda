"""Real processes beyond 4 ranks: saves at DP=8 and DP=16 resharded to other sizes and stages, bit-exactly.

The `*narrow` variants add a param group of 8 elements (a layer norm). DeepSpeed pads a ZeRO-1/2 group to a
multiple of twice the DP size and saves each partition without that padding, so at DP=8 ranks 4-7 save nothing of
it and at DP=16 ranks 4-15 do: a healthy checkpoint that was once refused as contradicting its metadata.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import load_results, torchrun

from ucp_deepspeed import UniversalCheckpoint, convert
from ucp_deepspeed.tools.cli import main as ucp

TAG = "global_step3"


def _resharded_exactly(results: Path, cases: int) -> None:
    outcomes = load_results(results)
    assert len(outcomes) == cases
    for r in outcomes:
        assert r["mode"] == "resharded" and r["diffs"] == [] and r["tensors"] >= 20, (r["source"], r["diffs"][:5])
        assert r["max_rel_loss"] <= 1e-6, r


def _same_conversion(a: str, b: str) -> None:
    left, right = UniversalCheckpoint(a), UniversalCheckpoint(b)
    assert left.params.keys() == right.params.keys()
    for name, record in left.params.items():
        for key in record.keys:
            assert torch.equal(left.read(name, key), right.read(name, key)), (name, key)


@pytest.mark.slow  # the default run saves at DP=8, 16 and 64 in one process: test_fake_world.py
def test_dp8_saves_with_empty_partitions_reshard_and_convert(tmp_path, capsys):
    torchrun(8, "save", "--out", str(tmp_path), "--variant", "z1narrow", "z2narrow", timeout=600)
    z1, z2 = tmp_path / "z1narrow", tmp_path / "z2narrow"
    for ckpt in (z1, z2):
        assert ucp(["verify", str(ckpt)]) == 0, capsys.readouterr()
    results = tmp_path / "dp3.json"
    cases = [("z2narrow", z1), ("z3narrow", z2), ("z1narrow", z2)]
    torchrun(3, "load", "--results", str(results), *(a for t, s in cases for a in ("--case", t, str(s))))
    _resharded_exactly(results, len(cases))
    # without our metadata, the layout is rebuilt from DeepSpeed's files with its padding rule
    bare = tmp_path / "bare"
    shutil.copytree(z2, bare, ignore=shutil.ignore_patterns("ucp_meta_*", "*.universal"))
    _same_conversion(
        convert(str(z2), TAG, output=str(tmp_path / "with"), progress=False),
        convert(str(bare), TAG, output=str(tmp_path / "without"), progress=False),
    )


@pytest.mark.scale  # 16 processes: about 2 minutes here, so outside the default run (`python -m pytest -m scale`)
def test_dp16_saves_with_empty_partitions_reshard(tmp_path):
    torchrun(16, "save", "--out", str(tmp_path), "--variant", "z1narrow", "z2narrow", timeout=900)
    results = tmp_path / "dp8.json"
    cases = [("z2narrow", tmp_path / "z1narrow"), ("z3narrow", tmp_path / "z2narrow")]
    torchrun(8, "load", "--results", str(results), *(a for t, s in cases for a in ("--case", t, str(s))), timeout=600)
    _resharded_exactly(results, len(cases))
