"""The reach into DeepSpeed's ZeRO optimizers: the flat fp32 partitions of ZeRO-1/2 (and BF16_Optimizer), ZeRO-3's
sub-groups and partitioned parameters (`ds_*` attributes), which piece of each parameter a rank owns, and ZeRO-3's
NVMe swapping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from ucp_deepspeed.compat.deepspeed import base_optimizer
from ucp_deepspeed.protocols import Engine


def is_zero3_param(p: Any) -> bool:
    """Whether ZeRO-3 partitioned this parameter (its data is then a placeholder)."""
    return hasattr(p, "ds_id")


def full_shape(p: Any) -> tuple[int, ...]:
    """A parameter's full shape, also when ZeRO-3 partitioned it."""
    return tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape)


def storage_dtype(p: Any) -> Any:
    """The dtype a parameter is stored in, also when ZeRO-3 partitioned it."""
    return p.ds_tensor.dtype if is_zero3_param(p) else p.dtype


class Zero3Partition(NamedTuple):
    """This rank's partition of a ZeRO-3 parameter: the partition tensor, its first element in the flattened
    parameter, and how many of its elements are the parameter's (the rest is padding)."""

    tensor: Any
    start: int
    numel: int


def zero3_partition(p: Any) -> Zero3Partition:
    """This rank's partition of a ZeRO-3 parameter (a frozen one is read and written through it)."""
    import torch.distributed as dist

    partition = p.ds_tensor.numel()
    start = dist.get_rank(group=p.ds_process_group) * partition
    return Zero3Partition(tensor=p.ds_tensor, start=start, numel=max(0, min(partition, p.ds_numel - start)))


def zero3_partition_numel(p: Any) -> int:
    """How many elements of a ZeRO-3 parameter each rank's partition holds (padding included)."""
    return int(p.partition_numel())


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
        dp = dist.get_world_size(group=opt.real_dp_process_group[i])
        out.append(FlatGroup(params=params, offsets=offsets, numel=flat.numel(), dp=dp, fp32=fp32))
    return out


class OwnedFragment(NamedTuple):
    """The piece of a trainable parameter's fp32 master one rank owns, under ZeRO-1/2 or ZeRO-3: its first element
    in the flattened parameter, its first element in the rank's flat fp32 partition, its length, and a view of it."""

    start: int
    offset: int
    numel: int
    fp32: Any


def zero12_fragment(lp: Any) -> OwnedFragment | None:
    """The piece of a ZeRO-1/2 parameter this rank owns (DeepSpeed's `_hp_mapping`); None when it owns none."""
    mapping = lp._hp_mapping
    if mapping is None:
        return None
    return OwnedFragment(
        start=mapping.lp_fragment_address.start,
        offset=mapping.hp_fragment_address.start,
        numel=mapping.lp_fragment_address.numel,
        fp32=mapping.hp_fragment,
    )


def zero3_fragment(opt: Any, p: Any) -> OwnedFragment:
    """The piece of a ZeRO-3 parameter this rank owns, in its sub-group's flat fp32 partition; of length 0 when the
    rank's partition holds only padding."""
    import math

    position = zero3_position(opt, p)
    numel = max(0, min(position.partition, math.prod(full_shape(p)) - position.start))
    flat = opt.fp32_partitioned_groups_flat[position.sub_group]
    return OwnedFragment(
        start=position.start, offset=position.offset, numel=numel, fp32=flat.narrow(0, position.offset, numel)
    )


class OwnedState(NamedTuple):
    """What a rank holds of a trainable parameter: its first element, and views of that piece into the engine's own
    tensors: `"fp32"` for the fp32 master, and each optimizer state by its key."""

    start: int
    tensors: dict[str, Any]


def owned_fragments(engine: Engine, keys: list[str]) -> Callable[[Any], OwnedState | None]:
    """For a trainable parameter of a ZeRO-1/2/3 engine: the piece of it and of its optimizer states `keys` this rank
    holds, as views into the engine's own tensors; None when this rank holds none of it."""
    opt = engine.optimizer
    state = base_optimizer(engine).state

    def zero3(p: Any) -> OwnedFragment | None:
        piece = zero3_fragment(opt, p)
        return piece if piece.numel else None

    fragment: Callable[[Any], OwnedFragment | None]
    if int(engine.zero_optimization_stage()) == 3:
        flats = {id(p): sub.fp32 for sub in zero3_subgroups(opt) for p in sub.params}
        fragment = zero3
    else:
        flats = {id(lp): group.fp32 for group in zero12_groups(opt) for lp in group.params}
        fragment = zero12_fragment

    def owned(p: Any) -> OwnedState | None:
        piece = fragment(p)
        if piece is None:
            return None
        held = state.get(flats[id(p)], {})
        narrowed = {k: held[k].narrow(0, piece.offset, piece.numel) for k in keys}
        return OwnedState(start=piece.start, tensors={"fp32": piece.fp32, **narrowed})

    return owned


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


