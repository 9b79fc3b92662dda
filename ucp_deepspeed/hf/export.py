"""Export a universal checkpoint as a Hugging Face `transformers` model folder: a megatron-core GPT's, or a
`transformers` model's trained under its own names (AutoTP, Ulysses, HF Trainer: `own_names`, from its recorded
config).

The universal format already holds whole tensors under megatron-core's global names, with vocab
padding removed, so an export is the architecture's name table (`hf/names.py`) read from
megatron-core's side: renamings, plus the un-fusing of `linear_qkv` into q/k/v, of SwiGLU's
`linear_fc1` into gate and up, and GPT-2's transposed `Conv1D` weights.

The model is the one recorded at save or import (`ModelSpec` in the manifest), so no flags are
needed; `config.json` is built from it by `hf/models.py` over the original Hugging Face config when
the run was imported from one. The output is that config, `model-0000k-of-0000n.safetensors`
shards and `model.safetensors.index.json`, laid out like the Hub's, written atomically. Shards are
planned from the manifest's shapes before any tensor is read, and each file is streamed one tensor
at a time (`stream_tensors`), so memory stays bounded by the largest tensor.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from tqdm import tqdm

from ucp_deepspeed.convert.core import convert
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import dtype_name
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.format.model import ModelSpec
from ucp_deepspeed.format.paths import check_output, locate
from ucp_deepspeed.format.universal import MANIFEST, UniversalCheckpoint, stream_tensors
from ucp_deepspeed.hf.models import ARCHS, _transformers, arch_for, config_of, with_heads
from ucp_deepspeed.hf.names import Heads, Link, hf_shapes, links, to_hf
from ucp_deepspeed.io import storage as st

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT_FC2 = re.compile(r"decoder\.layers\.0\.mlp\.experts\.local_experts\.\d+\.linear_fc2\.weight")


@dataclass(frozen=True)
class Overrides:
    """What `ucp export-hf` flags say about the model: needed for checkpoints that recorded none, checked against
    the tensors' shapes, and applied over a recorded one."""

    arch: str | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    norm_eps: float | None = None
    rope_theta: float | None = None
    max_positions: int | None = None
    experts_per_token: int | None = None
    activation: str | None = None


