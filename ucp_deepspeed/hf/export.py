"""Export a megatron-core GPT's universal checkpoint as a Hugging Face `transformers` model folder.

The universal format already holds whole tensors under megatron-core's global names, with vocab
padding removed, so an export is the architecture's name table (`hf/names.py`) read from
megatron-core's side: renamings, plus the un-fusing of `linear_qkv` into q/k/v, of SwiGLU's
`linear_fc1` into gate and up, and GPT-2's transposed `Conv1D` weights.

The output is `config.json`, `model-0000k-of-0000n.safetensors` shards and
`model.safetensors.index.json`, written atomically. Shards are planned from the manifest's shapes
before any tensor is read, and each file is streamed one tensor at a time (`stream_tensors`), so
memory stays bounded by the largest tensor. The embedding and output layer are tied, as in the
megatron-core model.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ucp_deepspeed.convert.core import convert
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.format.paths import check_output, locate
from ucp_deepspeed.format.universal import MANIFEST, UniversalCheckpoint, atomic_write, stream_tensors
from ucp_deepspeed.hf.names import Heads, Link, hf_shapes, links, to_hf

ARCHS = ("gpt2", "llama", "mixtral")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT_FC2 = re.compile(r"decoder\.layers\.0\.mlp\.experts\.local_experts\.\d+\.linear_fc2\.weight")


@dataclass(frozen=True)
class Shape:
    """What the exporter needs to know about the model beyond tensor shapes."""

    layers: int
    hidden: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int
    max_positions: int
    experts: int

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


@dataclass(frozen=True)
class Entry:
    """One tensor of the exported model: its name, shape, and how to make it from the checkpoint."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]


def _shape(ckpt: UniversalCheckpoint, heads: int, kv_heads: int | None, max_positions: int | None) -> Shape:
    params = ckpt.params
    layers = 1 + max((int(m.group(1)) for n in params if (m := _LAYER.match(n))), default=-1)
    vocab, hidden = params["embedding.word_embeddings.weight"].shape
    experts = sum(1 for n in params if _EXPERT_FC2.fullmatch(n))
    fc2 = (
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
        if experts
        else "decoder.layers.0.mlp.linear_fc2.weight"
    )
    ffn = params[fc2].shape[1]
    kv_heads = kv_heads or heads
    qkv_rows = params["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0]
    if hidden % heads or heads % kv_heads or qkv_rows != (heads + 2 * kv_heads) * (hidden // heads):
        raise CheckpointError(
            ckpt.root,
            f"{heads} heads and {kv_heads} key/value heads do not fit linear_qkv "
            f"({qkv_rows} rows for hidden size {hidden}); pass --num-heads / --num-kv-heads",
        )
    position = params.get("embedding.position_embeddings.weight")
    positions = position.shape[0] if position is not None else max_positions or 4096
    return Shape(layers, hidden, ffn, vocab, heads, kv_heads, max_positions or positions, experts)


def entries(arch: str, read: Callable[[str], torch.Tensor], ckpt: UniversalCheckpoint, s: Shape) -> list[Entry]:
    """Every tensor of the exported model, from the architecture's name table, in file order."""
    heads = Heads(s.heads, s.kv_heads)

    def make(link: Link, j: int) -> torch.Tensor:
        return to_hf(link, read(link.mcore), heads)[j]

    out = []
    for link in links(arch, s.layers, s.experts):
        if link.mcore not in ckpt.params:
            raise CheckpointError(ckpt.root, f"{arch} export needs {link.mcore}, which this checkpoint lacks")
        shapes = hf_shapes(link, ckpt.params[link.mcore].shape, heads)
        out += [
            Entry(name, shape, functools.partial(make, link, j)) for j, (name, shape) in enumerate(zip(link.hf, shapes))
        ]
    return out


def _config(arch: str, s: Shape, norm_eps: float, rope_theta: float, experts_per_token: int) -> dict:
    if arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": s.vocab,
            "n_positions": s.max_positions,
            "n_embd": s.hidden,
            "n_layer": s.layers,
            "n_head": s.heads,
            "n_inner": s.ffn,
            "activation_function": "gelu",
            "layer_norm_epsilon": norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "eos_token_id": None,
            "torch_dtype": "float32",
        }
    moe = (
        {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": s.experts,
            "num_experts_per_tok": experts_per_token,
            "router_aux_loss_coef": 0.0,
            "output_router_logits": False,
            "sliding_window": None,
        }
        if arch == "mixtral"
        else {}
    )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": s.max_positions,
        "rms_norm_eps": norm_eps,
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
        **moe,
    }


def plan_shards(entries: list[Entry], shard_bytes: int) -> list[list[Entry]]:
    """Consecutive entries grouped into files of at most `shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry.shape) * 4
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def export_hf(
    path: str,
    out: str,
    arch: str,
    num_heads: int,
    num_kv_heads: int | None = None,
    norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
    max_positions: int | None = None,
    shard_bytes: int = 2 * 2**30,
    progress: bool = True,
    experts_per_token: int = 2,
) -> str:
    """Write a `transformers` model folder from a universal (or native, converted first) checkpoint."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    check_output(out, [locate(path).path])
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        path = convert(path, progress=progress)
    ckpt = UniversalCheckpoint(path)
    s = _shape(ckpt, num_heads, num_kv_heads, max_positions)
    if (arch == "mixtral") != bool(s.experts):
        raise CheckpointError(
            ckpt.root,
            f"--arch {arch} does not fit a checkpoint with {s.experts or 'no'} experts "
            "per layer (mixtral is for MoE checkpoints, gpt2 and llama for dense ones)",
        )

    @functools.lru_cache(maxsize=1)  # q/k/v and gate/up come from one fused tensor: read it once, not 2-3 times
    def read(name: str) -> torch.Tensor:
        if name not in ckpt.params:
            raise CheckpointError(ckpt.root, f"{arch} export needs {name}, which this checkpoint lacks")
        record = ckpt.params[name]
        key = FP32 if FP32 in record.keys else VALUE
        return ckpt.read(name, key).reshape(record.shape).to(torch.float32)

    tensors = entries(arch, read, ckpt, s)
    shards = plan_shards(tensors, shard_bytes)
    os.makedirs(out, exist_ok=True)
    weight_map, total = {}, 0
    bar = tqdm(
        total=sum(math.prod(e.shape) * 4 for e in tensors),
        unit="B",
        unit_scale=True,
        desc="ucp export-hf",
        disable=not progress,
    )
    for index, shard in enumerate(shards, 1):
        fname = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        makers = {e.name: e for e in shard}

        def produce(name: str, makers: dict[str, Entry] = makers) -> torch.Tensor:
            tensor = makers[name].make()
            if tuple(tensor.shape) != makers[name].shape:
                raise CheckpointError(
                    ckpt.root, f"{name}: made shape {tuple(tensor.shape)}, expected {makers[name].shape}"
                )
            bar.update(tensor.numel() * 4)
            return tensor

        stream_tensors(out, fname, [(e.name, torch.float32, e.shape) for e in shard], produce)
        total += sum(math.prod(e.shape) * 4 for e in shard)
        weight_map.update({e.name: fname for e in shard})
    bar.close()
    atomic_write(
        os.path.join(out, "model.safetensors.index.json"),
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode(),
    )
    atomic_write(
        os.path.join(out, "config.json"),
        json.dumps(_config(arch, s, norm_eps, rope_theta, experts_per_token), indent=1).encode(),
    )
    return out
