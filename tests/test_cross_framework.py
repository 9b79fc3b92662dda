"""Checkpoints saved without ucp_deepspeed: plain DeepSpeed, and Hugging Face Trainer / Accelerate jobs.

Plain DeepSpeed checkpoints carry no ucp metadata; `ucp convert` rebuilds it from DeepSpeed's own
files (param_shapes, shared_params, flat partitions) and the result must load bit-exactly at another
DP size and ZeRO stage.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_results, torchrun
from ucp_deepspeed.cli import main as cli_main


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TinyLM (tied embedding, frozen parameter, buffer, client state) saved by plain DeepSpeed at dp=2."""
    out = tmp_path_factory.mktemp("plain")
    torchrun(2, "save", "--plain", "--out", str(out), "--variant", "z1", "z3", attempts=2)
    return out


def test_plain_deepspeed_checkpoint_converts_and_reshards(plain, tmp_path):
    """DP 2->3 and ZeRO 1->3 from checkpoints DeepSpeed saved on its own, converted with `ucp convert`."""
    for name in ("z1", "z3"):
        assert not list((plain / name).glob("*/ucp_meta_*")), "saved through ucp_deepspeed after all"
        assert cli_main(["convert", str(plain / name), "--no-progress"]) == 0
        assert cli_main(["verify", str(plain / name / "global_step3.universal")]) == 0
    torchrun(3, "load", "--variant", "z1", "--results", str(tmp_path / "z1.json"),
             "--source", str(plain / "z1"), str(plain / "z3"))
    torchrun(3, "load", "--variant", "z3", "--results", str(tmp_path / "z3.json"), "--source", str(plain / "z1"))
    results = load_results(tmp_path / "z1.json") + load_results(tmp_path / "z3.json")
    assert [(r["saved"], r["live"]) for r in results] == [
        ("zero1 dp=2 fp32", "zero1 dp=3 fp32"), ("zero3 dp=2 fp32", "zero1 dp=3 fp32"),
        ("zero1 dp=2 fp32", "zero3 dp=3 fp32")]
    for r in results:  # fp32 weights, Adam states, step, hyperparameters, buffer, frozen, tied, client_state
        assert r["mode"] == "resharded" and r["diffs"] == [] and r["tensors"] == 32, r
        assert r["max_rel_loss"] < 1e-6, r