@dataclass(frozen=True)
class Entry:
    """One tensor of the exported model: its name, shape, and how to make it from the checkpoint."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]


def _inferred(ckpt: UniversalCheckpoint, o: Overrides) -> ModelSpec:
    """The model of a checkpoint saved without a record of it: shapes and which tensors exist from the tensors,
    what they cannot say from the flags, never guessed."""
    params = ckpt.params
    layers = 1 + max((int(m.group(1)) for n in params if (m := _LAYER.match(n))), default=-1)
    experts = sum(1 for n in params if _EXPERT_FC2.fullmatch(n))
    mlp = "decoder.layers.0.mlp." + ("experts.local_experts.0." if experts else "")
    needed = ("embedding.word_embeddings.weight", f"{mlp}linear_fc1.weight", f"{mlp}linear_fc2.weight")
    if not layers or any(n not in params for n in needed):
        raise CheckpointError(
            ckpt.root,
            f"is not a megatron-core GPT (it lacks {[n for n in needed if n not in params]}) and records no "
            "transformers config; a transformers model trained under its own names (AutoTP, Ulysses, HF Trainer) "
            "exports with --hf-config CONFIG_JSON, the config.json of the model it started from",
        )
    position = params.get("embedding.position_embeddings.weight")
    flags = {
        "--arch": o.arch,
        "--num-heads": o.num_heads,
        "--norm-eps": o.norm_eps,
        "--activation": o.activation,
        **({"--rope-theta": o.rope_theta} if position is None else {}),
    }
    missing = [flag for flag, value in flags.items() if value is None]
    if missing or o.arch is None or o.num_heads is None or o.activation is None:
        raise CheckpointError(
            ckpt.root,
            f"records no model (saved without ucp_deepspeed?); pass {' '.join(missing)}, which its tensors cannot tell",
        )
    vocab, hidden = params["embedding.word_embeddings.weight"].shape
    ffn = params[f"{mlp}linear_fc2.weight"].shape[1]
    return ModelSpec(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=o.num_heads,
        num_query_groups=o.num_kv_heads or o.num_heads,
        kv_channels=hidden // o.num_heads,
        vocab_size=vocab,
        max_sequence_length=position.shape[0] if position is not None else o.max_positions or 4096,
        normalization="LayerNorm" if "decoder.final_layernorm.bias" in params else "RMSNorm",
        layernorm_epsilon=float(o.norm_eps or 0),
        activation=o.activation,
        gated_linear_unit=params[f"{mlp}linear_fc1.weight"].shape[0] == 2 * ffn,
        add_bias_linear="decoder.layers.0.self_attention.linear_proj.bias" in params,
        add_qkv_bias="decoder.layers.0.self_attention.linear_qkv.bias" in params,
        position_embedding_type="learned_absolute" if position is not None else "rope",
        rotary_base=o.rope_theta or 10000.0,
        tied="output_layer.weight" not in params,
        num_moe_experts=experts,
        moe_router_topk=(o.experts_per_token or 2) if experts else 0,
    )


def model_of(ckpt: UniversalCheckpoint, o: Overrides) -> ModelSpec:
    """The model to export: the recorded one (or one inferred from the tensors), with the flags applied."""
    recorded = ckpt.manifest.model
    spec = recorded if recorded is not None else _inferred(ckpt, o)
    qkv = ckpt.params.get("decoder.layers.0.self_attention.linear_qkv.weight")
    if qkv is not None and (o.num_heads or o.num_kv_heads or recorded is None):
        spec = with_heads(spec, qkv.shape[0], o.num_heads, o.num_kv_heads, ckpt.root)
    changes: dict[str, Any] = {
        "layernorm_epsilon": o.norm_eps,
        "rotary_base": o.rope_theta,
        "max_sequence_length": o.max_positions if spec.position_embedding_type != "learned_absolute" else None,
        "moe_router_topk": o.experts_per_token if spec.moe else None,
        "activation": o.activation,
    }
    return replace(spec, **{k: v for k, v in changes.items() if v is not None})


def entries(arch: str, read: Callable[[str], torch.Tensor], ckpt: UniversalCheckpoint, spec: ModelSpec) -> list[Entry]:
    """Every tensor of the exported model, from the architecture's name table, in file order.

    Every checkpoint parameter must have a place in the table and the shape the model says it has:
    an export never drops a tensor or reinterprets one.
    """
    heads = Heads(spec.num_attention_heads, spec.num_query_groups)

    def make(link: Link, j: int) -> torch.Tensor:
        return to_hf(link, read(link.mcore), heads)[j]

    table = links(arch, spec)
    for name in sorted(set(ckpt.params) - {link.mcore for link in table}):
        if name not in ckpt.manifest.tied:
            raise CheckpointError(ckpt.root, f"{name} has no place in a {arch} model; exporting would drop it")
    out = []
    for link in table:
        record = ckpt.params.get(link.mcore)
        if record is None:
            raise CheckpointError(ckpt.root, f"{arch} export needs {link.mcore}, which this checkpoint lacks")
        if record.shape != link.shape:
            raise CheckpointError(
                ckpt.root, f"{link.mcore} has shape {record.shape}; the model ({arch}) says {link.shape}"
            )
        out += [
            Entry(name, shape, functools.partial(make, link, j))
            for j, (name, shape) in enumerate(zip(link.hf, hf_shapes(link, heads)))
        ]
    return out


def own_names(
    ckpt: UniversalCheckpoint, hf_config: dict[str, Any], read: Callable[[str], torch.Tensor], dtype: str
) -> tuple[dict[str, Any], list[Entry]]:
    """The config and tensors of a `transformers` model trained under its own names (DeepSpeed's AutoTP, Ulysses, an
    HF Trainer job): every tensor of the model its recorded config builds, under the same name and shape.

    A checkpoint tensor the model has no place for, or a model tensor the checkpoint lacks (other than a tied copy,
    which `from_pretrained` ties again), is refused by name.
    """
    transformers = _transformers()
    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    tied = {n for n in expected if n not in dict(model.named_parameters()) and n not in dict(model.named_buffers())}
    extra = sorted(set(ckpt.params) - set(expected))
    if extra:
        raise CheckpointError(
            ckpt.root, f"{extra[:6]} have no place in {type(model).__name__}; exporting would drop them"
        )
    out = []
    for name, shape in expected.items():
        record = ckpt.params.get(name)
        if record is None and (name in tied or name in ckpt.manifest.tied):
            continue
        if record is None and name in ckpt.buffers:
            out.append(Entry(name, shape, functools.partial(ckpt.read_buffer, name)))
            continue
        if record is None:
            raise CheckpointError(ckpt.root, f"{type(model).__name__} needs {name}, which this checkpoint lacks")
        if tuple(record.shape) != shape:
            raise CheckpointError(ckpt.root, f"{name} has shape {record.shape}; {type(model).__name__} says {shape}")
        out.append(Entry(name, shape, functools.partial(read, name)))
    config.dtype = dtype
    return config.to_diff_dict(), out


def plan_shards(entries: list[Entry], shard_bytes: int, itemsize: int = 4) -> list[list[Entry]]:
    """Consecutive entries grouped into files of at most `shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry.shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def export_hf(
    path: str,
    out: str,
    overrides: Overrides = Overrides(),
    dtype: str = "fp32",
    shard_bytes: int = 5 * 2**30,
    progress: bool = True,
    hf_config: dict[str, Any] | None = None,
) -> str:
    """Write a `transformers` model folder from a universal (or native, converted first) checkpoint.

    Args:
        path: a universal folder, or a native checkpoint directory (its latest tag is converted first).
        out: the folder to write: `config.json`, `model-0000k-of-0000n.safetensors`, `model.safetensors.index.json`.
        overrides: flags for checkpoints that recorded no model (`--arch`, `--num-heads`, ...), applied over a
            recorded one.
        dtype: `fp32` (the master weights exactly), `bf16` or `fp16`.
        shard_bytes: the largest shard, as the Hub's `max_shard_size`.
        hf_config: the `config.json` of a `transformers` model trained under its own names, for a checkpoint that
            recorded none (plain DeepSpeed's); it replaces a recorded one.
    Returns:
        `out`.
    Example:
        >>> export_hf("checkpoints/global_step1000", "hf-out", dtype="bf16")
        >>> AutoModelForCausalLM.from_pretrained("hf-out")
    """
    if overrides.arch is not None and overrides.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {overrides.arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_output(out, [locate(path).path])
    if not st.isfile(st.join(path, MANIFEST)):
        path = convert(path, progress=progress)
    with UniversalCheckpoint(path) as ckpt:
        hf_config = hf_config or ckpt.manifest.hf_config
        torch_dtype = DTYPES[dtype]
        size = torch_dtype.itemsize

        @functools.lru_cache(maxsize=1)  # q/k/v and gate/up come from one fused tensor: read it once, not 2-3 times
        def read(name: str) -> torch.Tensor:
            record = ckpt.params[name]
            key = FP32 if FP32 in record.keys else VALUE
            return ckpt.read(name, key).reshape(record.shape).to(torch.float32)

        if ckpt.manifest.model is None and hf_config is not None and not overrides.arch:
            config, tensors = own_names(ckpt, hf_config, read, dtype_name(torch_dtype))
        else:
            spec = model_of(ckpt, overrides)
            arch = overrides.arch or arch_for(spec, hf_config)
            config = config_of(spec, arch, hf_config, dtype_name(torch_dtype), ckpt.root)
            tensors = entries(arch, read, ckpt, spec)
        shards = plan_shards(tensors, shard_bytes, size)
        st.makedirs(out)
        weight_map, total = {}, 0
        bar = tqdm(
            total=sum(math.prod(e.shape) * size for e in tensors),
            unit="B",
            unit_scale=True,
            desc="ucp export-hf",
            disable=not progress,
        )
        for index, shard in enumerate(shards, 1):
            fname = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            makers = {e.name: e for e in shard}

            def produce(name: str, makers: dict[str, Entry] = makers) -> torch.Tensor:
                tensor = makers[name].make().to(torch_dtype)
                if tuple(tensor.shape) != makers[name].shape:
                    raise CheckpointError(
                        ckpt.root, f"{name}: made shape {tuple(tensor.shape)}, expected {makers[name].shape}"
                    )
                bar.update(tensor.numel() * size)
                return tensor

            stream_tensors(out, fname, [(e.name, torch_dtype, e.shape) for e in shard], produce, {"format": "pt"})
            total += sum(math.prod(e.shape) * size for e in shard)
            weight_map.update({e.name: fname for e in shard})
    bar.close()
    st.write(
        st.join(out, "model.safetensors.index.json"),
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode(),
    )
    st.write(st.join(out, "config.json"), json.dumps(config, indent=2, sort_keys=True).encode())
    return out
