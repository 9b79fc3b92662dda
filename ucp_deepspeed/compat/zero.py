"""The reach into DeepSpeed's ZeRO optimizers: the flat fp32 partitions of ZeRO-1/2 (and BF16_Optimizer), ZeRO-3's
sub-groups and partitioned parameters (`ds_*` attributes), which piece of each parameter a rank owns, and ZeRO-3's
NVMe swapping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ucp_deepspeed.compat.deepspeed import base_optimizer


def is_zero3_param(p: Any) -> bool:
    """Whether ZeRO-3 partitioned this parameter (its data is then a placeholder)."""
    return hasattr(p, "ds_id")


def full_shape(p: Any) -> tuple[int, ...]:
    """A parameter's full shape, also when ZeRO-3 partitioned it."""
    return tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape)


def storage_dtype(p: Any) -> Any:
    """The dtype a parameter is stored in, also when ZeRO-3 partitioned it."""
    return p.ds_tensor.dtype if is_zero3_param(p) else p.dtype


def zero3_partition(p: Any) -> tuple[Any, int, int]:
    """(this rank's partition tensor, its first element in the flattened parameter, its valid length)."""
    import torch.distributed as dist

    partition = p.ds_tensor.numel()
    start = dist.get_rank(group=p.ds_process_group) * partition
    return p.ds_tensor, start, max(0, min(partition, p.ds_numel - start))


def is_bf16_optimizer(opt: Any) -> bool:
    """DeepSpeed's BF16_Optimizer (ZeRO-0/1 with bf16), whose flat groups have their own names."""
    return hasattr(opt, "bf16_groups")


@dataclass(frozen=True)
class FlatGroup:
    """One param group of a ZeRO-1/2 (or BF16) optimizer: its parameters laid end to end in a flat buffer,
    of which this rank holds the fp32 partition `fp32`."""

    params: list[Any]
    offsets: list[int]
    numel: int
    dp: int
    fp32: Any


def zero12_groups(opt: Any) -> list[FlatGroup]:
    """The flat groups of a ZeRO-1/2 or BF16 optimizer, in param-group order."""
    import torch.distributed as dist

    bf16 = is_bf16_optimizer(opt)
    out = []
    for i, flat in enumerate(opt.bf16_groups_flat if bf16 else opt.bit16_groups_flat):
        if bf16:
            params = list(opt.bf16_groups[i])
            offsets = [sum(p.numel() for p in params[:k]) for k in range(len(params))]
        else:
            params, offsets = list(opt.round_robin_bit16_groups[i]), [int(o) for o in opt.round_robin_bit16_offsets[i]]
        fp32 = opt.fp32_groups_flat_partition[i] if bf16 else opt.single_partition_of_fp32_groups[i]
        out.append(
            FlatGroup(params, offsets, flat.numel(), dist.get_world_size(group=opt.real_dp_process_group[i]), fp32)
        )
    return out


def zero12_fragment(lp: Any) -> tuple[int, int, int, Any] | None:
    """(first element in the parameter, first element in the rank's fp32 partition, length, the fp32 view)
    of the piece of a ZeRO-1/2 parameter this rank owns; None when it owns none."""
    mapping = lp._hp_mapping
    if mapping is None:
        return None
    return (
        mapping.lp_fragment_address.start,
        mapping.hp_fragment_address.start,
        mapping.lp_fragment_address.numel,
        mapping.hp_fragment,
    )


def owned_fragments(engine: Any, keys: list[str]) -> Callable[[Any], tuple[int, dict[str, Any]] | None]:
    """For a trainable parameter of a ZeRO-1/2/3 engine: (its first element this rank holds, {"fp32": that piece of
    the fp32 master, key: that piece of each optimizer state}), views into the engine's own tensors; None when this
    rank holds none of it."""
    import math

    opt = engine.optimizer
    state = base_optimizer(engine).state
    if int(engine.zero_optimization_stage()) == 3:

        def zero3(p: Any) -> tuple[int, dict[str, Any]] | None:
            sub, offset, partition, start = zero3_position(opt, p)
            numel = min(partition, math.prod(full_shape(p)) - start)
            if numel <= 0:
                return None
            flat = opt.fp32_partitioned_groups_flat[sub]
            held = state.get(flat, {})
            return start, {"fp32": flat.narrow(0, offset, numel), **{k: held[k].narrow(0, offset, numel) for k in keys}}

        return zero3
    flats = {id(lp): group.fp32 for group in zero12_groups(opt) for lp in group.params}

    def zero12(p: Any) -> tuple[int, dict[str, Any]] | None:
        fragment = zero12_fragment(p)
        if fragment is None:
            return None
        start, hp_start, numel, hp = fragment
        held = state.get(flats[id(p)], {})
        return start, {"fp32": hp, **{k: held[k].narrow(0, hp_start, numel) for k in keys}}

    return zero12


