"""Which layout each parameter has, and its global name in the whole model: from rules, or read off megatron-core.

Two sources, in this order:

1. Layout rules, the small pattern language for models we cannot introspect. A rule is a JSON
   object: `{"match": REGEX, "layout": "replicated" | "average" | "split", "dim": D,
   "parts": [sizes...], "vocab": V}`. The first rule whose regex matches the whole parameter name
   wins.
2. megatron-core's own parameter attributes: `tensor_model_parallel`, `partition_dim`,
   `partition_stride` (a stride of s is s fused parts, e.g. SwiGLU's gate|up), and
   `is_embedding_or_output_parameter` for the vocab padding. Parameters of megatron-core modules
   without the attributes are replicated, as megatron-core itself assumes.
3. DeepSpeed AutoTP's restore metadata, on a Hugging Face model that AutoTP partitioned: the
   partition dim, each rank's size (uneven where AutoTP gives whole heads or grains to the first
   ranks), fused sub-parameters and their per-rank widths. A parameter AutoTP left untouched is
   replicated, as AutoTP itself treats it; one it marks unsupported is refused with its reason.
4. DeepSpeed AutoEP's placement, on the stacked expert parameters it builds (`experts.w1`, `w2`,
   `w3`, [local experts, ...]): split along dim 0 over the expert-parallel ranks, each holding a
   contiguous run of the layer's experts in rank order. The full tensor holds every expert at
   its global id.

A parameter that is tensor-parallel (tp > 1) and matches neither is an error: we never guess.
Global names undo megatron-core's per-stage layer numbering (`decoder.layers.0` on stage 1 is
layer `layer_number - 1` of the whole model) and map a last stage's tied output layer onto the
embedding it shares.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucp_deepspeed import compat
from ucp_deepspeed.geometry.layout import REPLICATED, Axis, Layout
from ucp_deepspeed.naming.experts import expert_blocks
from ucp_deepspeed.naming.rules import Rule

_LAYER_PATH = re.compile(r"^(.*?)(layers)\.(\d+)$")


@dataclass(frozen=True)
class ParamInfo:
    """A local parameter's place in the full model."""

    name: str
    layout: Layout
    alias: bool = False


