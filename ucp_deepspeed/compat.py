"""Every reach into DeepSpeed, megatron-core and transformers internals, each behind one small named function.

The rest of the package reads and writes framework state only through here: private optimizer
attributes (flat groups, `_hp_mapping`, ZeRO-3 sub-groups), `ds_*` parameter attributes, engine
privates, DeepSpeed's expert-group registries and its MoE type check, megatron-core's tensor-parallel
attributes, and the classes DeepSpeed pickles. `tests/test_compat.py` has a one-process canary per
function: an upgrade that moves one of these fails there by name, not inside a multi-rank reshard test.
DeepSpeed, megatron-core and transformers are imported inside the functions that need them, so the
`ucp` command imports none of them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.safe_pickle import DEEPSPEED_CLASSES, PickledObject, user_allowed

ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"


def _class(qualname: str) -> Any:
    module, name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def deepspeed_safe_globals() -> list[Any]:
    """The classes DeepSpeed pickles into its checkpoint files, for `torch.load(weights_only=True)`."""
    return [_class(q) for q in (*DEEPSPEED_CLASSES, ZERO_STAGE_ENUM)]


def user_safe_globals() -> list[Any]:
    """The globals a user trusts (`UCP_ALLOW_PICKLE`), imported by exact name."""
    out = []
    for qualname in sorted(user_allowed()):
        module, _, name = qualname.rpartition(".")
        if not module or not name.isidentifier():
            raise CheckpointError("UCP_ALLOW_PICKLE", f"{qualname!r} is not module.Name")
        out.append(getattr(importlib.import_module(module), name))
    return out


def rebuild(value: Any) -> Any:
    """A real DeepSpeed object from a stand-in (`PickledObject`) or its plain-data form; anything else as is.

    Only the classes in `DEEPSPEED_CLASSES` are built, the way pickle would build them: `__new__`,
    then the saved attributes.
    """
    if isinstance(value, PickledObject):
        qualname, args, state = value.qualname, value.args, value.state
    elif isinstance(value, dict) and set(value) == {"__class__", "args", "state"}:
        qualname, args, state = value["__class__"], tuple(value["args"]), value["state"]
    else:
        return value
    if qualname not in DEEPSPEED_CLASSES:
        raise CheckpointError(qualname, "is not a class ucp_deepspeed rebuilds")
    cls = _class(qualname)
    obj = cls.__new__(cls, *args)
    if isinstance(state, dict):
        obj.__dict__.update(state)
    return obj


# --- DeepSpeed engines and ZeRO optimizers -------------------------------------------------------


def buffer_names(engine: Any) -> list[str]:
    """The module buffers DeepSpeed saves (persistent ones), by local name."""
    return list(engine._get_buffer_names())


def engine_config(engine: Any) -> Any:
    """The engine's parsed `DeepSpeedConfig` (what a checkpoint engine is built from)."""
    return engine._config


def commit_decoupled_checkpoint(engine: Any) -> None:
    """Let DeepSpeed finish a save whose files a decoupled checkpoint engine wrote (moves `latest`)."""
    engine._commit_decoupled_checkpoint()


def store_recovery_scripts(engine: Any, remote: Callable[[str], bool], write: Callable[[str, bytes], None]) -> None:
    """DeepSpeed copies its `zero_to_fp32.py` scripts into the save folder with `shutil.copyfile`, which cannot reach
    an object store: for a `remote` folder, send them through `write` instead."""
    native = engine._copy_recovery_script

    def copy_recovery_script(save_path: str) -> None:
        if not remote(save_path):
            return native(save_path)
        import deepspeed

        utils = os.path.join(os.path.dirname(deepspeed.__file__), "utils")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            source = os.path.join(utils, script)
            if os.path.isfile(source):
                with open(source, "rb") as f:
                    write(save_path.rstrip("/") + "/" + script, f.read())
        return None

    engine._copy_recovery_script = copy_recovery_script