def group_order(engine: Engine) -> list[list[Any]]:
    """Each optimizer param group's trainable parameters in the order the training script gave them, which is the
    order torch's own optimizer state dict numbers them in (ZeRO-1/2 flatten them in a round-robin order of their
    own, ZeRO-3 in sub-groups)."""
    opt = engine.optimizer
    if int(engine.zero_optimization_stage()) == 3:
        groups: list[list[Any]] = [[] for _ in base_optimizer(engine).param_groups]
        for i, params in enumerate(opt.fp16_groups):
            groups[int(opt.sub_group_to_group_id[i])].extend(params)
        return groups
    if is_bf16_optimizer(opt):
        return [list(g) for g in opt.bf16_groups]
    if hasattr(opt, "bit16_groups"):
        return [list(g) for g in opt.bit16_groups]
    return [list(g["params"]) for g in opt.param_groups]  # torch's optimizer itself, frozen parameters and all


def zero3_subgroups(opt: Any) -> list[SubGroup]:
    """The sub-groups of a ZeRO-3 optimizer, in order."""
    return [
        SubGroup(
            group=int(opt.sub_group_to_group_id[i]),
            params=list(params),
            fp32=opt.fp32_partitioned_groups_flat[i],
            lp=opt.fp16_partitioned_groups_flat[i],
        )
        for i, params in enumerate(opt.fp16_groups)
    ]


class Zero3Position(NamedTuple):
    """Where a ZeRO-3 parameter sits: its sub-group, its offset in the sub-group's flat buffers, the size of its
    partition on each rank (padding included), and the first element this rank's partition holds."""

    sub_group: int
    offset: int
    partition: int
    start: int


def zero3_position(opt: Any, p: Any) -> Zero3Position:
    """Where a ZeRO-3 parameter sits in its sub-group's flat buffers, and which of its elements this rank holds."""
    sub_group, offset, partition = opt.grad_position[opt.get_param_id(p)]
    return Zero3Position(
        sub_group=int(sub_group),
        offset=int(offset),
        partition=int(partition),
        start=int(opt._get_param_partition_rank(p)) * int(partition),
    )


@dataclass(frozen=True)
class NvmeSwap:
    """ZeRO-3 NVMe optimizer offload on this rank: the folder under `offloaded_tensors/` a save copies its swap files
    into (DeepSpeed names it by global rank, or node-local rank with node-local storage), the optimizer file they
    complete, the fp32 dtype, and each swapped sub-group's swap id (`ds_id`) and element count."""

    folder: str
    optim_file: str
    dtype: Any
    swapped: dict[str, int]


def nvme_offload(engine: Engine) -> bool:
    """Whether the engine offloads its optimizer to NVMe (ZeRO-3 swap files)."""
    return bool(engine.zero_nvme_offload_optimizer())


def nvme_param_offload(engine: Engine) -> bool:
    """Whether ZeRO-3 swaps the engine's parameters to NVMe (`offload_param.device: nvme`)."""
    offload = engine.zero_offload_param() if int(engine.zero_optimization_stage()) == 3 else None
    return offload is not None and str(getattr(offload.device, "value", offload.device)) == "nvme"


def nvme_swap(engine: Engine, save_dir: str, tag: str) -> NvmeSwap | None:
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
        folder=f"rank{rank:02d}",
        optim_file=st.basename(engine._get_zero_ckpt_name(save_dir, tag)),
        dtype=opt.master_weights_and_grads_dtype,
        swapped=swapped,
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
    """After partitions were rewritten: re-gather persistent parameters and drop secondary copies (collective). `opt`
    is ZeRO-3's optimizer, or its parameter partitioner alone (`DeepSpeedZeRoOffload`) in an engine built without
    one, which keeps no secondary copies."""
    if opt.persistent_parameters:
        opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
    invalidate = getattr(opt, "invalidate_secondary_tensor", None)
    if invalidate is not None:
        invalidate()
