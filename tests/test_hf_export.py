"""`ucp export-hf`: a megatron-core GPT trained at TP=2 loads in `transformers` with the same logits.

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
from ucp_deepspeed.cli import main as ucp

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A GPT-2-style and a Llama-style megatron-core model, trained 3 steps at TP=2 and saved with their logits."""
    root = tmp_path_factory.mktemp("hf")
    for arch in ("gpt", "llama"):
        torchrun(2, "save", "--arch", arch, "--tp", "2", "--out", str(root / arch), "--logits",
                 str(root / f"{arch}.logits.pt"), worker=GPT_WORKER)
    return {"gpt": root / "gpt", "llama": root / "llama", "root": root}


@pytest.mark.parametrize("arch,hf_arch", [("gpt", "gpt2"), ("llama", "llama")])
def test_exported_model_reproduces_megatron_logits(trained, tmp_path, arch, hf_arch, capsys):
    out = tmp_path / "hf"
    assert ucp(["export-hf", str(trained[arch]), str(out), "--arch", hf_arch, "--num-heads", "4",
                "--num-kv-heads", "2", "--shard-size", "0.1", "--no-progress"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.eval()
    assert model.config.vocab_size == 70, "vocab padding is dropped"
    reference = torch.load(trained["root"] / f"{arch}.logits.pt")
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    assert logits.shape == reference["logits"].shape
    assert torch.allclose(logits, reference["logits"], rtol=0, atol=1e-5), (logits - reference["logits"]).abs().max()


def test_wrong_head_count_is_a_clear_error(trained, tmp_path, capsys):
    assert ucp(["export-hf", str(trained["llama"]), str(tmp_path / "hf"), "--arch", "llama", "--num-heads", "8",
                "--no-progress"]) == 2
    assert "8 heads and 8 key/value heads do not fit linear_qkv" in capsys.readouterr().err
    assert not (tmp_path / "hf" / "config.json").exists()