def before_model_step(engine: Any, check: Callable[[], None]) -> None:
    """Run `check` before every optimizer step of `engine` (plain and pipeline engines step through
    `_take_model_step`); it refuses the step by raising."""
    native = engine._take_model_step

    def take_model_step(*args: Any, **kwargs: Any) -> Any:
        check()
        return native(*args, **kwargs)

    engine._take_model_step = take_model_step


def base_optimizer(engine: Any) -> Any:
    """The torch optimizer DeepSpeed steps: ZeRO and bf16 wrap it (`.optimizer`); ZeRO-0 in fp32 uses it as is."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def is_unpartitioned(engine: Any) -> bool:
    """Whether the engine steps a plain torch optimizer on whole fp32 parameters (ZeRO-0 without bf16/fp16)."""
    import torch

    return isinstance(engine.optimizer, torch.optim.Optimizer)


def is_ulysses_mpu(mpu: Any) -> bool:
    """Whether an engine's `mpu` is DeepSpeed's Ulysses sequence-parallel state (`parallel_state_sp`), whose
    "model parallel" getters alias the sequence-parallel group although every rank holds the whole model."""
    return hasattr(mpu, "get_sequence_parallel_world_size") and not hasattr(mpu, "get_tensor_model_parallel_rank")


def sequence_parallel_size(engine: Any) -> int:
    """The engine's Ulysses sequence-parallel size (1 without)."""
    return int(getattr(engine, "sequence_parallel_size", 1) or 1)


def ulysses_outside_zero(engine: Any) -> bool:
    """Whether a Ulysses engine's sequence-parallel ranks fall outside its ZeRO group, as when DeepSpeed 0.19.8 builds
    them from the config's device mesh (`sequence_parallel_size` and `data_parallel_size`): ZeRO then partitions, and
    sums gradients, over the mesh's data-parallel dimension alone."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    if sequence_parallel_size(engine) == 1:
        return False
    sequence = set(dist.get_process_group_ranks(groups._get_sequence_parallel_group()))
    return not sequence <= set(dist.get_process_group_ranks(engine.seq_data_parallel_group))


def zero_world_size(engine: Any) -> int:
    """How many ranks ZeRO partitions over: under Ulysses the sequence x data-parallel ranks (DeepSpeed then leaves
    `dp_world_size` None), else the data-parallel ones."""
    if sequence_parallel_size(engine) > 1:
        return int(engine.seq_dp_world_size)
    return int(engine.dp_world_size)


def data_parallel_rank(engine: Any) -> int:
    """This rank's index in its data-parallel group (a pipeline stage's replicas; not the global rank)."""
    import torch.distributed as dist

    return dist.get_rank(group=engine.seq_data_parallel_group)


def pipeline_layer_files(module: Any) -> dict[str, tuple[str, str]]:
    """Where a `PipelineModule` saves each tensor of its layers: module name -> (layer file name, key in it).

    DeepSpeed writes each layer's `state_dict` to `layer_XX[-model_YY]-model_states.pt` (XX the global
    layer index) instead of the model-states file; a tied layer once per stage that builds it with a
    state dict, and a layer without `state_dict` (a function, a tied `forward_fn`) nowhere. Empty for
    any other module.
    """
    from deepspeed.pipe import PipelineModule

    if not isinstance(module, PipelineModule):
        return {}
    path_of = {id(sub): path for path, sub in module.named_modules()}
    out: dict[str, tuple[str, str]] = {}
    for local_idx, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "state_dict") or id(layer) not in path_of:
            continue
        file = module.ckpt_layer_path("", local_idx)
        for key in layer.state_dict():
            out.setdefault(f"{path_of[id(layer)]}.{key}", (file, key))
    return out


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
        os.path.basename(engine._get_zero_ckpt_name(save_dir, tag)),
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


# --- Mixture of experts: DeepSpeed's expert groups and megatron-core's MoE layers ---------------------


def expert_parallel(group: str) -> tuple[int, int, int]:
    """(expert-parallel size, expert-parallel rank, expert-data-parallel rank) of a DeepSpeed expert group."""
    from deepspeed.utils import groups

    return (
        groups._get_expert_parallel_world_size(group),
        groups._get_expert_parallel_rank(group),
        groups._get_expert_data_parallel_rank(group),
    )


def register_expert_groups(name: str, ep_group: Any, edp_group: Any) -> None:
    """Register existing expert-parallel / expert-data-parallel process groups with DeepSpeed under `name`."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    for registry, ranks, group in (
        (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, ep_group),
        (groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, edp_group),
    ):
        registry[name] = group
        ranks[name] = dist.get_process_group_ranks(group)


