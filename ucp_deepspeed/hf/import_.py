"""Import a Hugging Face `transformers` GPT-2, Llama or Mixtral folder as a weights-only universal checkpoint.

The inverse of `hf_export`: names go back to megatron-core's global ones, q/k/v are fused into
`linear_qkv` by query group, gate/up into SwiGLU's `linear_fc1`, and GPT-2's `Conv1D` weights are
transposed. The result holds only fp32 weights (`"weights_only": true` in the manifest, step
counters at zero, no optimizer state), so `load_checkpoint` starts training from it with a fresh
optimizer at any DP/TP/PP/EP layout. GPT-2 folders exported from a grouped-query model repeat each
key/value head; `num_kv_heads` folds them back after checking that the copies are identical.
Tensors are read lazily from the safetensors shards and written one parameter file at a time.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from safetensors import safe_open
from tqdm import tqdm

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.format.paths import check_output
from ucp_deepspeed.format.universal import BUFFERS, STATE, param_file, write_manifest, write_object, write_tensors
from ucp_deepspeed.version import __version__


def _reader(hf_dir: str) -> Callable[[str], torch.Tensor]:
    """read(name) over a single-file or sharded safetensors folder."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = json.load(f)["weight_map"]
    else:
        single = os.path.join(hf_dir, "model.safetensors")
        if not os.path.isfile(single):
            raise CheckpointError(hf_dir, "no model.safetensors or model.safetensors.index.json")
        with safe_open(single, framework="pt") as f:
            files = {k: "model.safetensors" for k in f.keys()}

    def read(name: str) -> torch.Tensor:
        if name not in files:
            raise CheckpointError(hf_dir, f"tensor {name} is missing")
        with safe_open(os.path.join(hf_dir, files[name]), framework="pt") as f:
            return f.get_tensor(name).to(torch.float32)

    return read


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Megatron-core's `linear_qkv` layout: per query group, its query heads, then its key and value head."""
    d = q.shape[0] // heads
    rest = q.shape[1:]
    q = q.reshape(kv_heads, heads // kv_heads, d, *rest)
    k, v = (t.reshape(kv_heads, 1, d, *rest) for t in (k, v))
    return torch.cat([q, k, v], 1).reshape(-1, *rest)


def _fold(t: torch.Tensor, heads: int, kv_heads: int, name: str) -> torch.Tensor:
    """Undo GPT-2 export's repetition of each key/value head for the query heads of its group."""
    grouped = t.reshape(kv_heads, heads // kv_heads, -1, *t.shape[1:])
    if not bool((grouped == grouped[:, :1]).all()):
        raise CheckpointError(name, f"key/value heads are not {heads // kv_heads} identical copies per group; "
                              "this model has no grouped-query attention to fold back")
    return grouped[:, 0].reshape(-1, *t.shape[1:])


def _gpt2(read: Callable[[str], torch.Tensor], c: dict, kv_heads: int) -> dict[str, Callable[[], torch.Tensor]]:
    heads, hidden = c["n_head"], c["n_embd"]
    out = {"embedding.word_embeddings.weight": lambda: read("transformer.wte.weight"),
           "embedding.position_embeddings.weight": lambda: read("transformer.wpe.weight")}
    for i in range(c["n_layer"]):
        h, m = f"transformer.h.{i}.", f"decoder.layers.{i}."

        def qkv(key: str, h: str = h) -> torch.Tensor:
            fused = read(f"{h}attn.c_attn.{key}")
            fused = fused.t() if key == "weight" else fused
            q, k, v = fused.split(hidden, 0)
            k, v = (_fold(t, heads, kv_heads, f"{h}attn.c_attn.{key}") for t in (k, v))
            return fuse_qkv(q, k, v, heads, kv_heads)

        for key in ("weight", "bias"):
            out[f"{m}input_layernorm.{key}"] = lambda n=f"{h}ln_1.{key}": read(n)
            out[f"{m}pre_mlp_layernorm.{key}"] = lambda n=f"{h}ln_2.{key}": read(n)
            out[f"{m}self_attention.linear_qkv.{key}"] = lambda key=key, f=qkv: f(key)
            for mg, hf in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                           ("mlp.linear_fc2", "mlp.c_proj")):
                out[f"{m}{mg}.{key}"] = (lambda n=f"{h}{hf}.weight": read(n).t().contiguous()) if key == "weight" \
                    else (lambda n=f"{h}{hf}.bias": read(n))
    for key in ("weight", "bias"):
        out[f"decoder.final_layernorm.{key}"] = lambda n=f"transformer.ln_f.{key}": read(n)
    return out


def _llama(read: Callable[[str], torch.Tensor], c: dict) -> dict[str, Callable[[], torch.Tensor]]:
    heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    out = {"embedding.word_embeddings.weight": lambda: read("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": lambda: read("model.norm.weight")}
    for i in range(c["num_hidden_layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[f"{m}self_attention.linear_qkv.weight"] = lambda h=h: fuse_qkv(
            *(read(f"{h}self_attn.{p}_proj.weight") for p in "qkv"), heads, kv_heads)
        out[f"{m}self_attention.linear_proj.weight"] = lambda h=h: read(f"{h}self_attn.o_proj.weight")
        out[f"{m}input_layernorm.weight"] = lambda h=h: read(f"{h}input_layernorm.weight")
        out[f"{m}pre_mlp_layernorm.weight"] = lambda h=h: read(f"{h}post_attention_layernorm.weight")
        if c.get("model_type") == "mixtral":
            out[f"{m}mlp.router.weight"] = lambda h=h: read(f"{h}block_sparse_moe.gate.weight")
            for e in range(c["num_local_experts"]):
                x, me = f"{h}block_sparse_moe.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
                out[f"{me}linear_fc1.weight"] = lambda x=x: torch.cat([read(f"{x}w1.weight"), read(f"{x}w3.weight")])
                out[f"{me}linear_fc2.weight"] = lambda x=x: read(f"{x}w2.weight")
        else:
            out[f"{m}mlp.linear_fc1.weight"] = lambda h=h: torch.cat(
                [read(f"{h}mlp.gate_proj.weight"), read(f"{h}mlp.up_proj.weight")])
            out[f"{m}mlp.linear_fc2.weight"] = lambda h=h: read(f"{h}mlp.down_proj.weight")
    return out


def import_hf(hf_dir: str, out: str, num_kv_heads: int | None = None, progress: bool = True) -> str:
    """Write a weights-only universal checkpoint of a `transformers` folder; returns `out`."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    kind = config.get("model_type")
    if kind not in ("gpt2", "llama", "mixtral"):
        raise CheckpointError(os.path.join(hf_dir, "config.json"), f"model_type {kind!r} is not gpt2, llama or mixtral")
    if not config.get("tie_word_embeddings", True):
        raise CheckpointError(os.path.join(hf_dir, "config.json"), "untied output layers are not supported: the "
                              "megatron-core models here share the embedding with the output layer")
    read = _reader(hf_dir)
    makers = _gpt2(read, config, num_kv_heads or config["n_head"]) if kind == "gpt2" else _llama(read, config)
    check_output(out, [hf_dir])
    if os.path.isdir(out) and os.listdir(out):
        raise CheckpointError(out, "exists and is not empty; refusing to write into it")
    records, params = [], {}
    for name, make in tqdm(makers.items(), desc="ucp import-hf", disable=not progress):
        tensor = make().contiguous()
        records.append(write_tensors(out, param_file(name), {FP32: tensor}))
        params[name] = {"shape": list(tensor.shape), "dtype": "float32", "group": 0, "trainable": True,
                        "file": param_file(name), "keys": [FP32]}
    records.append(write_tensors(out, BUFFERS, {}))
    records.append(write_object(out, STATE, {"lr_scheduler": None, "client_state": {}, "optimizer_wrapper": {}}))
    write_manifest(out, {
        "created_by": {"ucp_deepspeed": __version__, "torch": torch.__version__,
                       "transformers_config": config.get("transformers_version")},
        "source": {"path": os.path.abspath(hf_dir), "tag": None, "fingerprint": [], "versions": {},
                   "topology": {"dp": 1, "zero_stage": 0, "dtype": "fp32", "tp": 1, "pp": 1, "ep": 1,
                                "optimizer": f"none (Hugging Face {kind} import)"}},
        "weights_only": True,
        "counters": {"global_steps": 0, "global_samples": 0, "skipped_steps": 0},
        "param_groups": [],
        "params": params,
        "buffers": {},
        "tied": {},
        "frozen_excluded": False,
        "notes": [f"weights of a transformers {kind} model; optimizer state starts fresh"],
    }, records)
    return out