def update_lp_params(opt: Any) -> None:
    """Rebuild a ZeRO-1/2 (or BF16) optimizer's low-precision weights from the fp32 partitions: each rank copies its
    own, then DeepSpeed all-gathers them over the data-parallel groups (collective)."""
    opt.update_lp_params()


def relink_optimizer_states(opt: Any) -> None:
    """After optimizer states were replaced: make the per-parameter views (`safe_get_full_optimizer_state`)
    point at the new tensors."""
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()


@dataclass(frozen=True)
class SubGroup:
    """One ZeRO-3 sub-group: its parameters, the param group it belongs to, and this rank's flat fp32
    partition and low-precision copy."""

    group: int
    params: list[Any]
    fp32: Any
    lp: Any


def zero3_subgroups(opt: Any) -> list[SubGroup]:
    """The sub-groups of a ZeRO-3 optimizer, in order."""
    return [
        SubGroup(
            int(opt.sub_group_to_group_id[i]),
            list(params),
            opt.fp32_partitioned_groups_flat[i],
            opt.fp16_partitioned_groups_flat[i],
        )
        for i, params in enumerate(opt.fp16_groups)
    ]


def zero3_position(opt: Any, p: Any) -> tuple[int, int, int, int]:
    """(sub-group, offset in its flat buffer, partition size, first element this rank holds) of a ZeRO-3 parameter."""
    flat, offset, partition = opt.grad_position[opt.get_param_id(p)]
    return int(flat), int(offset), int(partition), int(opt._get_param_partition_rank(p)) * int(partition)


@dataclass(frozen=True)
class NvmeSwap:
    """ZeRO-3 NVMe optimizer offload on this rank: the folder under `offloaded_tensors/` a save copies its swap files
    into (DeepSpeed names it by global rank, or node-local rank with node-local storage), the optimizer file they
    complete, the fp32 dtype, and each swapped sub-group's swap id (`ds_id`) and element count."""

    folder: str
    optim_file: str
    dtype: Any
    swapped: dict[str, int]


def nvme_offload(engine: Any) -> bool:
    """Whether the engine offloads its optimizer to NVMe (ZeRO-3 swap files)."""
    return bool(engine.zero_nvme_offload_optimizer())


def nvme_param_offload(engine: Any) -> bool:
    """Whether ZeRO-3 swaps the engine's parameters to NVMe (`offload_param.device: nvme`)."""
    offload = engine.zero_offload_param() if int(engine.zero_optimization_stage()) == 3 else None
    return offload is not None and str(getattr(offload.device, "value", offload.device)) == "nvme"


def nvme_swap(engine: Any, save_dir: str, tag: str) -> NvmeSwap | None:
    """Where and what a save of `engine` to `save_dir/tag` swaps to NVMe; None without NVMe optimizer offload."""
    from ucp_deepspeed.io import storage as st

    if not nvme_offload(engine):
        return None
    opt = engine.optimizer
    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    swapped = {
        str(opt.fp32_partitioned_groups_flat[i].ds_id): int(opt.fp16_partitioned_groups_flat_numel[i])
        for i in range(len(opt.fp16_groups))
        if opt._swappable_optimizer_subgroup(i)
    }
    return NvmeSwap(
        f"rank{rank:02d}",
        st.basename(engine._get_zero_ckpt_name(save_dir, tag)),
        opt.master_weights_and_grads_dtype,
        swapped,
    )


@contextlib.contextmanager
def zero3_resident(opt: Any, index: int) -> Iterator[None]:
    """Inside: ZeRO-3 sub-group `index`'s fp32 partition and optimizer states are in memory, swapped in from NVMe if
    the sub-group lives there; on exit (also on an error) they are written back to its swap files.

    The swapper writes back the state tensors it swapped in, so those must be updated in place; a state tensor
    that did not exist before (an engine that has not stepped) is picked up as DeepSpeed's first step does.
    """
    if not getattr(opt, "swap_optimizer", False) or not opt._swappable_optimizer_subgroup(index):
        yield
        return
    opt._optimizer_states_and_gradient_swap_in(index)
    try:
        yield
    finally:
        opt._optimizer_states_and_gradient_swap_out(index)


def zero3_regather(opt: Any) -> None:
    """After partitions were rewritten: re-gather persistent parameters and drop secondary copies (collective)."""
    if opt.persistent_parameters:
        opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
    opt.invalidate_secondary_tensor()


def zero3_partition_numel(p: Any) -> int:
    """How many elements of a ZeRO-3 parameter each rank's partition holds (padding included)."""
    return int(p.partition_numel())