def is_megatron_moe(module: Any) -> bool:
    """A megatron-core `MoELayer`."""
    return type(module).__name__ == "MoELayer" and type(module).__module__.startswith("megatron.core.transformer.moe")


def megatron_grouped_experts(module: Any) -> str | None:
    """`te` for megatron-core's TEGroupedMLP (one weight per local expert: `linear_fc1.weight<i>`), `fused` for its
    GroupedMLP (all local experts in one `weight1` / `weight2`), None for anything else."""
    if not type(module).__module__.startswith("megatron.core.transformer.moe"):
        return None
    return {"TEGroupedMLP": "te", "GroupedMLP": "fused"}.get(type(module).__name__)


def is_megatron_transformer_layer(module: Any) -> bool:
    """A megatron-core `TransformerLayer` (or a subclass defined in megatron-core)."""
    return is_megatron_module(module) and any(c.__name__ == "TransformerLayer" for c in type(module).__mro__)


@functools.cache
def megatron_fused_norms() -> dict[str, str]:
    """Transformer Engine's fused-norm parameter prefixes inside a megatron-core transformer layer -> the local
    spec's, read from megatron-core's own map between the two (its local GPT layer spec's
    `sharded_state_dict_keys_map`: `input_layernorm.` <-> `self_attention.linear_qkv.layer_norm_`, ...)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return {te: local for local, te in get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map.items()}


class _MoEOrMegatron(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        from deepspeed.moe.layer import MoE

        return isinstance(obj, MoE) or is_megatron_moe(obj)


class _MoEClass(metaclass=_MoEOrMegatron):
    """Matches DeepSpeed's MoE layer and megatron-core's, for DeepSpeed's `has_moe_layers` check."""


@contextlib.contextmanager
def deepspeed_sees_megatron_moe() -> Iterator[None]:
    """While an engine is built, DeepSpeed's engine module counts megatron-core MoE layers as its own MoE.

    DeepSpeed decides `has_moe_layers` with `isinstance(module, MoE)` on the name `MoE` in
    `deepspeed.runtime.engine`; only that lookup is widened, and only inside this block.
    """
    from deepspeed.runtime import engine as ds_engine

    original = ds_engine.MoE
    ds_engine.MoE = _MoEClass
    try:
        yield
    finally:
        ds_engine.MoE = original


def expert_container(module: Any) -> tuple[str, int, str] | None:
    """(path of the local experts inside `module`, how many, expert group name) for a DeepSpeed `MoE` or a
    registered megatron-core `MoELayer`; None for anything else."""
    if not (hasattr(module, "num_local_experts") and hasattr(module, "expert_group_name")):
        return None
    kind = type(module).__module__
    if kind.startswith("deepspeed.moe"):
        return "deepspeed_moe.experts.deepspeed_experts.", int(module.num_local_experts), module.expert_group_name
    if kind.startswith("megatron.core.transformer.moe"):
        return "experts.local_experts.", int(module.num_local_experts), module.expert_group_name
    return None


# --- optimizer kernels: how each implementation keeps its algorithm's state -----------------------------


