"""Reshard a universal checkpoint into a live DeepSpeed engine: each rank reads only what it owns.

For every parameter the engine tells us which element range of the flattened parameter this
rank's fp32 partition holds (ZeRO-1/2: `_hp_mapping`; ZeRO-3: `ds_tensor` partition). We read
exactly that range of the fp32 master and of each optimizer state, rebuild the optimizer's flat
state tensors, then let DeepSpeed refresh the low-precision weights from the fp32 partitions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from deepspeed import comm as dist

from ucp_deepspeed.compat import rebuild
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.format.universal import MANIFEST, UniversalCheckpoint, decode_value
from ucp_deepspeed.geometry.layout import Layout
from ucp_deepspeed.naming.patterns import expert_blocks
from ucp_deepspeed.runtime.capture import expert_groups, infos, model_parallel, namer
from ucp_deepspeed.runtime.collective import guarded

# structure, not hyperparameters: DeepSpeed names MoE groups after their expert-parallel size
_NON_PARAM_KEYS = ("params", "name", "moe")


@dataclass(frozen=True)
class LiveParam:
    """A parameter of the live module: its global name, tensor-parallel layout and local shape."""

    name: str
    layout: Layout
    shape: tuple[int, ...]


def live_params(engine: Any) -> dict[torch.nn.Parameter, LiveParam]:
    """Every parameter of the engine's module, placed in the full model."""
    placed = infos(engine)
    return {p: LiveParam(placed[n].name, placed[n].layout, tuple(p.ds_shape if hasattr(p, "ds_id") else p.shape))
            for n, p in engine.module.named_parameters()}


def _problems(engine: Any, ckpt: UniversalCheckpoint, live: dict[torch.nn.Parameter, LiveParam]) -> tuple[list, set]:
    problems = []
    tp = model_parallel(engine).tp
    live_groups = {id(p): g for g, group in enumerate(engine.optimizer.optimizer.param_groups) for p in group["params"]}
    stage3 = int(engine.zero_optimization_stage()) == 3
    names = set()
    for p, info in live.items():
        names.add(info.name)
        rec = ckpt.params.get(info.name)
        if rec is None:
            continue
        try:
            shape = list(info.layout.full_shape(info.shape, tp))
        except ValueError as exc:
            problems.append(f"{info.name}: {exc}")
            continue
        if rec["shape"] != shape:
            hint = ""
            if info.layout.is_split and len(shape) == len(rec["shape"]) and \
                    [d for d in range(len(shape)) if shape[d] != rec["shape"][d]] == [info.layout.dim]:
                hint = " (if this is vocabulary padding, set checkpoint.universal.vocab_size to the unpadded size)"
            problems.append(f"{info.name}: checkpoint shape {rec['shape']}, model shape {shape}{hint}")
        elif rec["trainable"] != p.requires_grad:
            problems.append(f"{info.name}: trainable={rec['trainable']} in checkpoint, {p.requires_grad} in model")
        elif not stage3 and p.requires_grad and id(p) in live_groups and rec["group"] != live_groups[id(p)] \
                and not ckpt.manifest.get("weights_only"):
            problems.append(f"{info.name}: param group {rec['group']} in checkpoint, {live_groups[id(p)]} in model")
    sizes = expert_groups(engine)
    for block in expert_blocks(engine.module):
        saved = {block.expert_of(n) for n in ckpt.params if block.expert_of(n) is not None}
        live_count = sizes[block.group][0] * block.num_local
        if saved and len(saved) != live_count:
            problems.append(f"{block.prefix}*: checkpoint has {len(saved)} experts, the model has {live_count} "
                            f"(expert-parallel size {sizes[block.group][0]} x {block.num_local} local experts)")
    to_global = namer(engine)
    missing_buffers = sorted({to_global(n) for n in engine._get_buffer_names()} - set(ckpt.buffers))
    if missing_buffers:
        problems.append(f"buffers not in checkpoint: {missing_buffers[:8]}")
    if len(ckpt.manifest["param_groups"]) != len(engine.optimizer.optimizer.param_groups) \
            and not ckpt.manifest.get("weights_only"):
        problems.append(f"{len(ckpt.manifest['param_groups'])} param groups in checkpoint, "
                        f"{len(engine.optimizer.optimizer.param_groups)} in optimizer")
    return problems, names


