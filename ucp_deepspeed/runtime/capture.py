"""Describe a live DeepSpeed engine's layout as `SaveMeta`, at save time.

DeepSpeed's files hold flat buffers without saying where each parameter sits in them (per-param
alignment padding and round-robin reordering make that non-trivial to reconstruct). The engine
knows, so we ask it once per save.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from deepspeed import comm as dist

from ucp_deepspeed import compat
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import dtype_name
from ucp_deepspeed.format.metadata import ExtraTensor, ParamSlot, SaveMeta
from ucp_deepspeed.format.model import ModelSpec
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.geometry.layout import Axis, Layout
from ucp_deepspeed.naming.experts import expert_blocks
from ucp_deepspeed.naming.model import ParamInfo, canonical_namer, global_namer, param_infos
from ucp_deepspeed.naming.rules import parse_rules
from ucp_deepspeed.protocols import Engine
from ucp_deepspeed.version import __version__

_MODEL_STATES = compat.LayerFile(file="", key="")
"""Where a tensor outside a `PipelineModule`'s layer files is saved: no layer file, so the rank's model-states file."""


def engine_dtype(engine: Engine) -> str:
    """Training precision of an engine: fp32, bf16 or fp16."""
    if engine.bfloat16_enabled():
        return "bf16"
    return "fp16" if engine.fp16_enabled() else "fp32"


@dataclass(frozen=True)
class ModelParallel:
    """This rank's tensor- and pipeline-parallel coordinates, as DeepSpeed's `mpu` reports them."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0


def model_parallel(engine: Engine) -> ModelParallel:
    """Tensor/pipeline coordinates of an engine: 1x1 without an mpu or with a Ulysses one (sequence parallelism
    splits activations, not weights); an old-style mpu's model parallel is TP."""
    mpu = getattr(engine, "mpu", None)
    if mpu is None or compat.is_ulysses_mpu(mpu):
        return ModelParallel()
    if hasattr(mpu, "get_tensor_model_parallel_world_size"):
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    else:
        tp, tp_rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    if hasattr(mpu, "get_pipeline_model_parallel_world_size"):
        return ModelParallel(
            tp, tp_rank, mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
        )
    return ModelParallel(tp, tp_rank)


def expert_groups(engine: Engine) -> dict[str, tuple[int, int]]:
    """(expert-parallel size, this rank's expert-parallel rank) of each expert group: DeepSpeed MoE's and AutoEP's."""
    names = {b.group for b in expert_blocks(engine.module)} | set(compat.autoep_groups(engine.module))
    parallel = {g: compat.expert_parallel(g) for g in sorted(names)}
    return {g: (ep.ep_size, ep.ep_rank) for g, ep in parallel.items()}


def attached_options(engine: Engine) -> Any:
    """The options of the engine's checkpointer (`engine.ucp`, set by `attach`), or None."""
    return getattr(getattr(engine, "ucp", None), "options", None)


def _rename(engine: Engine) -> dict[str, str]:
    options = attached_options(engine)
    return dict(options.rename) if options is not None else {}


def namer(engine: Engine) -> Callable[[str], str]:
    """Local-to-global parameter and buffer names of this rank's module (pipeline stage, expert-parallel rank)."""
    return global_namer(engine.module, {g: rank for g, (_, rank) in expert_groups(engine).items()}, _rename(engine))


def topology(engine: Engine) -> Topology:
    """The live engine's parallel layout."""
    mp = model_parallel(engine)
    ep = max((size for size, _ in expert_groups(engine).values()), default=1)
    return Topology(
        dp=compat.zero_world_size(engine),
        sp=compat.sequence_parallel_size(engine),
        zero_stage=int(engine.zero_optimization_stage()),
        dtype=engine_dtype(engine),
        tp=mp.tp,
        pp=mp.pp,
        ep=ep,
        optimizer=type(engine.optimizer).__name__,
    )


def infos(engine: Engine) -> dict[str, ParamInfo]:
    """Global name and tensor-parallel layout of every parameter of the engine's module, by local name."""
    options = attached_options(engine)
    rules = parse_rules(options.layout_rules) if options is not None else ()
    vocab = options.vocab_size if options is not None else 0
    ep_ranks = {g: rank for g, (_, rank) in expert_groups(engine).items()}
    try:
        return param_infos(
            engine.module,
            engine.module.named_parameters(),
            model_parallel(engine).tp,
            rules,
            vocab,
            ep_ranks,
            _rename(engine),
        )
    except ValueError as exc:
        raise CheckpointError("checkpoint.universal.layout_rules", str(exc)) from None