@dataclass(frozen=True)
class Kernel:
    """How one optimizer class keeps the state of its algorithm.

    `algorithm` names the update rule (`adam`, `adamw`, `adagrad`, `lion`, `sgd`; another class's own name);
    `step` is how it counts steps: `tensor` (torch's, per parameter), `int` (DeepSpeed's kernels), `none`
    (SGD), or `as_saved` for a class outside torch and the table. `states` maps its state names to the algorithm's
    (torch's: `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `sum`, `momentum_buffer`) where they differ.
    """

    qualname: str
    algorithm: str
    step: str
    states: dict[str, str]


def optimizer_kernel(opt: Any) -> Kernel:
    """The kernel of a base optimizer (what DeepSpeed's ZeRO wrapper steps)."""
    cls = type(opt)
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    decoupled = bool(getattr(opt, "adam_w_mode", getattr(opt, "adamw_mode", True)))
    groups = getattr(opt, "param_groups", None) or [{}]
    table = {
        "torch.optim.adamw.AdamW": ("adamw", "tensor", {}),
        "torch.optim.adam.Adam": (
            "adamw" if any(g.get("decoupled_weight_decay") for g in groups) else "adam",
            "tensor",
            {},
        ),
        "deepspeed.ops.adam.fused_adam.FusedAdam": ("adamw" if decoupled else "adam", "int", {}),
        "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam": ("adamw" if decoupled else "adam", "int", {}),
        "torch.optim.adagrad.Adagrad": ("adagrad", "tensor", {}),
        "deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad": ("adagrad", "int", {"exp_avg_sq": "sum"}),
        "deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion": ("lion", "int", {}),
        "deepspeed.ops.lion.fused_lion.FusedLion": ("lion", "int", {}),
        "torch.optim.sgd.SGD": ("sgd", "none", {}),
    }
    # torch's other optimizers keep per-parameter tensor steps too; another library's are left as saved
    other: tuple[str, str, dict[str, str]] = (
        cls.__name__,
        "tensor" if qualname.startswith("torch.optim.") else "as_saved",
        {},
    )
    algorithm, step, states = table.get(qualname, other)
    return Kernel(qualname, algorithm, step, states)


def scalar_device(group: dict[str, Any], flat: Any) -> Any:
    """Where torch keeps a group's `step` tensors: on the parameters' device for its capturable and fused
    kernels, else on the CPU."""
    import torch

    return flat.device if group.get("capturable") or group.get("fused") else torch.device("cpu")


# --- DeepSpeed AutoTP: how its layers cut a Hugging Face model's parameters --------------------------------


def hf_model_config(module: Any) -> dict[str, Any] | None:
    """The `config.json` contents of a `transformers` model (what `save_pretrained` writes), None for other modules."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(module, transformers.PreTrainedModel):
        return None
    return json.loads(module.config.to_json_string(use_diff=False))


def autotp_meta(p: Any) -> dict[str, Any] | None:
    """The restore metadata DeepSpeed's AutoTP attaches to a parameter it partitioned or marked
    (`ds_autotp_universal_checkpoint_meta`: partition dim and sizes, fused sub-parameters, replication); None for
    a parameter AutoTP left untouched (which every tensor-parallel rank holds whole)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    meta = getattr(p, DS_AUTOTP_UC_META, None)
    return dict(meta) if isinstance(meta, dict) else None


def is_autotp_model(module: Any) -> bool:
    """Whether DeepSpeed's AutoTP partitioned this module for training (it marks the model when done)."""
    return bool(getattr(module, "ds_autotp_parsed", False))


class ExpertStack(NamedTuple):
    """Where one AutoEP expert parameter's stack of experts sits: this rank's run of the layer's experts."""

    ep_size: int
    ep_rank: int
    experts: tuple[int, ...]


