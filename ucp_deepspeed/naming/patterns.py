"""Which layout each parameter has, and its global name: from rules, or read off megatron-core.

Two sources, in this order:

1. Layout rules, the small pattern language for models we cannot introspect. A rule is a JSON
   object: `{"match": REGEX, "layout": "replicated" | "average" | "split", "dim": D,
   "parts": [sizes...], "vocab": V}`. The first rule whose regex matches the whole parameter name
   wins.
2. megatron-core's own parameter attributes: `tensor_model_parallel`, `partition_dim`,
   `partition_stride` (a stride of s is s fused parts, e.g. SwiGLU's gate|up), and
   `is_embedding_or_output_parameter` for the vocab padding. Parameters of megatron-core modules
   without the attributes are replicated, as megatron-core itself assumes.

A parameter that is tensor-parallel (tp > 1) and matches neither is an error: we never guess.
Global names undo megatron-core's per-stage layer numbering (`decoder.layers.0` on stage 1 is
layer `layer_number - 1` of the whole model) and map a last stage's tied output layer onto the
embedding it shares.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ucp_deepspeed.geometry.layout import REPLICATED, Layout

_LAYER_PATH = re.compile(r"^(.*?)(layers)\.(\d+)$")


@dataclass(frozen=True)
class Rule:
    """One line of the layout language: parameters whose name fully matches `pattern` get `layout`."""

    pattern: str
    layout: Layout

    def matches(self, name: str) -> bool:
        """Whether the rule applies to a parameter name."""
        return re.fullmatch(self.pattern, name) is not None


def parse_rules(raw: Sequence[dict] | str | None) -> tuple[Rule, ...]:
    """Rules from a list of dicts or a JSON file path, with errors that name the bad rule."""
    if raw is None:
        return ()
    if isinstance(raw, str):
        with open(raw) as f:
            raw = json.load(f)
    rules = []
    for i, item in enumerate(raw):
        try:
            unknown = set(item) - {"match", "layout", "dim", "parts", "vocab"}
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)}")
            re.compile(item["match"])
            layout = Layout.from_json({"kind": item["layout"], **{k: item[k] for k in ("dim", "parts", "vocab")
                                                                   if k in item}})
        except (KeyError, ValueError, TypeError, re.error) as exc:
            raise ValueError(f"layout rule {i} {item!r}: {exc}") from None
        rules.append(Rule(item["match"], layout))
    return tuple(rules)


@dataclass(frozen=True)
class ParamInfo:
    """A local parameter's place in the full model."""

    name: str
    layout: Layout
    alias: bool = False


