"""`ucp export-hf`: megatron-core GPTs trained at TP=2 (dense) or EP=2 (MoE) load in `transformers` with the
same logits.

The checkpoint is exported straight from its native files (converted on the way). The exported
folder is loaded with `AutoModelForCausalLM.from_pretrained` from a locally written config, no hub
access, and its logits on the tokens megatron-core saw must agree to 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GPT_WORKER, torchrun

from ucp_deepspeed.format.universal import UniversalCheckpoint
from ucp_deepspeed.tools.cli import main as ucp
from ucp_deepspeed.tools.compare import diff

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(megatron_sources: dict[str, Path]) -> dict[str, Path]:
    """GPT-2- and Llama-style models at TP=2 and a Mixtral-style MoE at EP=2, trained 3 steps, saved with
    logits (conftest's `hf-*` sources)."""
    return {arch: megatron_sources[f"hf-{arch}"] for arch in ("gpt", "llama", "moe")}


@pytest.mark.parametrize("arch,hf_arch", [("gpt", "gpt2"), ("llama", "llama"), ("moe", "mixtral")])
def test_exported_model_reproduces_megatron_logits(trained, tmp_path, arch, hf_arch, capsys):
    out = tmp_path / "hf"
    assert (
        ucp(
            [
                "export-hf",
                str(trained[arch]),
                str(out),
                "--arch",
                hf_arch,
                "--num-heads",
                "4",
                "--num-kv-heads",
                "2",
                "--shard-size",
                "0.1",
                "--no-progress",
            ]
        )
        == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.eval()
    assert model.config.vocab_size == 70, "vocab padding is dropped"
    reference = torch.load(trained[arch].parent / f"hf-{arch}.logits.pt")
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    assert logits.shape == reference["logits"].shape
    assert torch.allclose(logits, reference["logits"], rtol=0, atol=1e-5), (logits - reference["logits"]).abs().max()


def test_wrong_head_count_is_a_clear_error(trained, tmp_path, capsys):
    assert (
        ucp(
            [
                "export-hf",
                str(trained["llama"]),
                str(tmp_path / "hf"),
                "--arch",
                "llama",
                "--num-heads",
                "8",
                "--no-progress",
            ]
        )
        == 2
    )
    assert "8 heads and 8 key/value heads do not fit linear_qkv" in capsys.readouterr().err
    assert not (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize(
    "arch,hf_arch,fold", [("gpt", "gpt2", "2"), ("llama", "llama", None), ("moe", "mixtral", None)]
)
def test_import_round_trip_is_exact(trained, tmp_path, arch, hf_arch, fold):
    hf, imported = tmp_path / "hf", tmp_path / "imported"
    assert (
        ucp(
            [
                "export-hf",
                str(trained[arch]),
                str(hf),
                "--arch",
                hf_arch,
                "--num-heads",
                "4",
                "--num-kv-heads",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert ucp(["import-hf", str(hf), str(imported), "--no-progress", *(["--num-kv-heads", fold] if fold else [])]) == 0
    report = diff(str(trained[arch]), str(imported))
    assert len(report.states) >= 26 and all(s.equal for s in report.states), [s for s in report.states if not s.equal]
    assert report.only_a and all(e.endswith((":exp_avg", ":exp_avg_sq")) for e in report.only_a), report.only_a
    assert not report.only_b


def test_imported_weights_start_training_at_another_layout(trained, tmp_path):
    """Exported from TP=2, imported, then loaded at PP=2 with a fresh optimizer: every weight lands exactly."""
    hf, imported, ckpt = tmp_path / "hf", tmp_path / "imported", tmp_path / "ckpt"
    ucp(
        [
            "export-hf",
            str(trained["llama"]),
            str(hf),
            "--arch",
            "llama",
            "--num-heads",
            "4",
            "--num-kv-heads",
            "2",
            "--no-progress",
        ]
    )
    ucp(["import-hf", str(hf), str(imported), "--no-progress"])
    torchrun(
        2,
        "train",
        "--arch",
        "llama",
        "--pp",
        "2",
        "--init-from",
        str(imported),
        "--ckpt-dir",
        str(ckpt),
        "--steps",
        "2",
        "--snapshots",
        "--results",
        str(tmp_path / "run.json"),
        worker=GPT_WORKER,
    )
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["resumed"]["step"] == 0 and run["resumed"]["mode"] == "universal" and run["final_step"] == 2
    loaded = torch.load(ckpt / "resumed_step0.pt", weights_only=False)
    source = UniversalCheckpoint(str(imported))
    assert sorted(loaded["fp32"]) == sorted(source.params)
    for name, value in loaded["fp32"].items():
        assert torch.equal(value, source.read(name, "fp32").reshape(value.shape)), name
    assert not loaded["state"] or all(not v.any() for v in loaded["state"].values()), "the optimizer starts fresh"