def _megatron_layout(p: torch.Tensor, tp: int, vocab_size: int) -> Layout:
    split = compat.megatron_split(p)
    if split is None:
        return REPLICATED
    local_len = compat.full_shape(p)[split.dim]
    if split.vocab_parallel and vocab_size:
        return Layout("split", split.dim, vocab=vocab_size)
    if split.stride > 1:
        return Layout("split", split.dim, parts=(local_len * tp // split.stride,) * split.stride)
    return Layout("split", split.dim)


def autotp_layout(name: str, meta: dict[str, Any] | None, local_shape: Sequence[int], tp: int) -> Layout:
    """The layout DeepSpeed's AutoTP cut a parameter with, from its restore metadata (`compat.autotp_meta`).

    ValueError, naming the parameter, for a split AutoTP marks unsupported, records without sizes, scales (a
    pre-divided bias), or records with a logical shape its sizes do not add up to.
    """
    if meta is None:
        return REPLICATED
    conversion = meta.get("conversion") or {}
    if conversion.get("unsupported_reason"):
        reason = conversion["unsupported_reason"]
        raise ValueError(f"{name}: DeepSpeed's AutoTP cannot describe how it split this ({reason})")
    scaled = [
        piece.get("scale")
        for rank in ((conversion.get("affine_map") or {}).get("ranks") or {}).values()
        for piece in rank.get("pieces", ())
        if piece.get("scale", 1.0) != 1.0
    ]
    if scaled:  # a row-parallel bias held pre-divided by the tensor-parallel size, replicated or not
        raise ValueError(f"{name}: AutoTP holds it scaled by {scaled[0]} on some rank, which a layout cannot undo")
    if meta.get("replicated") or meta.get("partition_dim") is None:
        return REPLICATED
    dim = int(meta["partition_dim"])
    widths = meta.get("sub_param_shard_widths") or ([meta["partition_sizes"]] if meta.get("partition_sizes") else None)
    if not widths:
        raise ValueError(f"{name}: AutoTP split it along dim {dim} without recording each rank's size")
    shards = tuple(tuple(int(w) for w in part) for part in widths)
    if any(len(part) != tp for part in shards):
        raise ValueError(f"{name}: AutoTP recorded sizes for {len(shards[0])} ranks at tensor-parallel size {tp}")
    layout = Layout.from_widths(dim, shards)
    full = layout.full_shape(local_shape, tp)
    logical = tuple(int(n) for n in meta.get("logical_shape") or full)
    if full != logical:
        raise ValueError(f"{name}: AutoTP records the full shape {list(logical)}, its split sizes give {list(full)}")
    return layout


def autoep_layout(name: str, stack: compat.ExpertStack, local_shape: Sequence[int]) -> Layout:
    """The layout of an AutoEP expert stack: experts along dim 0, over the expert-parallel ranks.

    ValueError, naming the parameter, for a placement that is not each rank's contiguous run in rank order (its
    placement descriptor can describe others).
    """
    count = int(local_shape[0]) if local_shape else 0
    if stack.experts != tuple(range(stack.ep_rank * count, (stack.ep_rank + 1) * count)):
        raise ValueError(
            f"{name}: AutoEP places experts {list(stack.experts)} on expert-parallel rank {stack.ep_rank}; only "
            "contiguous runs in rank order (its default placement) are supported"
        )
    return Layout("split", 0, over=Axis.EXPERT)


def _global_prefixes(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(local prefix, global prefix) for every pipeline-local layer numbered differently from its position."""
    out = []
    for path, sub in module.named_modules():
        number = compat.megatron_layer_number(sub)
        found = _LAYER_PATH.match(path)
        if found and number is not None and int(found.group(3)) != number - 1:
            out.append((path + ".", f"{found.group(1)}layers.{number - 1}."))
    return out


def _tied_output(module: torch.nn.Module) -> dict[str, str]:
    """A last stage's copy of the word embeddings (`output_layer.weight`) under the embedding's name."""
    out = {}
    for path, sub in module.named_modules():
        if compat.megatron_tied_output_stage(sub):
            prefix = f"{path}." if path else ""
            out[f"{prefix}output_layer.weight"] = f"{prefix}embedding.word_embeddings.weight"
    return out


def _in_megatron(module: torch.nn.Module) -> Callable[[str], bool]:
    """Whether a parameter sits inside a megatron-core module (its norms are plain torch modules)."""
    paths = {path: compat.is_megatron_module(sub) for path, sub in module.named_modules()}

    def inside(name: str) -> bool:
        parts = name.split(".")[:-1]
        return any(paths.get(".".join(parts[:i]), False) for i in range(len(parts), -1, -1))

    return inside


def canonical_namer(module: torch.nn.Module) -> Callable[[str], str]:
    """Names of a megatron-core model built from Transformer Engine specs -> the local spec's, so that a checkpoint
    names a parameter the same way whichever spec trained it, and resumes under the other.

    Two differences: TE fuses each layer's norms into the next linear (`self_attention.linear_qkv.layer_norm_weight`
    is the local `input_layernorm.weight`, by megatron-core's own map), and TEGroupedMLP keeps local expert i's
    weights as `experts.linear_fc1.weight<i>`, SequentialMLP's `experts.local_experts.<i>.linear_fc1.weight`.
    Megatron-core's GroupedMLP, which fuses all local experts into one tensor, is refused.
    """
    layers, grouped = [], []
    for path, sub in module.named_modules():
        kind = compat.megatron_grouped_experts(sub)
        if kind is compat.GroupedExperts.FUSED:
            raise ValueError(
                f"{path}: megatron-core's GroupedMLP keeps all local experts in one fused weight, which is not "
                "supported; build the experts with SequentialMLP (moe_grouped_gemm=False) or Transformer Engine's "
                "TEGroupedMLP"
            )
        if kind is compat.GroupedExperts.TE:
            grouped.append(f"{path}." if path else "")
        elif compat.is_megatron_transformer_layer(sub):
            layers.append(f"{path}." if path else "")
    if not layers and not grouped:
        return lambda name: name
    fused = compat.megatron_fused_norms() if layers else {}
    renamed = {}
    for name, _ in module.named_parameters():
        experts = next((p for p in grouped if name.startswith(p)), None)
        if experts is not None:
            linear, _, leaf = name[len(experts) :].rpartition(".")
            base = leaf.rstrip("0123456789")
            if linear and base != leaf:
                renamed[name] = f"{experts}local_experts.{leaf[len(base) :]}.{linear}.{base}"
            continue
        layer = max((p for p in layers if name.startswith(p)), key=len, default=None)
        if layer is not None:
            rest = name[len(layer) :]
            te = next((t for t in fused if rest.startswith(t)), None)
            if te is not None:
                renamed[name] = layer + fused[te] + rest[len(te) :]
    return lambda name: renamed.get(name, name)


def renamer(prefixes: dict[str, str]) -> Callable[[str], str]:
    """Model names -> checkpoint names by longest prefix (the `rename` option), so two modules that differ only by
    prefixes, such as a PipelineModule and a plain module of the same layers, share checkpoints."""
    ordered = sorted(prefixes.items(), key=lambda kv: -len(kv[0]))

    def rename(name: str) -> str:
        for old, new in ordered:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    return rename


def global_namer(
    module: torch.nn.Module, ep_ranks: dict[str, int] | None = None, rename: dict[str, str] | None = None
) -> Callable[[str], str]:
    """Maps a name in this rank's module to its name in the whole model.

    Transformer Engine names are the local spec's (`canonical_namer`). Pipeline stages number layers locally, and
    each expert-parallel rank numbers its experts from 0;
    `ep_ranks` gives this rank's expert-parallel rank per expert group. `rename` then maps model name
    prefixes to the checkpoint's (a plain module resuming a `PipelineModule` checkpoint).
    """
    prefixes = _global_prefixes(module)
    tied = _tied_output(module)
    blocks = expert_blocks(module)
    renamed = renamer(rename or {})
    canonical = canonical_namer(module)

    def to_global(name: str) -> str:
        name = canonical(tied.get(name, name))
        for block in blocks:
            if block.expert_of(name) is not None:
                name = block.rename(name, (ep_ranks or {}).get(block.group, 0))
        for local, glob in prefixes:
            if name.startswith(local):
                return renamed(glob + name[len(local) :])
        return renamed(name)

    return to_global


def param_infos(
    module: torch.nn.Module,
    params: Iterable[tuple[str, torch.Tensor]],
    tp: int,
    rules: Sequence[Rule] = (),
    vocab_size: int = 0,
    ep_ranks: dict[str, int] | None = None,
    rename: dict[str, str] | None = None,
) -> dict[str, ParamInfo]:
    """Global name and layout of each named parameter; ValueError listing any we cannot place."""
    to_global = global_namer(module, ep_ranks, rename)
    tied = _tied_output(module)
    in_megatron = _in_megatron(module)
    autotp = compat.is_autotp_model(module)
    infos, unknown = {}, []
    for name, p in params:
        layout = next((r.layout for r in rules if r.matches(name)), None)
        if layout is None and in_megatron(name):
            layout = _megatron_layout(p, tp, vocab_size)
        stack = compat.autoep_stack(p) if layout is None else None
        if stack is not None:
            layout = autoep_layout(name, stack, compat.full_shape(p))
        if layout is None and autotp:
            layout = autotp_layout(name, compat.autotp_meta(p), compat.full_shape(p), tp)
        if layout is None:
            if tp > 1:
                unknown.append(name)
                continue
            layout = REPLICATED
        infos[name] = ParamInfo(to_global(name), layout, alias=name in tied)
    owner: dict[str, str] = {}
    for local, info in infos.items():
        if not info.alias and owner.setdefault(info.name, local) != local:
            raise ValueError(
                f"'{owner[info.name]}' and '{local}' would both be '{info.name}' in the checkpoint (rename?)"
            )
    if unknown:
        raise ValueError(
            f"{len(unknown)} parameters have no layout at tensor-parallel size {tp}: {unknown[:10]}"
            f"{' ...' if len(unknown) > 10 else ''}. Say how each is split with layout rules in "
            '"checkpoint": {"universal": {"layout_rules": [...]}}, e.g. '
            '{"match": ".*\\\\.dense\\\\.weight", "layout": "split", "dim": 1} or '
            '{"match": ".*norm.*", "layout": "replicated"}'
        )
    return infos