def check_compatible(engine: Any, ckpt: UniversalCheckpoint, live: dict[torch.nn.Parameter, LiveParam]) -> None:
    """Refuse a checkpoint of another model on every rank: names, shapes, layouts and groups must match.

    Pipeline stages each hold part of the model, so names are compared over all ranks together.
    """
    problems, names = _problems(engine, ckpt, live)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (problems, sorted(names)))
    problems = list(dict.fromkeys(p for part, _ in everyone for p in part))
    all_names = {n for _, part in everyone for n in part}
    frozen = {info.name for p, info in live.items() if not p.requires_grad}
    skipped = frozen if ckpt.manifest.get("frozen_excluded") else set()  # saved with exclude_frozen_parameters
    missing = sorted(all_names - set(ckpt.params) - skipped)
    extra = sorted(set(ckpt.params) - all_names)
    if missing:
        problems.insert(0, f"parameters not in checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if extra:
        problems.insert(0, f"checkpoint parameters not in model: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    if problems:
        raise CheckpointError(f"{ckpt.root}/{MANIFEST}", "checkpoint does not match this model:\n  "
                              + "\n  ".join(problems))


def _apply_group_state(opt: Any, group_index: int, ckpt: UniversalCheckpoint, load_optimizer_states: bool,
                       flat: torch.Tensor, bufs: dict[str, torch.Tensor]) -> None:
    if not load_optimizer_states:
        return
    record = ckpt.manifest["param_groups"][group_index]
    state = opt.optimizer.state[flat]
    state.clear()
    state.update({k: decode_value(v) for k, v in record["scalars"].items()})
    state.update(bufs)


def _apply_hyperparams(opt: Any, ckpt: UniversalCheckpoint) -> None:
    for group, record in zip(opt.optimizer.param_groups, ckpt.manifest["param_groups"]):
        for key, value in (record["hyperparams"] or {}).items():
            if key not in _NON_PARAM_KEYS:
                group[key] = decode_value(value)


def _state_keys(ckpt: UniversalCheckpoint) -> list[str]:
    for rec in ckpt.params.values():
        if rec["trainable"]:
            return [k for k in rec["keys"] if k != FP32]
    return []


def _reader(engine: Any, ckpt: UniversalCheckpoint, live: dict[torch.nn.Parameter, LiveParam]) -> Any:
    """read(param, key, start, numel): a flat range of this rank's tensor-parallel share of a state."""
    mp = model_parallel(engine)

    def read(p: torch.nn.Parameter, key: str, start: int, numel: int) -> torch.Tensor:
        info = live[p]
        return ckpt.read_local(info.name, key, info.layout, info.shape, mp.tp_rank, mp.tp, start, numel)

    return read


def _restore_zero12(engine: Any, ckpt: UniversalCheckpoint, live: dict[torch.nn.Parameter, LiveParam],
                    load_optimizer_states: bool) -> None:
    opt = engine.optimizer
    is_bf16_opt = hasattr(opt, "bf16_groups")
    groups = opt.bf16_groups if is_bf16_opt else opt.bit16_groups
    flats = opt.fp32_groups_flat_partition if is_bf16_opt else opt.single_partition_of_fp32_groups
    read = _reader(engine, ckpt, live)
    keys = _state_keys(ckpt) if load_optimizer_states else []
    for i, flat in enumerate(flats):
        bufs = {k: torch.zeros_like(flat) for k in keys}
        for lp in groups[i]:
            mapping = lp._hp_mapping
            if mapping is None:
                continue
            start, numel = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
            mapping.hp_fragment.data.copy_(read(lp, FP32, start, numel))
            for k in keys:
                bufs[k].narrow(0, mapping.hp_fragment_address.start, numel).copy_(read(lp, k, start, numel))
        _apply_group_state(opt, i, ckpt, load_optimizer_states, flat, bufs)
    if load_optimizer_states:
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    # Each rank reads its whole low-precision weights, as DeepSpeed's native load reads the full
    # model-states file, instead of update_lp_params' all-gather of every partition (on gloo that
    # all-gather was 2.3 s of a 3.1 s restore at 300M parameters). copy_ rounds exactly as it does.
    for group in groups:
        for lp in group:
            lp.data.copy_(read(lp, FP32, 0, lp.numel()).view(lp.shape))


def _restore_zero3(engine: Any, ckpt: UniversalCheckpoint, live: dict[torch.nn.Parameter, LiveParam],
                   load_optimizer_states: bool) -> None:
    opt = engine.optimizer
    read = _reader(engine, ckpt, live)
    keys = _state_keys(ckpt) if load_optimizer_states else []
    for sub, flat in enumerate(opt.fp32_partitioned_groups_flat):
        bufs = {k: torch.zeros_like(flat) for k in keys}
        for p in opt.fp16_groups[sub]:
            _, offset, partition = opt.grad_position[opt.get_param_id(p)]
            start = opt._get_param_partition_rank(p) * partition
            numel = max(0, min(partition, p.ds_numel - start))
            flat.data.narrow(0, offset, numel).copy_(read(p, FP32, start, numel))
            for k in keys:
                bufs[k].narrow(0, offset, numel).copy_(read(p, k, start, numel))
        _apply_group_state(opt, opt.sub_group_to_group_id[sub], ckpt, load_optimizer_states, flat, bufs)
        opt.fp16_partitioned_groups_flat[sub].data.copy_(flat.data)
    for p in engine.module.parameters():
        if not p.requires_grad and hasattr(p, "ds_id") and live[p].name in ckpt.params:
            partition = p.ds_tensor.numel()
            start = dist.get_rank(group=p.ds_process_group) * partition
            numel = max(0, min(partition, p.ds_numel - start))
            p.ds_tensor.data.narrow(0, 0, numel).copy_(read(p, VALUE, start, numel))


def _gather_zero3(engine: Any) -> None:
    """ZeRO-3 re-gathers persistent parameters from the restored partitions (collective)."""
    opt = engine.optimizer
    if opt.persistent_parameters:
        opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
    opt.invalidate_secondary_tensor()


def _restore_module_extras(engine: Any, ckpt: UniversalCheckpoint, live: dict[torch.nn.Parameter, LiveParam]) -> None:
    buffers = dict(engine.module.named_buffers())
    to_global = namer(engine)
    for name in engine._get_buffer_names():
        buffers[name].data.copy_(ckpt.read_buffer(to_global(name)))
    read = _reader(engine, ckpt, live)
    for p in engine.module.parameters():
        if not p.requires_grad and not hasattr(p, "ds_id") and live[p].name in ckpt.params:
            p.data.copy_(read(p, VALUE, 0, p.numel()).view(p.shape))


def _restore_training_state(engine: Any, ckpt: UniversalCheckpoint, load_lr_scheduler_states: bool) -> dict[str, Any]:
    counters = ckpt.manifest["counters"]
    engine.global_steps = counters.get("global_steps", engine.global_steps)
    engine.global_samples = counters.get("global_samples", engine.global_samples)
    engine.skipped_steps = counters.get("skipped_steps", engine.skipped_steps)
    state = ckpt.load_state()
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    for key, value in state.get("optimizer_wrapper", {}).items():
        if hasattr(engine.optimizer, key):
            setattr(engine.optimizer, key, rebuild(value))
    return state.get("client_state", {})


def restore(engine: Any, ckpt: UniversalCheckpoint, load_optimizer_states: bool = True,
            load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> dict[str, Any]:
    """Load a universal checkpoint into `engine` at its current layout; return the client state.

    Ranks read different parts of the checkpoint, so a damaged block may fail on some ranks only:
    every read happens before the next collective, and the first failure is raised on all ranks.
    """
    live = live_params(engine)
    check_compatible(engine, ckpt, live)
    # an import (e.g. from Hugging Face) carries weights only: the optimizer starts fresh
    load_optimizer_states = load_optimizer_states and not load_module_only and not ckpt.manifest.get("weights_only")
    stage3 = int(engine.zero_optimization_stage()) == 3

    def read_everything() -> dict[str, Any]:
        if stage3:
            _restore_zero3(engine, ckpt, live, load_optimizer_states)
        else:
            _restore_zero12(engine, ckpt, live, load_optimizer_states)
        if load_optimizer_states:
            _apply_hyperparams(engine.optimizer, ckpt)
        _restore_module_extras(engine, ckpt, live)
        return {} if load_module_only else _restore_training_state(engine, ckpt, load_lr_scheduler_states)

    client = guarded(read_everything)
    if stage3:
        _gather_zero3(engine)
    return client