def autoep_stack(p: Any) -> ExpertStack | None:
    """The expert placement DeepSpeed's AutoEP attaches to each stacked expert parameter it built
    (`ds_autoep_uc_meta`: its placement descriptor, expert-parallel rank and local experts); None for others."""
    from deepspeed.checkpoint.constants import (
        AUTOEP_EXPERT_PLACEMENT,
        AUTOEP_PARAM_EP_RANK,
        AUTOEP_PARAM_LOCAL_EXPERTS,
        DS_AUTOEP_UC_META,
    )

    meta = getattr(p, DS_AUTOEP_UC_META, None)
    if not isinstance(meta, dict):
        return None
    return ExpertStack(
        int(meta[AUTOEP_EXPERT_PLACEMENT]["ep_size"]),
        int(meta[AUTOEP_PARAM_EP_RANK]),
        tuple(int(e) for e in meta[AUTOEP_PARAM_LOCAL_EXPERTS]),
    )


def autoep_groups(module: Any) -> dict[str, int]:
    """The expert-parallel group name (`ep_size_<E>`) of each of DeepSpeed's AutoEP layers in a module, and its size."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return {m.ep_group_name: int(m.ep_size) for m in module.modules() if isinstance(m, AutoEPMoELayer)}


# --- megatron-core modules and their tensor-parallel attributes ---------------------------------------


def is_megatron_module(module: Any) -> bool:
    """A module defined by megatron-core (its parameters carry tensor-parallel attributes)."""
    return type(module).__module__.startswith("megatron.core")


def megatron_split(p: Any) -> tuple[int, int, bool] | None:
    """(split dim, fused parts, is the vocab-parallel embedding/output) of a megatron-core tensor-parallel
    parameter; None when it is replicated."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    return (
        int(p.partition_dim),
        int(getattr(p, "partition_stride", 1)),
        bool(getattr(p, "is_embedding_or_output_parameter", False)),
    )


def megatron_layer_number(module: Any) -> int | None:
    """The 1-based global layer number of a megatron-core transformer layer; None for other modules."""
    number = getattr(module, "layer_number", None)
    return number if isinstance(number, int) and is_megatron_module(module) else None


def megatron_tied_output_stage(module: Any) -> bool:
    """A megatron-core model on a last pipeline stage (not also the first) whose output layer is a copy of
    the word embedding."""
    return (
        is_megatron_module(module)
        and bool(getattr(module, "share_embeddings_and_output_weights", False))
        and bool(getattr(module, "post_process", False))
        and not getattr(module, "pre_process", True)
    )


# Function-changing megatron-core settings and their plain values; any other value is recorded as unmapped.
# (`apply_query_key_layer_scaling` is not one: the softmax multiplies its divisor back.)
_PLAIN_MEGATRON = {
    "qk_layernorm": False,
    "qk_l2_norm": False,
    "layernorm_zero_centered_gamma": False,
    "apply_residual_connection_post_layernorm": False,
    "rotary_interleaved": False,
    "no_rope_freq": None,
    "multi_latent_attention": False,
    "softmax_scale": None,
    "softmax_type": "vanilla",
    "window_attn_skip_freq": None,
    "attention_output_gate": False,
    "experimental_attention_variant": None,
    "linear_attention_freq": None,
    "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None,
    "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_topk_limited_devices": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_force_load_balancing": False,
    "moe_shared_expert_intermediate_size": None,
    "moe_layer_freq": 1,
    "moe_input_jitter_eps": None,
    "moe_apply_probs_on_input": False,
    "moe_expert_capacity_factor": None,
    "moe_latent_size": None,
    "mtp_num_layers": None,
}
_LLAMA3_CONTEXT, _LLAMA3_LOW, _LLAMA3_HIGH = 8192, 1.0, 4.0


