"""Hugging Face models in and out: `ucp import-hf`, megatron-core training at another layout, `ucp export-hf`.

Each model of `hf_zoo` (GPT-2, Llama 3.1 untied with RoPE scaling, Llama with biases, Mistral with a
sliding window, Qwen2 with q/k/v biases, Mixtral) is saved by `transformers`, imported, and built in
megatron-core from the model the import recorded, at TP=2 and at PP=2 (Mixtral: EP=2 and PP=2),
through `initialize` + `load_checkpoint`. Its logits must equal `transformers`' within 1e-5; after
two training steps and a save, `ucp export-hf` with no flags must give a folder whose
`from_pretrained` logits equal megatron-core's within 1e-5. All runs share one launch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import hf_zoo
import pytest
import torch
from conftest import launch_jobs
from safetensors import safe_open
from safetensors.torch import save_file

from ucp_deepspeed.format.universal import UniversalCheckpoint
from ucp_deepspeed.tools.cli import main as ucp
from ucp_deepspeed.tools.cli import summarize
from ucp_deepspeed.tools.compare import diff

transformers = pytest.importorskip("transformers")

LAYOUTS = {name: ("ep2", "pp2") if name == "mixtral" else ("tp2", "pp2") for name in hf_zoo.ZOO}
LAYOUT_ARGS = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "ep2": ["--ep", "2"]}
CELLS = [(name, layout) for name, layouts in LAYOUTS.items() for layout in layouts]
RESUMED = ("llama3", "tp2")  # also resumed as a full training job at TP=1 DP=2
TOL = 1e-5


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder, as stored (dtype kept)."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def logits_of(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each model saved by `transformers` (sharded, fp32; Llama 3.1 in bf16 as on the Hub) and imported."""
    root = tmp_path_factory.mktemp("zoo")
    for name in hf_zoo.ZOO:
        hf_zoo.make(name, root / name, dtype=torch.bfloat16 if name == "llama3" else torch.float32)
        assert ucp(["import-hf", str(root / name), str(root / f"{name}.universal"), "--no-progress"]) == 0
    return {name: root / name for name in hf_zoo.ZOO}