def _is_megatron(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("megatron.core")


def _megatron_layout(p: torch.Tensor, tp: int, vocab_size: int) -> Layout:
    if not getattr(p, "tensor_model_parallel", False):
        return REPLICATED
    dim, stride = int(p.partition_dim), int(getattr(p, "partition_stride", 1))
    local_len = (p.ds_shape if hasattr(p, "ds_shape") else p.shape)[dim]
    if getattr(p, "is_embedding_or_output_parameter", False) and vocab_size:
        return Layout("split", dim, vocab=vocab_size)
    if stride > 1:
        return Layout("split", dim, parts=(local_len * tp // stride,) * stride)
    return Layout("split", dim)


def _global_prefixes(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(local prefix, global prefix) for every pipeline-local layer numbered differently from its position."""
    out = []
    for path, sub in module.named_modules():
        number = getattr(sub, "layer_number", None)
        found = _LAYER_PATH.match(path)
        if found and isinstance(number, int) and _is_megatron(sub) and int(found.group(3)) != number - 1:
            out.append((path + ".", f"{found.group(1)}layers.{number - 1}."))
    return out


def _tied_output(module: torch.nn.Module) -> dict[str, str]:
    """A last stage's copy of the word embeddings (`output_layer.weight`) under the embedding's name."""
    out = {}
    for path, sub in module.named_modules():
        if _is_megatron(sub) and getattr(sub, "share_embeddings_and_output_weights", False) \
                and getattr(sub, "post_process", False) and not getattr(sub, "pre_process", True):
            prefix = f"{path}." if path else ""
            out[f"{prefix}output_layer.weight"] = f"{prefix}embedding.word_embeddings.weight"
    return out


def _in_megatron(module: torch.nn.Module) -> Callable[[str], bool]:
    """Whether a parameter sits inside a megatron-core module (its norms are plain torch modules)."""
    paths = {path: _is_megatron(sub) for path, sub in module.named_modules()}

    def inside(name: str) -> bool:
        parts = name.split(".")[:-1]
        return any(paths.get(".".join(parts[:i]), False) for i in range(len(parts), -1, -1))

    return inside


@dataclass(frozen=True)
class ExpertBlock:
    """The local experts of one DeepSpeed MoE layer: `prefix<i>.` is local expert i."""

    prefix: str
    num_local: int
    group: str

    def expert_of(self, name: str) -> int | None:
        """Local expert index of a parameter name, or None if the name is not in this block."""
        if not name.startswith(self.prefix):
            return None
        head = name[len(self.prefix):].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def rename(self, name: str, ep_rank: int) -> str:
        """The name of local expert parameter `name` as held by expert-parallel rank `ep_rank`, by global id."""
        local = self.expert_of(name)
        rest = name[len(self.prefix) + len(str(local)):]
        return f"{self.prefix}{ep_rank * self.num_local + local}{rest}"


def expert_blocks(module: torch.nn.Module) -> list[ExpertBlock]:
    """The experts of every MoE layer, whose local ids restart on each expert-parallel rank.

    DeepSpeed's `MoE` keeps them in `deepspeed_moe.experts.deepspeed_experts.<i>`, megatron-core's
    `MoELayer` (SequentialMLP) in `experts.local_experts.<i>`; both carry `num_local_experts` and,
    once registered with DeepSpeed, `expert_group_name`.
    """
    out = []
    for path, sub in module.named_modules():
        kind = type(sub).__module__
        if not (hasattr(sub, "num_local_experts") and hasattr(sub, "expert_group_name")):
            continue
        if kind.startswith("deepspeed.moe"):
            inner = "deepspeed_moe.experts.deepspeed_experts."
        elif kind.startswith("megatron.core.transformer.moe"):
            inner = "experts.local_experts."
        else:
            continue
        out.append(ExpertBlock(f"{path}.{inner}" if path else inner, int(sub.num_local_experts), sub.expert_group_name))
    return out


def global_namer(module: torch.nn.Module, ep_ranks: dict[str, int] | None = None) -> Callable[[str], str]:
    """Maps a name in this rank's module to its name in the whole model.

    Pipeline stages number layers locally, and each expert-parallel rank numbers its experts from 0;
    `ep_ranks` gives this rank's expert-parallel rank per expert group.
    """
    prefixes = _global_prefixes(module)
    tied = _tied_output(module)
    blocks = expert_blocks(module)

    def to_global(name: str) -> str:
        name = tied.get(name, name)
        for block in blocks:
            if block.expert_of(name) is not None:
                name = block.rename(name, (ep_ranks or {}).get(block.group, 0))
        for local, glob in prefixes:
            if name.startswith(local):
                return glob + name[len(local):]
        return name

    return to_global


def param_infos(module: torch.nn.Module, params: Iterable[tuple[str, torch.Tensor]], tp: int,
                rules: Sequence[Rule] = (), vocab_size: int = 0,
                ep_ranks: dict[str, int] | None = None) -> dict[str, ParamInfo]:
    """Global name and layout of each named parameter; ValueError listing any we cannot place."""
    to_global = global_namer(module, ep_ranks)
    tied = _tied_output(module)
    in_megatron = _in_megatron(module)
    infos, unknown = {}, []
    for name, p in params:
        layout = next((r.layout for r in rules if r.matches(name)), None)
        if layout is None and in_megatron(name):
            layout = _megatron_layout(p, tp, vocab_size)
        if layout is None:
            if tp > 1:
                unknown.append(name)
                continue
            layout = REPLICATED
        infos[name] = ParamInfo(to_global(name), layout, alias=name in tied)
    if unknown:
        raise ValueError(
            f"{len(unknown)} parameters have no layout at tensor-parallel size {tp}: {unknown[:10]}"
            f"{' ...' if len(unknown) > 10 else ''}. Say how each is split with layout rules in "
            "\"checkpoint\": {\"universal\": {\"layout_rules\": [...]}}, e.g. "
            '{"match": ".*\\\\.dense\\\\.weight", "layout": "split", "dim": 1} or '
            '{"match": ".*norm.*", "layout": "replicated"}')
    return infos