def _activation_name(fn: Any) -> str:
    import torch.nn.functional as F

    if fn is F.gelu:
        return "gelu"
    if fn is F.silu:
        return "silu"
    tanh = {"approximate": "tanh"}
    if isinstance(fn, functools.partial) and fn.func is F.gelu and not fn.args and fn.keywords == tanh:
        return "gelu_tanh"
    try:
        from megatron.core.transformer import utils as mutils
    except ImportError:
        mutils = None
    if mutils is not None and any(fn is getattr(mutils, n, None) for n in ("openai_gelu", "gelu_impl")):
        return "gelu_tanh"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _llama3_factor(rope: Any, base: float) -> float | None:
    """The factor of megatron-core's Llama 3.1 RoPE scaling, measured on the frequencies it changed and checked by
    recomputing them all; 0 when it changed none (no head is that slow); None when they fit no factor."""
    import torch

    inv_freq = rope.inv_freq.detach().float().cpu()
    dim = 2 * inv_freq.numel()
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = 0.0
    for f, scaled in zip(reversed(plain.tolist()), reversed(inv_freq.tolist())):  # slowest first
        wavelen = 2 * math.pi / f
        if wavelen > _LLAMA3_CONTEXT / _LLAMA3_LOW:  # divided by the factor
            factor = f / scaled
        elif wavelen >= _LLAMA3_CONTEXT / _LLAMA3_HIGH:  # interpolated: scaled = f * ((1 - s) / factor + s)
            s = (_LLAMA3_CONTEXT / wavelen - _LLAMA3_LOW) / (_LLAMA3_HIGH - _LLAMA3_LOW)
            factor = (1 - s) / (scaled / f - s) if scaled / f != s else 0.0
        break
    if not factor:
        return 0.0 if torch.equal(plain, inv_freq) else None
    factor = round(factor, 4)
    return factor if torch.allclose(rope._apply_scaling(plain, factor=factor), inv_freq, rtol=1e-5) else None


def megatron_gpt_architecture(module: Any) -> dict[str, Any] | None:
    """The fields of a `ModelSpec` (format/model.py) read off a megatron-core `GPTModel` (any pipeline stage);
    None for other modules. `vocab_size` is the padded one the model was built with."""
    try:
        from megatron.core.models.gpt import GPTModel
    except ImportError:
        return None
    if not isinstance(module, GPTModel):
        return None
    c = module.config
    window = getattr(c, "window_size", None)
    unmapped: dict[str, Any] = {k: getattr(c, k) for k, v in _PLAIN_MEGATRON.items() if getattr(c, k, v) != v}
    if window is not None and window[1] != 0:
        unmapped["window_size"] = list(window)
    if c.num_moe_experts and getattr(c, "moe_router_load_balancing_type", "aux_loss") == "sinkhorn":
        unmapped["moe_router_load_balancing_type"] = "sinkhorn"  # routes by a sigmoid at inference
    rope = module.position_embedding_type in ("rope", "yarn", "mrope")
    rotary = getattr(module, "rotary_pos_emb", None) if module.position_embedding_type == "rope" else None
    factor: float | None = 0.0
    if rotary is not None:
        if getattr(rotary, "seq_len_interpolation_factor", None) is not None:
            unmapped["seq_len_interpolation_factor"] = rotary.seq_len_interpolation_factor
        if getattr(module, "rotary_scaling", False):
            factor = _llama3_factor(rotary, float(module.rotary_base))
            if factor is None:
                unmapped["rope_scaling"] = "frequencies that fit no Llama 3.1 factor"
    return {
        "num_layers": int(c.num_layers),
        "hidden_size": int(c.hidden_size),
        "ffn_hidden_size": int((c.moe_ffn_hidden_size if c.num_moe_experts else None) or c.ffn_hidden_size),
        "num_attention_heads": int(c.num_attention_heads),
        "num_query_groups": int(c.num_query_groups or c.num_attention_heads),
        "kv_channels": int(c.kv_channels),
        "vocab_size": int(module.vocab_size),
        "max_sequence_length": int(module.max_sequence_length),
        "normalization": str(c.normalization),
        "layernorm_epsilon": float(c.layernorm_epsilon),
        "activation": _activation_name(c.activation_func),
        "gated_linear_unit": bool(c.gated_linear_unit),
        "add_bias_linear": bool(c.add_bias_linear),
        "add_qkv_bias": bool(getattr(c, "add_qkv_bias", False)),
        "position_embedding_type": str(module.position_embedding_type),
        "rotary_base": float(module.rotary_base) if rope else 10000.0,
        "rotary_percent": float(module.rotary_percent) if rope else 1.0,
        "rope_scaling_factor": factor or 0.0,
        "window_size": int(window[0]) + 1 if window is not None and window[1] == 0 else 0,
        "tied": bool(module.share_embeddings_and_output_weights),
        "num_moe_experts": int(c.num_moe_experts or 0),
        "moe_router_topk": int(c.moe_router_topk) if c.num_moe_experts else 0,
        "unmapped": {k: v if isinstance(v, (bool, int, float, str, list)) else repr(v) for k, v in unmapped.items()},
    }