@pytest.fixture(scope="module")
def runs(zoo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of 2 ranks: every model at each of its layouts loads its import, records logits, trains two
    steps and saves; then the Llama 3.1 run saved at TP=2 is resumed at TP=1 DP=2 and compared state by state."""
    root = tmp_path_factory.mktemp("hf_runs")
    jobs = []
    for name, layout in CELLS:
        imported = str(zoo[name].parent / f"{name}.universal")
        cell = root / f"{name}-{layout}"
        resumed = (name, layout) == RESUMED
        jobs.append(
            [
                "save",
                "--model",
                imported,
                "--init-from",
                imported,
                *LAYOUT_ARGS[layout],
                "--out",
                str(cell),
                "--save-steps",
                "2",
                "--cont",
                "2" if resumed else "0",
                "--logits-init",
                f"{cell}.init.pt",
                "--logits",
                f"{cell}.saved.pt",
            ]
        )
    name, layout = RESUMED
    imported = str(zoo[name].parent / f"{name}.universal")
    source = root / f"{name}-{layout}"
    jobs.append(
        ["load", "--model", imported, "--source", str(source), "--cont", "2", "--results", str(root / "resumed.json")]
    )
    launch_jobs(2, jobs)
    return root


@pytest.mark.parametrize("name", list(hf_zoo.ZOO))
def test_import_then_export_returns_every_tensor_and_the_config(zoo, tmp_path, name):
    """No flags: the import records the model and the original config; the export gives both back exactly
    (Llama 3.1 in bf16 with `--dtype bf16`, bit for bit)."""
    out = tmp_path / "out"
    dtype = ["--dtype", "bf16"] if name == "llama3" else []
    assert ucp(["export-hf", str(zoo[name].parent / f"{name}.universal"), str(out), "--no-progress", *dtype]) == 0
    original, exported = tensors(zoo[name]), tensors(out)
    assert sorted(original) == sorted(exported)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key
    assert json.loads((out / "config.json").read_text()) == json.loads((zoo[name] / "config.json").read_text())


@pytest.mark.parametrize("name,layout", CELLS)
def test_megatron_core_computes_what_transformers_does(zoo, runs, name, layout):
    reference = torch.load(zoo[name] / "logits.pt")
    got = torch.load(runs / f"{name}-{layout}.init.pt")
    assert torch.equal(got["tokens"], reference["tokens"])
    assert (got["logits"] - reference["logits"]).abs().max() <= TOL


@pytest.mark.parametrize("name,layout", CELLS)
def test_trained_checkpoint_exports_with_no_flags(zoo, runs, tmp_path, name, layout):
    """The native checkpoint of the trained run (converted on the way) exports to a Hub-style folder that
    `from_pretrained` loads with megatron-core's logits; the original's token ids survive training."""
    out = tmp_path / "hf"
    assert ucp(["export-hf", str(runs / f"{name}-{layout}"), str(out), "--shard-size", "0.05", "--no-progress"]) == 0
    saved = torch.load(runs / f"{name}-{layout}.saved.pt")
    assert (logits_of(out, saved["tokens"]) - saved["logits"]).abs().max() <= TOL
    assert not torch.allclose(saved["logits"], torch.load(runs / f"{name}-{layout}.init.pt")["logits"]), "trained"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    config, original = (json.loads((d / "config.json").read_text()) for d in (out, zoo[name]))
    for key in ("model_type", "bos_token_id", "eos_token_id", "tie_word_embeddings", "vocab_size"):
        assert config.get(key) == original.get(key), key
    recorded = UniversalCheckpoint(str(zoo[name].parent / f"{name}.universal")).manifest.model
    converted = UniversalCheckpoint(str(runs / f"{name}-{layout}" / "global_step2.universal"))
    assert converted.manifest.model == recorded, "megatron-core's save records the model the import did"


def test_imported_run_resumes_at_another_layout_with_exact_state(runs):
    """Imported, trained and saved at TP=2, resumed at TP=1 DP=2: every fp32 weight and Adam state equal, and the
    next losses those of the uninterrupted run."""
    [result] = json.loads((runs / "resumed.json").read_text())
    assert result["mode"] == "resharded" and result["saved"] != result["live"]
    assert result["diffs"] == [] and result["tensors"] == 3 * 15  # fp32, exp_avg, exp_avg_sq of 15 tensors
    assert result["max_rel_loss"] < 1e-5


def test_trained_experts_round_trip_through_transformers(runs, tmp_path):
    """Mixtral trained at EP=2: export, import back, and every weight equals the checkpoint's (experts by global
    id, from both expert-parallel ranks)."""
    hf, back = tmp_path / "hf", tmp_path / "back"
    assert ucp(["export-hf", str(runs / "mixtral-ep2"), str(hf), "--no-progress"]) == 0
    assert ucp(["import-hf", str(hf), str(back), "--no-progress"]) == 0
    report = diff(str(runs / "mixtral-ep2"), str(back))
    weights = [s for s in report.states if s.key == "fp32"]
    assert len(weights) == 2 * (5 + 2 * 4) + 3 and all(s.equal for s in report.states)
    assert not report.only_b


def _edit_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "name,changes,field",
    [
        ("llama-bias", {"mlp_bias": False}, "mlp_bias=False"),
        ("llama3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters="),
        ("gpt2", {"activation_function": "gelu_fast"}, "activation_function='gelu_fast'"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ("llama3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ("llama3", {"num_key_value_heads": 4}, "k_proj.weight has shape (16, 64); the config says (32, 64)"),
        ("mistral", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "transformers refuses"),
    ],
)
def test_a_config_field_megatron_cannot_carry_is_refused_by_name(zoo, tmp_path, capsys, name, changes, field):
    folder = _edit_config(zoo[name], tmp_path / name, **changes)
    assert ucp(["import-hf", str(folder), str(tmp_path / "out"), "--no-progress"]) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_base_model_file_imports_like_the_causal_one(zoo, tmp_path):
    """The Hub's own GPT-2 stores `wte.weight`, `h.0...`: the base model's names, without `transformer.`."""
    folder = tmp_path / "gpt2-base"
    folder.mkdir()
    shutil.copy(zoo["gpt2"] / "config.json", folder)
    base = {k.removeprefix("transformer."): v for k, v in tensors(zoo["gpt2"]).items()}
    save_file(base, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert ucp(["import-hf", str(folder), str(tmp_path / "out"), "--no-progress"]) == 0
    assert diff(str(zoo["gpt2"].parent / "gpt2.universal"), str(tmp_path / "out")).identical


def test_a_tensor_without_a_place_is_refused(zoo, tmp_path, capsys):
    """A Llama folder that says no biases but holds them: importing would drop them silently."""
    folder = _edit_config(zoo["llama-bias"], tmp_path / "folder", attention_bias=False, mlp_bias=False)
    assert ucp(["import-hf", str(folder), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "has no place in the megatron-core model; it would be dropped" in capsys.readouterr().err


def test_flags_override_and_are_checked_against_shapes(zoo, tmp_path, capsys):
    imported = str(zoo["llama3"].parent / "llama3.universal")
    assert ucp(["export-hf", imported, str(tmp_path / "a"), "--num-heads", "5", "--no-progress"]) == 2
    assert "5 heads and 5 key/value heads do not fit linear_qkv" in capsys.readouterr().err
    assert not (tmp_path / "a" / "config.json").exists()
    assert ucp(["export-hf", imported, str(tmp_path / "b"), "--arch", "gpt2", "--no-progress"]) == 2
    assert "normalization='RMSNorm': a gpt2 model needs LayerNorm" in capsys.readouterr().err
    assert ucp(["export-hf", imported, str(tmp_path / "c"), "--rope-theta", "1000", "--no-progress"]) == 0
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 1000.0
    assert summarize(imported)["model"]["num_query_groups"] == 2, "ucp inspect shows the recorded model"


def test_a_checkpoint_without_a_recorded_model_exports_with_flags(zoo, tmp_path, capsys):
    """A universal folder that records no model (as from DeepSpeed's own converter): flags say what the tensors
    cannot, the rest (biases, GLU, tie, experts) is read off the tensors, and the export is exact."""
    bare = tmp_path / "bare"
    shutil.copytree(zoo["qwen2"].parent / "qwen2.universal", bare)
    manifest = json.loads((bare / "manifest.json").read_text())
    del manifest["model"], manifest["hf_config"]
    (bare / "manifest.json").write_text(json.dumps(manifest))
    assert ucp(["export-hf", str(bare), str(tmp_path / "no"), "--no-progress"]) == 2
    assert (
        "records no model (saved without ucp_deepspeed?); pass --arch --num-heads --norm-eps --activation "
        "--rope-theta" in capsys.readouterr().err
    )
    flags = ["--arch", "qwen2", "--num-heads", "8", "--num-kv-heads", "2", "--norm-eps", "1e-6", "--activation", "silu"]
    flags += ["--rope-theta", "1e6", "--max-positions", "128"]
    assert ucp(["export-hf", str(bare), str(tmp_path / "out"), *flags, "--no-progress"]) == 0
    original, exported = tensors(zoo["qwen2"]), tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported) and all(torch.equal(exported[k], v) for k, v in original.items())
    reference = torch.load(zoo["qwen2"] / "logits.pt")
    assert (logits_of(tmp_path / "out", reference["tokens"]) - reference["logits"]).abs().max() <= TOL
