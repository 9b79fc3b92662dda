"""Export a megatron-core GPT's universal checkpoint as a Hugging Face `transformers` model folder.

The universal format already holds whole tensors under megatron-core's global names, with vocab
padding removed, so an export is a renaming plus three un-fusings:

- `linear_qkv` holds, per query group, that group's query heads, then its key head, then its value
  head (`[q_1 .. q_h/g, k, v]` x g along dim 0). It is split into q, k and v. GPT-2 has no
  grouped-query attention, so each key/value head is repeated for the query heads of its group
  (exactly what grouped-query attention computes).
- SwiGLU's `linear_fc1` is `[gate; up]` along dim 0 and becomes `gate_proj` and `up_proj`.
- GPT-2's `Conv1D` layers store `[in, out]`, the transpose of megatron-core's `[out, in]`.

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
    vocab, hidden = params["embedding.word_embeddings.weight"]["shape"]
    experts = sum(1 for n in params if _EXPERT_FC2.fullmatch(n))
    fc2 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight" if experts else \
        "decoder.layers.0.mlp.linear_fc2.weight"
    ffn = params[fc2]["shape"][1]
    kv_heads = kv_heads or heads
    qkv_rows = params["decoder.layers.0.self_attention.linear_qkv.weight"]["shape"][0]
    if hidden % heads or heads % kv_heads or qkv_rows != (heads + 2 * kv_heads) * (hidden // heads):
        raise CheckpointError(ckpt.root, f"{heads} heads and {kv_heads} key/value heads do not fit linear_qkv "
                              f"({qkv_rows} rows for hidden size {hidden}); pass --num-heads / --num-kv-heads")
    positions = params.get("embedding.position_embeddings.weight", {}).get("shape", [max_positions or 4096])[0]
    return Shape(layers, hidden, ffn, vocab, heads, kv_heads, max_positions or positions, experts)


def _qkv(read: Callable[[str], torch.Tensor], name: str, s: Shape, part: str, repeat: bool) -> torch.Tensor:
    """Query, key or value rows of a fused megatron-core QKV weight or bias, by head."""
    fused = read(name)
    per_group = s.heads // s.kv_heads
    grouped = fused.reshape(s.kv_heads, per_group + 2, s.head_dim, *fused.shape[1:])
    if part == "q":
        return grouped[:, :per_group].reshape(s.heads * s.head_dim, *fused.shape[1:])
    one = grouped[:, per_group if part == "k" else per_group + 1]
    if repeat:
        one = one.repeat_interleave(per_group, dim=0)
    return one.reshape(-1, *fused.shape[1:])


def _gpt2(read: Callable[[str], torch.Tensor], s: Shape) -> list[Entry]:
    out = [Entry("transformer.wte.weight", (s.vocab, s.hidden), lambda: read("embedding.word_embeddings.weight")),
           Entry("transformer.wpe.weight", (s.max_positions, s.hidden),
                 lambda: read("embedding.position_embeddings.weight"))]
    for i in range(s.layers):
        m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        qkv = f"{m}self_attention.linear_qkv."

        def c_attn(key: str, qkv: str = qkv) -> torch.Tensor:
            parts = [_qkv(read, qkv + key, s, p, repeat=True) for p in "qkv"]
            return torch.cat(parts, 0).t().contiguous() if key == "weight" else torch.cat(parts, 0)

        pairs = [(f"{h}ln_1.{k}", f"{m}input_layernorm.{k}") for k in ("weight", "bias")]
        pairs += [(f"{h}ln_2.{k}", f"{m}pre_mlp_layernorm.{k}") for k in ("weight", "bias")]
        out += [Entry(hf, (s.hidden,), lambda n=mg: read(n)) for hf, mg in pairs]
        out += [Entry(f"{h}attn.c_attn.weight", (s.hidden, 3 * s.hidden), lambda f=c_attn: f("weight")),
                Entry(f"{h}attn.c_attn.bias", (3 * s.hidden,), lambda f=c_attn: f("bias"))]
        for hf, mg, shape in ((f"{h}attn.c_proj", f"{m}self_attention.linear_proj", (s.hidden, s.hidden)),
                              (f"{h}mlp.c_fc", f"{m}mlp.linear_fc1", (s.hidden, s.ffn)),
                              (f"{h}mlp.c_proj", f"{m}mlp.linear_fc2", (s.ffn, s.hidden))):
            out.append(Entry(f"{hf}.weight", shape, lambda n=f"{mg}.weight": read(n).t().contiguous()))
            out.append(Entry(f"{hf}.bias", (shape[1],), lambda n=f"{mg}.bias": read(n)))
    out += [Entry(f"transformer.ln_f.{k}", (s.hidden,), lambda n=f"decoder.final_layernorm.{k}": read(n))
            for k in ("weight", "bias")]
    return out


def _swiglu(read: Callable[[str], torch.Tensor], s: Shape, m: str, h: str, names: tuple[str, str, str]
            ) -> list[Entry]:
    """A megatron-core SwiGLU MLP (`m`) as separate gate / up / down projections named `names` under `h`."""
    fc1 = f"{m}linear_fc1.weight"
    gate, up, down = names
    return [Entry(f"{h}{gate}.weight", (s.ffn, s.hidden), lambda: read(fc1)[: s.ffn]),
            Entry(f"{h}{up}.weight", (s.ffn, s.hidden), lambda: read(fc1)[s.ffn:]),
            Entry(f"{h}{down}.weight", (s.hidden, s.ffn), lambda: read(f"{m}linear_fc2.weight"))]


def _llama(read: Callable[[str], torch.Tensor], s: Shape) -> list[Entry]:
    """Llama, or Mixtral when the checkpoint has experts: the attention and norms are the same."""
    out = [Entry("model.embed_tokens.weight", (s.vocab, s.hidden), lambda: read("embedding.word_embeddings.weight"))]
    kv = s.kv_heads * s.head_dim
    for i in range(s.layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = f"{m}self_attention.linear_qkv.weight"
        if s.experts:
            out.append(Entry(f"{h}block_sparse_moe.gate.weight", (s.experts, s.hidden),
                             lambda n=f"{m}mlp.router.weight": read(n)))
            for e in range(s.experts):
                out += _swiglu(read, s, f"{m}mlp.experts.local_experts.{e}.", f"{h}block_sparse_moe.experts.{e}.",
                               ("w1", "w3", "w2"))
        else:
            out += _swiglu(read, s, f"{m}mlp.", f"{h}mlp.", ("gate_proj", "up_proj", "down_proj"))
        out += [
            Entry(f"{h}self_attn.q_proj.weight", (s.hidden, s.hidden), lambda n=qkv: _qkv(read, n, s, "q", False)),
            Entry(f"{h}self_attn.k_proj.weight", (kv, s.hidden), lambda n=qkv: _qkv(read, n, s, "k", False)),
            Entry(f"{h}self_attn.v_proj.weight", (kv, s.hidden), lambda n=qkv: _qkv(read, n, s, "v", False)),
            Entry(f"{h}self_attn.o_proj.weight", (s.hidden, s.hidden),
                  lambda n=f"{m}self_attention.linear_proj.weight": read(n)),
            Entry(f"{h}input_layernorm.weight", (s.hidden,), lambda n=f"{m}input_layernorm.weight": read(n)),
            Entry(f"{h}post_attention_layernorm.weight", (s.hidden,),
                  lambda n=f"{m}pre_mlp_layernorm.weight": read(n)),
        ]
    out.append(Entry("model.norm.weight", (s.hidden,), lambda: read("decoder.final_layernorm.weight")))
    return out


def _config(arch: str, s: Shape, norm_eps: float, rope_theta: float, experts_per_token: int) -> dict:
    if arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": s.vocab,
                "n_positions": s.max_positions, "n_embd": s.hidden, "n_layer": s.layers, "n_head": s.heads,
                "n_inner": s.ffn, "activation_function": "gelu", "layer_norm_epsilon": norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True,
                "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    moe = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": s.experts,
           "num_experts_per_tok": experts_per_token, "router_aux_loss_coef": 0.0, "output_router_logits": False,
           "sliding_window": None} if arch == "mixtral" else {}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": s.vocab,
            "hidden_size": s.hidden, "intermediate_size": s.ffn, "num_hidden_layers": s.layers,
            "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
            "max_position_embeddings": s.max_positions, "rms_norm_eps": norm_eps, "rope_theta": rope_theta,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
            "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32", **moe}


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


def export_hf(path: str, out: str, arch: str, num_heads: int, num_kv_heads: int | None = None,
              norm_eps: float = 1e-5, rope_theta: float = 10000.0, max_positions: int | None = None,
              shard_bytes: int = 2 * 2**30, progress: bool = True, experts_per_token: int = 2) -> str:
    """Write a `transformers` model folder from a universal (or native, converted first) checkpoint."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    check_output(out, [locate(path).path])
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        path = convert(path, progress=progress)
    ckpt = UniversalCheckpoint(path)
    s = _shape(ckpt, num_heads, num_kv_heads, max_positions)
    if (arch == "mixtral") != bool(s.experts):
        raise CheckpointError(ckpt.root, f"--arch {arch} does not fit a checkpoint with {s.experts or 'no'} experts "
                              "per layer (mixtral is for MoE checkpoints, gpt2 and llama for dense ones)")

    @functools.lru_cache(maxsize=1)  # q/k/v and gate/up come from one fused tensor: read it once, not 2-3 times
    def read(name: str) -> torch.Tensor:
        if name not in ckpt.params:
            raise CheckpointError(ckpt.root, f"{arch} export needs {name}, which this checkpoint lacks")
        record = ckpt.params[name]
        key = FP32 if FP32 in record["keys"] else VALUE
        return ckpt.read(name, key).reshape(record["shape"]).to(torch.float32)

    entries = _gpt2(read, s) if arch == "gpt2" else _llama(read, s)
    shards = plan_shards(entries, shard_bytes)
    os.makedirs(out, exist_ok=True)
    weight_map, total = {}, 0
    bar = tqdm(total=sum(math.prod(e.shape) * 4 for e in entries), unit="B", unit_scale=True, desc="ucp export-hf",
               disable=not progress)
    for index, shard in enumerate(shards, 1):
        fname = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        makers = {e.name: e for e in shard}

        def produce(name: str, makers: dict[str, Entry] = makers) -> torch.Tensor:
            tensor = makers[name].make()
            if tuple(tensor.shape) != makers[name].shape:
                raise CheckpointError(ckpt.root, f"{name}: made shape {tuple(tensor.shape)}, "
                                      f"expected {makers[name].shape}")
            bar.update(tensor.numel() * 4)
            return tensor

        stream_tensors(out, fname, [(e.name, torch.float32, e.shape) for e in shard], produce)
        total += sum(math.prod(e.shape) * 4 for e in shard)
        weight_map.update({e.name: fname for e in shard})
    bar.close()
    atomic_write(os.path.join(out, "model.safetensors.index.json"),
                 json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode())
    atomic_write(os.path.join(out, "config.json"),
                 json.dumps(_config(arch, s, norm_eps, rope_theta, experts_per_token), indent=1).encode())
    return out
