"""DeepSpeed's own universal layout: we write it for stock DeepSpeed, and we load what ds_to_universal wrote."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ds_to_universal, load_results, torchrun

from ucp_deepspeed.tools.cli import main as cli_main


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.universal"))
    return dst


def _ds_to_universal(ckpt: Path) -> Path:
    return ds_to_universal(ckpt / "global_step3", ckpt / "global_step3_universal")


def test_export_matches_ds_to_universal_and_loads_in_stock_deepspeed(sources, tmp_path):
    theirs = _copy(sources["z1"], tmp_path / "theirs")
    ours = _copy(sources["z1"], tmp_path / "ours")
    _ds_to_universal(theirs)
    assert cli_main(["convert", "--format", "deepspeed", "--no-progress", str(ours)]) == 0
    assert (ours / "latest_universal").read_text() == "global_step3_universal"
    compared = 0
    for param_dir in sorted((ours / "global_step3_universal" / "zero").iterdir()):
        if not param_dir.is_dir():
            continue
        ref_dir = theirs / "global_step3_universal" / "zero" / param_dir.name
        assert sorted(p.name for p in param_dir.iterdir()) == sorted(p.name for p in ref_dir.iterdir()), param_dir.name
        for f in param_dir.iterdir():
            a, b = torch.load(f, weights_only=False), torch.load(ref_dir / f.name, weights_only=False)
            if isinstance(b, dict):
                assert a.keys() == b.keys(), f
                assert torch.equal(a["param"], b["param"]) and a["param"].dtype == b["param"].dtype, f
                assert {k: v for k, v in a.items() if k != "param"} == {k: v for k, v in b.items() if k != "param"}, f
            else:
                assert torch.equal(a, b) and a.dtype == b.dtype, f
            compared += 1
    assert compared >= 28
    results_file = tmp_path / "stock.json"
    torchrun(
        3, "load", "--stock", "--variant", "z1", "--results", str(results_file), "--source", str(ours), str(theirs)
    )
    with open(results_file) as f:
        result = json.load(f)
    assert result["tensors"] >= 20
    assert result["vs_reference"] == [[], []], "stock DeepSpeed did not restore the saved state exactly"
    assert result["vs_first"] == [[]], "ours and ds_to_universal's output load differently"


@pytest.mark.slow
def test_resume_from_a_ds_to_universal_folder(sources, tmp_path):
    ckpt = _copy(sources["z1"], tmp_path / "ckpt")
    folder = _ds_to_universal(ckpt)
    shutil.copy(ckpt / "reference.pt", folder / "reference.pt")  # where the test worker looks for it
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    results_file = tmp_path / "results.json"
    torchrun(3, "load", "--variant", "z2", "--results", str(results_file), "--source", str(folder))
    [r] = load_results(results_file)
    assert r["mode"] == "imported"
    assert r["diffs"] == [], "\n".join(r["diffs"])
    assert r["tensors"] >= 30  # buffers and the frozen parameter come from the model-states file
    assert r["max_rel_loss"] <= 1e-6
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == before, "DeepSpeed's folder was modified"
    manifest = json.loads((tmp_path / "ckpt" / "global_step3_universal.ucp" / "manifest.json").read_text())
    assert manifest["source"]["format"] == "deepspeed_universal"
    assert "mp_rank_00_model_states.pt" in manifest["notes"][0]
