"""One two-way name table per Hugging Face architecture: megatron-core's global names against `transformers`'.

The table of a model is built from its `ModelSpec` (`links`): which biases exist, whether the output
layer is tied, how many experts, and every tensor's full shape, so import and export both check
shapes against it before writing anything.

A `Link` ties one megatron-core tensor to the `transformers` tensor(s) it becomes, and names the
rearrangement between them (`Fuse`), so export and import read the same table in opposite
directions:

    same       one tensor, unchanged
    transpose  GPT-2's `Conv1D` stores weights transposed
    qkv        megatron-core's `linear_qkv` (per query group: its query heads, then one key and one value
               head) against separate q/k/v projections
    c_attn     the same against GPT-2's one `c_attn` (q|k|v, transposed for the weight); GPT-2 has no
               grouped-query attention, so each key/value head is repeated for its group's query heads
    gate_up    SwiGLU's `linear_fc1` (gate rows, then up rows) against separate gate and up projections
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.model import ModelSpec

Fuse = Literal["same", "transpose", "qkv", "c_attn", "gate_up"]


@dataclass(frozen=True)
class Heads:
    """What the rearrangements need beyond tensor shapes."""

    heads: int
    kv_heads: int


@dataclass(frozen=True)
class Link:
    """One megatron-core tensor, its full shape (vocab unpadded), and the `transformers` tensors it corresponds to."""

    mcore: str
    shape: tuple[int, ...]
    hf: tuple[str, ...]
    fuse: Fuse = "same"


def _layer_links(arch: str, s: ModelSpec, i: int) -> list[Link]:
    m = f"decoder.layers.{i}."
    hidden, ffn, d = s.hidden_size, s.ffn_hidden_size, s.kv_channels
    qkv_rows, attn = (s.num_attention_heads + 2 * s.num_query_groups) * d, s.num_attention_heads * d
    if arch == "gpt2":
        h = f"transformer.h.{i}."
        out = [
            Link(f"{m}{mg}.{k}", (hidden,), (f"{h}{hf}.{k}",))
            for mg, hf in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"))
            for k in ("weight", "bias")
        ]
        out += [
            Link(f"{m}self_attention.linear_qkv.weight", (qkv_rows, hidden), (f"{h}attn.c_attn.weight",), "c_attn"),
            Link(f"{m}self_attention.linear_qkv.bias", (qkv_rows,), (f"{h}attn.c_attn.bias",), "c_attn"),
        ]
        for mg, hf, shape in (
            ("self_attention.linear_proj", "attn.c_proj", (hidden, attn)),
            ("mlp.linear_fc1", "mlp.c_fc", (ffn, hidden)),
            ("mlp.linear_fc2", "mlp.c_proj", (hidden, ffn)),
        ):
            out += [
                Link(f"{m}{mg}.weight", shape, (f"{h}{hf}.weight",), "transpose"),
                Link(f"{m}{mg}.bias", shape[:1], (f"{h}{hf}.bias",)),
            ]
        return out
    h = f"model.layers.{i}."
    attn_names = tuple(f"{h}self_attn.{p}_proj" for p in "qkv")
    out = [Link(f"{m}input_layernorm.weight", (hidden,), (f"{h}input_layernorm.weight",))]
    out.append(
        Link(
            f"{m}self_attention.linear_qkv.weight", (qkv_rows, hidden), tuple(f"{n}.weight" for n in attn_names), "qkv"
        )
    )
    if s.add_qkv_bias or s.add_bias_linear:
        out.append(
            Link(f"{m}self_attention.linear_qkv.bias", (qkv_rows,), tuple(f"{n}.bias" for n in attn_names), "qkv")
        )
    out.append(Link(f"{m}self_attention.linear_proj.weight", (hidden, attn), (f"{h}self_attn.o_proj.weight",)))
    if s.add_bias_linear:
        out.append(Link(f"{m}self_attention.linear_proj.bias", (hidden,), (f"{h}self_attn.o_proj.bias",)))
    out.append(Link(f"{m}pre_mlp_layernorm.weight", (hidden,), (f"{h}post_attention_layernorm.weight",)))
    if s.moe:
        out.append(Link(f"{m}mlp.router.weight", (s.num_moe_experts, hidden), (f"{h}block_sparse_moe.gate.weight",)))
        for e in range(s.num_moe_experts):
            me, he = f"{m}mlp.experts.local_experts.{e}.", f"{h}block_sparse_moe.experts.{e}."
            out += [
                Link(f"{me}linear_fc1.weight", (2 * ffn, hidden), (f"{he}w1.weight", f"{he}w3.weight"), "gate_up"),
                Link(f"{me}linear_fc2.weight", (hidden, ffn), (f"{he}w2.weight",)),
            ]
        return out
    mlp = f"{h}mlp."
    out.append(
        Link(
            f"{m}mlp.linear_fc1.weight",
            (2 * ffn, hidden),
            (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"),
            "gate_up",
        )
    )
    if s.add_bias_linear:
        out.append(
            Link(f"{m}mlp.linear_fc1.bias", (2 * ffn,), (f"{mlp}gate_proj.bias", f"{mlp}up_proj.bias"), "gate_up")
        )
    out.append(Link(f"{m}mlp.linear_fc2.weight", (hidden, ffn), (f"{mlp}down_proj.weight",)))
    if s.add_bias_linear:
        out.append(Link(f"{m}mlp.linear_fc2.bias", (hidden,), (f"{mlp}down_proj.bias",)))
    return out


def links(arch: str, spec: ModelSpec) -> list[Link]:
    """The whole table of `arch` (one of `hf.models.ARCHS`) for the model `spec` describes, in HF file order."""
    hidden = spec.hidden_size
    if arch == "gpt2":
        head = [
            Link("embedding.word_embeddings.weight", (spec.vocab_size, hidden), ("transformer.wte.weight",)),
            Link(
                "embedding.position_embeddings.weight", (spec.max_sequence_length, hidden), ("transformer.wpe.weight",)
            ),
        ]
        tail = [Link(f"decoder.final_layernorm.{k}", (hidden,), (f"transformer.ln_f.{k}",)) for k in ("weight", "bias")]
    elif arch in ("llama", "mistral", "qwen2", "mixtral"):
        head = [Link("embedding.word_embeddings.weight", (spec.vocab_size, hidden), ("model.embed_tokens.weight",))]
        tail = [Link("decoder.final_layernorm.weight", (hidden,), ("model.norm.weight",))]
    else:
        raise ValueError(f"no name table for architecture {arch!r}")
    if not spec.tied:
        tail.append(Link("output_layer.weight", (spec.vocab_size, hidden), ("lm_head.weight",)))
    return head + [link for i in range(spec.num_layers) for link in _layer_links(arch, spec, i)] + tail


def _split_qkv(fused: torch.Tensor, h: Heads) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = h.heads // h.kv_heads
    d = fused.shape[0] // (h.kv_heads * (per_group + 2))
    grouped = fused.reshape(h.kv_heads, per_group + 2, d, *fused.shape[1:])
    rest = fused.shape[1:]
    return (
        grouped[:, :per_group].reshape(-1, *rest),
        grouped[:, per_group].reshape(-1, *rest),
        grouped[:, per_group + 1].reshape(-1, *rest),
    )


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: Heads) -> torch.Tensor:
    d = q.shape[0] // h.heads
    rest = q.shape[1:]
    q = q.reshape(h.kv_heads, h.heads // h.kv_heads, d, *rest)
    k, v = (t.reshape(h.kv_heads, 1, d, *rest) for t in (k, v))
    return torch.cat([q, k, v], 1).reshape(-1, *rest)


def _repeat(t: torch.Tensor, h: Heads) -> torch.Tensor:
    """Each key/value head repeated for the query heads of its group (what grouped-query attention computes)."""
    heads = t.reshape(h.kv_heads, -1, *t.shape[1:])
    return heads.repeat_interleave(h.heads // h.kv_heads, 0).reshape(-1, *t.shape[1:])


def _fold(t: torch.Tensor, h: Heads, name: str) -> torch.Tensor:
    """Undo the repetition of each key/value head for the query heads of its group."""
    grouped = t.reshape(h.kv_heads, h.heads // h.kv_heads, -1, *t.shape[1:])
    if not bool((grouped == grouped[:, :1]).all()):
        raise CheckpointError(
            name,
            f"key/value heads are not {h.heads // h.kv_heads} identical copies per group; "
            "this model has no grouped-query attention to fold back",
        )
    return grouped[:, 0].reshape(-1, *t.shape[1:])


def to_hf(link: Link, tensor: torch.Tensor, h: Heads) -> list[torch.Tensor]:
    """The `transformers` tensors of `link`, in `link.hf` order, from its megatron-core tensor."""
    if link.fuse == "same":
        return [tensor]
    if link.fuse == "transpose":
        return [tensor.t().contiguous()]
    if link.fuse == "gate_up":
        return list(tensor.chunk(2, 0))
    q, k, v = _split_qkv(tensor, h)
    if link.fuse == "qkv":
        return [q, k, v]
    fused = torch.cat([q, _repeat(k, h), _repeat(v, h)], 0)
    return [fused.t().contiguous() if tensor.dim() == 2 else fused]


def from_hf(link: Link, read: Callable[[str], torch.Tensor], h: Heads) -> torch.Tensor:
    """The megatron-core tensor of `link`, from its `transformers` tensors (`read(name)`)."""
    parts = [read(name) for name in link.hf]
    if link.fuse == "same":
        return parts[0]
    if link.fuse == "transpose":
        return parts[0].t().contiguous()
    if link.fuse == "gate_up":
        return torch.cat(parts, 0)
    if link.fuse == "qkv":
        return _fuse_qkv(parts[0], parts[1], parts[2], h)
    fused = parts[0].t() if parts[0].dim() == 2 else parts[0]
    q, k, v = fused.chunk(3, 0)
    k, v = (_fold(t, h, link.hf[0]) for t in (k, v))
    return _fuse_qkv(q, k, v, h)


def hf_shapes(link: Link, h: Heads) -> list[tuple[int, ...]]:
    """The shapes `to_hf` gives for the megatron-core tensor of `link`, known before any tensor is read."""
    shape = link.shape
    if link.fuse == "same":
        return [shape]
    if link.fuse == "transpose":
        return [tuple(reversed(shape))]
    if link.fuse == "gate_up":
        return [(shape[0] // 2, *shape[1:])] * 2
    d = shape[0] // (h.heads + 2 * h.kv_heads)
    rest = shape[1:]
    if link.fuse == "qkv":
        return [(h.heads * d, *rest), (h.kv_heads * d, *rest), (h.kv_heads * d, *rest)]
    fused = 3 * h.heads * d
    return [(rest[0], fused) if rest else (fused,)]