@dataclass(frozen=True)
class LiveParam:
    """A parameter of the live module: its global name, layout and local shape, and this rank's place among the
    ranks its layout is cut over (tensor-parallel, or expert-parallel for AutoEP's expert stacks)."""

    name: str
    layout: Layout
    shape: tuple[int, ...]
    rank: int = 0
    size: int = 1


def live_params(engine: Engine) -> dict[torch.nn.Parameter, LiveParam]:
    """Every parameter of the engine's module, placed in the full model."""
    placed = infos(engine)
    mp = model_parallel(engine)
    out = {}
    for n, p in engine.module.named_parameters():
        info = placed[n]
        stack = compat.autoep_stack(p) if info.layout.over is Axis.EXPERT else None
        rank, size = (stack.ep_rank, stack.ep_size) if stack is not None else (mp.tp_rank, mp.tp)
        out[p] = LiveParam(info.name, info.layout, compat.full_shape(p), rank=rank, size=size)
    return out


def _expert_file_ranks(engine: Engine) -> dict[str, dict[int, tuple[int, ...]]]:
    """Per expert group: expert-parallel rank -> data-parallel ranks (file indices) of its expert-data-parallel
    group, in partition order. Those files hold that rank's experts; gathered from every rank."""
    mine = {g: (rank, compat.expert_parallel(g).edp_rank) for g, (_, rank) in expert_groups(engine).items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(
        everyone, (engine.checkpoint_mp_rank, dist.get_rank(group=engine.optimizer.dp_process_group), mine)
    )
    out: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for mp_rank, dp_rank, groups_of_rank in everyone:
        if mp_rank != engine.checkpoint_mp_rank:
            continue
        for g, (ep_rank, edp_rank) in groups_of_rank.items():
            out.setdefault(g, {}).setdefault(ep_rank, []).append((edp_rank, dp_rank))
    return {
        g: {ep: tuple(dp for _, dp in sorted(members)) for ep, members in by_ep.items()} for g, by_ep in out.items()
    }


def _all_expert_ranks(engine: Engine, slots: list[ParamSlot]) -> list[ParamSlot]:
    """Expert slots for every expert-parallel rank, from this rank's own: same flat layout, other experts and files."""
    blocks = expert_blocks(engine.module)
    if not blocks and not compat.autoep_groups(engine.module):
        return slots
    files = _expert_file_ranks(engine)
    moe_groups = {i: g.get("name") for i, g in enumerate(engine.optimizer.optimizer.param_groups) if g.get("moe")}
    namers: dict[tuple[str, int], Callable[[str], str]] = {}
    canonical = canonical_namer(engine.module)
    out = []
    for slot in slots:
        local = slot.local or slot.name
        group = moe_groups.get(slot.group)
        if slot.layout.over is Axis.EXPERT and group is not None:  # AutoEP: each rank's run of one stack
            out += [dataclasses.replace(slot, ep_rank=r, ranks=ranks) for r, ranks in sorted(files[group].items())]
            continue
        block = next((b for b in blocks if b.expert_of(canonical(local)) is not None), None)
        if block is None or group is None:
            out.append(slot)
            continue
        for ep_rank, ranks in sorted(files[group].items()):
            # the whole model's name: that rank's experts by global id, this stage's layers by global number;
            # `local` stays the name in the module of the ranks holding it
            if (block.group, ep_rank) not in namers:
                namers[block.group, ep_rank] = global_namer(engine.module, {block.group: ep_rank}, _rename(engine))
            name = namers[block.group, ep_rank](local)
            out.append(dataclasses.replace(slot, name=name, local=local if local != name else "", ranks=ranks))
    return out


def _slot(info: ParamInfo, local: str, **fields: Any) -> ParamSlot:
    return ParamSlot(
        info.name, layout=info.layout, local=local if local != info.name else "", alias=info.alias, **fields
    )


def _zero12_slots(opt: Any, names: dict, placed: dict[str, ParamInfo]) -> list[ParamSlot]:
    slots = []
    for i, group in enumerate(compat.zero12_groups(opt)):
        partition = group.numel // group.dp
        for p, off in zip(group.params, group.offsets):
            slots.append(
                _slot(
                    placed[names[p]],
                    names[p],
                    shape=tuple(p.shape),
                    group=i,
                    flat=i,
                    offset=int(off),
                    partition=int(partition),
                )
            )
    return slots


def _whole_slots(
    opt: Any, names: dict, placed: dict[str, ParamInfo], layer_files: dict[str, compat.LayerFile]
) -> list[ParamSlot]:
    """ZeRO-0 fp32: parameter k of the torch optimizer (in group order, as its state dict numbers them) is
    entry k of the saved state; its fp32 value is the module's own tensor."""
    slots = []
    index = 0
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            where = layer_files.get(names[p], _MODEL_STATES)
            slots.append(
                _slot(
                    placed[names[p]],
                    names[p],
                    shape=tuple(p.shape),
                    group=g,
                    flat=index,
                    offset=0,
                    partition=p.numel(),
                    file=where.file,
                    key=where.key,
                )
            )
            index += 1
    return slots


def _zero3_slots(opt: Any, names: dict, placed: dict[str, ParamInfo]) -> list[ParamSlot]:
    slots = []
    for sub in compat.zero3_subgroups(opt):
        for p in sub.params:
            position = compat.zero3_position(opt, p)
            slots.append(
                _slot(
                    placed[names[p]],
                    names[p],
                    shape=compat.full_shape(p),
                    group=sub.group,
                    flat=position.sub_group,
                    offset=position.offset,
                    partition=position.partition,
                )
            )
    return slots


def optimizer_order(engine: Engine) -> tuple[tuple[str, ...], ...] | None:
    """The global names of each optimizer param group's parameters, in the order torch's state dict numbers them:
    what names a plain ZeRO-0 save's numbered optimizer state. None for an engine of several model-parallel ranks,
    whose stages number their own parameters, and for one without an optimizer."""
    if not compat.trains(engine) or model_parallel(engine) != ModelParallel():
        return None
    placed = infos(engine)
    local = {p: n for n, p in engine.module.named_parameters()}
    return tuple(tuple(placed[local[p]].name for p in group) for group in compat.group_order(engine))


def same_stage(engine: Engine, metas: list[SaveMeta]) -> bool:
    """Whether this rank's pipeline stage holds the parameters its saved stage held (same layer split, same names).

    Two pipelines of one size may split the layers differently (`partition_method`); DeepSpeed's own
    load would then read another stage's optimizer partitions. A model AutoEP renamed (on at one end,
    off at the other, at AutoEP size 1 the same topology) is read through `restore`, never DeepSpeed's
    load, which would copy what matches and then fail.
    """
    mp = model_parallel(engine)
    if expert_blocks(engine.module):  # expert slots list every expert-parallel rank's experts
        return True
    saved = metas[mp.pp_rank * mp.tp + mp.tp_rank]
    placed = infos(engine)
    live = {placed[n].name for n, p in engine.module.named_parameters() if p.requires_grad}
    return live == {s.name for s in saved.params}


def param_groups(engine: Engine) -> dict[Any, int]:
    """Each trainable parameter's optimizer param group, without a collective (unlike `describe`)."""
    opt = engine.optimizer
    if int(engine.zero_optimization_stage()) == 3:
        return {p: sub.group for sub in compat.zero3_subgroups(opt) for p in sub.params}
    if compat.is_unpartitioned(engine):
        return {p: i for i, group in enumerate(opt.param_groups) for p in group["params"]}
    return {p: i for i, group in enumerate(compat.zero12_groups(opt)) for p in group.params}


def unsupported(engine: Engine) -> str | None:
    """Why universal checkpointing cannot describe or restore this engine's training state, or None when it can (an
    engine that trains nothing has none: it saves as DeepSpeed does and loads weights from any checkpoint)."""
    stage = int(engine.zero_optimization_stage())
    if compat.ulysses_outside_zero(engine):
        return (
            "Ulysses sequence parallelism built from the config's sequence_parallel_size and data_parallel_size: "
            "DeepSpeed 0.19.8 then partitions ZeRO and sums gradients over the data-parallel ranks alone, so the "
            "sequence-parallel ranks drift apart and all write the same checkpoint files; pass the Ulysses mpu "
            "(UlyssesSPAttentionHF.register_with_transformers, or deepspeed.runtime.sequence_parallel."
            "parallel_state_sp) instead"
        )
    if compat.autoep_groups(engine.module) and (
        model_parallel(engine).tp > 1 or compat.sequence_parallel_size(engine) > 1
    ):
        return (
            "DeepSpeed's AutoEP (expert_parallel) together with AutoTP or Ulysses sequence parallelism: universal "
            "checkpointing reshards AutoEP's expert stacks over data and expert parallelism only; train AutoEP "
            "without tensor_parallel.autotp_size and without a sequence-parallel mpu"
        )
    if compat.nvme_param_offload(engine):
        return (
            "universal checkpointing does not support ZeRO-3 with offload_param.device nvme: parameters swapped "
            "out to NVMe are not restored in place; offload them to cpu (offload_param.device cpu), or keep them "
            "on the device"
        )
    if stage in (1, 2, 3) or not compat.trains(engine) or compat.is_bf16_optimizer(engine.optimizer):
        return None
    if compat.is_unpartitioned(engine):
        if expert_blocks(engine.module):  # DeepSpeed saves a MoE model's torch optimizer whole per expert rank
            return "universal checkpointing does not support a MoE model at ZeRO stage 0; use stage 1, 2 or 3"
        return None
    return (
        f"universal checkpointing does not support {engine_dtype(engine)} at ZeRO stage 0, where DeepSpeed wraps "
        f"the optimizer in its {type(engine.optimizer).__name__}; use zero_optimization.stage 1 (the same fp32 "
        "masters, partitioned), or for bf16 set data_types.grad_accum_dtype to fp32 (DeepSpeed's BF16_Optimizer)"
    )


def optimizer_record(engine: Engine) -> dict[str, Any]:
    """The base optimizer's class, algorithm and state names, for the metadata (see `compat.Kernel`)."""
    kernel = compat.optimizer_kernel(compat.base_optimizer(engine))
    return {"class": kernel.qualname, "algorithm": kernel.algorithm, "states": kernel.states}


def model_spec(engine: Engine) -> ModelSpec | None:
    """What the engine's megatron-core GPT computes (None for other modules), with the unpadded vocabulary when
    `checkpoint.universal.vocab_size` gives it."""
    fields = compat.megatron_gpt_architecture(engine.module)
    if fields is None:
        return None
    options = attached_options(engine)
    if options is not None and options.vocab_size:
        fields["vocab_size"] = options.vocab_size
    return ModelSpec(**fields)


def describe(
    engine: Engine, client_state_keys: tuple[str, ...] = (), hf_config: dict[str, Any] | None = None
) -> SaveMeta:
    """Build the save-time metadata of a live engine (`hf_config`: of the Hugging Face weights it was loaded from)."""
    module = engine.module
    names = {p: n for n, p in module.named_parameters()}
    placed = infos(engine)
    to_global = namer(engine)
    stage = int(engine.zero_optimization_stage())
    layer_files = compat.pipeline_layer_files(module)
    if stage == 3:
        slots = _all_expert_ranks(engine, _zero3_slots(engine.optimizer, names, placed))
    elif compat.is_unpartitioned(engine):
        slots = _whole_slots(engine.optimizer, names, placed, layer_files)
    elif unsupported(engine) is None:
        slots = _all_expert_ranks(engine, _zero12_slots(engine.optimizer, names, placed))
    else:
        raise NotImplementedError(unsupported(engine))
    owned = {s.local or s.name for s in slots}
    extras = []
    for name, p in module.named_parameters():
        if name in owned:
            continue
        z3 = compat.is_zero3_param(p)
        info = placed[name]
        extras.append(
            ExtraTensor(
                info.name,
                compat.full_shape(p),
                dtype_name(compat.storage_dtype(p)),
                "frozen",
                compat.zero3_partition_numel(p) if z3 else 0,
                info.layout,
                name if name != info.name else "",
                file=layer_files.get(name, _MODEL_STATES).file,
                key=layer_files.get(name, _MODEL_STATES).key,
            )
        )
    buffers = dict(module.named_buffers())
    for name in compat.buffer_names(engine):
        buf = buffers[name]
        extras.append(
            ExtraTensor(
                to_global(name),
                tuple(buf.shape),
                dtype_name(buf.dtype),
                "buffer",
                local=name if name != to_global(name) else "",
                file=layer_files.get(name, _MODEL_STATES).file,
                key=layer_files.get(name, _MODEL_STATES).key,
            )
        )
    tied: dict[str, str] = {}
    owner_of: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in owner_of:
            tied[to_global(name)] = to_global(owner_of[id(p)])
        else:
            owner_of[id(p)] = name
    tied.update({s.local: s.name for s in slots if s.alias})
    mp = model_parallel(engine)
    spec = model_spec(engine)
    return SaveMeta(
        model=spec,
        # a Hugging Face model trained under its own names (AutoTP, Ulysses, HF Trainer) exports with its config
        hf_config=hf_config if hf_config is not None or spec is not None else compat.hf_model_config(module),
        optimizer=optimizer_record(engine),
        data_sampler_rng=compat.sampler_rng(engine),
        topology=topology(engine),
        params=tuple(slots),
        extras=tuple(extras),
        tied=tied,
        num_groups=len(compat.base_optimizer(engine).param_groups),
        client_state_keys=tuple(client_state_keys),
        tp_rank=mp.tp_rank,
        pp_rank=mp.pp_rank,
        versions={
            "ucp_deepspeed": __version__,
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "base_optimizer": type(compat.base_optimizer(engine)).__name__,
        },
    )