# --- transformers and accelerate: the two restores `install()` widens to other world sizes ------------


def trainer_rng_restore() -> tuple[Any, str] | None:
    """(owner, attribute) of the HF Trainer's per-process RNG restore (a private method); None without transformers."""
    try:
        import transformers.trainer as trainer
    except ImportError:
        return None
    return trainer.Trainer, "_load_rng_state"


def accelerate_state_restore() -> tuple[Any, str] | None:
    """(owner, attribute) of the function `Accelerator.load_state` calls by its module-level name; None without
    accelerate."""
    try:
        import accelerate.accelerator as accelerator
    except ImportError:
        return None
    return accelerator, "load_accelerator_state"


def zero3_partition_numel(p: Any) -> int:
    """How many elements of a ZeRO-3 parameter each rank's partition holds (padding included)."""
    return int(p.partition_numel())


class DcpWriter:
    """A DCP folder written one item at a time in the layout torch's `FileSystemWriter` writes (`__0_0.distcp`, each
    item a whole `torch.save` archive), `.metadata` last: the folder is a checkpoint only once that lands.

    Reaches into `torch.distributed.checkpoint`: its metadata dataclasses and `filesystem._StorageInfo`, which is what
    `FileSystemReader` expects in `storage_data`.
    """

    FILE = "__0_0.distcp"

    def __init__(self, folder: str):
        from ucp_deepspeed.io import storage as st

        self.folder, self._st = folder, st
        self._stack = contextlib.ExitStack()
        self._out = self._stack.enter_context(st.writer(st.join(folder, self.FILE)))
        self._offset = 0
        self._entries: dict[str, Any] = {}
        self._storage: dict[Any, Any] = {}
        self._paths: dict[str, tuple[Any, ...]] = {}

    def _put(self, key: str, path: tuple[Any, ...], data: bytes | memoryview, offset: Any) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        if key in self._paths:
            raise CheckpointError(self.folder, f"two entries would both be stored as {key!r}")
        self._out.write(data)
        self._storage[MetadataIndex(key, offset)] = _StorageInfo(self.FILE, self._offset, len(data))
        self._offset += len(data)
        self._paths[key] = path

    def tensor(self, key: str, path: tuple[Any, ...], value: Any, item: bytes | memoryview) -> None:
        """Add a whole tensor (`item` is its `torch.save` bytes), stored as one chunk."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

        origin = [0] * value.dim()
        self._put(key, path, item, origin)
        self._entries[key] = TensorStorageMetadata(
            TensorProperties(dtype=value.dtype),
            value.size(),
            [ChunkStorageMetadata(offsets=type(value.size())(origin), sizes=value.size())],
        )

    def object(self, key: str, path: tuple[Any, ...], item: bytes | memoryview) -> None:
        """Add any other value (`item` is its `torch.save` bytes)."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        self._put(key, path, item, None)
        self._entries[key] = BytesStorageMetadata()

    def finish(self) -> None:
        """Close the data file, then write `.metadata`."""
        import pickle

        from torch.distributed.checkpoint.metadata import Metadata

        self._stack.close()
        meta = Metadata(self._entries, planner_data=self._paths, storage_data=self._storage, version="1.0.0")
        self._st.write(self._st.join(self.folder, ".metadata"), pickle.dumps(meta))

    def abort(self) -> None:
        """Drop what was written of the data file."""
        self._stack.__exit__(CheckpointError, CheckpointError(self.folder, "export abandoned"), None)
