"""Every reach into DeepSpeed, megatron-core, transformers, accelerate, torch's DCP and s3fs internals, each behind one
small named function, one module per library reached into.

The rest of the package reads and writes framework state only through here (`from ucp_deepspeed import compat;
compat.x(...)`): private optimizer attributes (flat groups, `_hp_mapping`, ZeRO-3 sub-groups), `ds_*` parameter
attributes, engine privates, DeepSpeed's expert-group registries and its MoE type check, megatron-core's
tensor-parallel attributes, and the classes DeepSpeed pickles. `tests/test_compat.py` has a one-process canary per
function: an upgrade that moves one of these fails there by name, not inside a multi-rank reshard test. The
frameworks are imported inside the functions that need them, so the `ucp` command imports none of them. The modules
here are imported at their first name's first use (`__getattr__`): `io` imports `compat.s3fs`, which imports nothing
of this package, without the modules that import `io`.

- `deepspeed`: engines, the classes DeepSpeed pickles, Ulysses and pipeline layout, expert groups, AutoTP and AutoEP
- `zero`: ZeRO-1/2/3 optimizers: flat partitions, the piece of each parameter a rank owns, NVMe swapping
- `optimizers`: how torch's optimizers and DeepSpeed's kernels keep their algorithm's state
- `megatron`: megatron-core modules, their tensor-parallel attributes, a GPTModel's architecture
- `transformers`: transformers and accelerate: a model's config, the per-process restores `install()` widens
- `torch`: the globals `torch.load` may build, the DCP writer, shared storages, `torch.save`'s CRC switch
- `torchdata`: where a `StatefulDataLoader`'s state keeps a map-style loader's position
- `torchrec`: a `DistributedModelParallel` model's plan, table shards, fused optimizer state and sparse modules
- `s3fs`: a ranged GET received straight into the caller's buffers
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker reads; at runtime `__getattr__` imports each name's module at its first use
    from ucp_deepspeed.compat.deepspeed import (
        ZERO_STAGE_ENUM,
        ExpertContainer,
        ExpertParallel,
        ExpertStack,
        LayerFile,
        Writes,
        autoep_groups,
        autoep_stack,
        autotp_meta,
        base_optimizer,
        before_model_step,
        buffer_names,
        check_sampler,
        checkpoint_writes,
        commit_decoupled_checkpoint,
        data_parallel_rank,
        data_place,
        data_sampler,
        deepspeed_safe_globals,
        deepspeed_sees_megatron_moe,
        engine_config,
        expert_container,
        expert_parallel,
        is_autotp_model,
        is_ulysses_mpu,
        is_unpartitioned,
        native_load_files,
        pipeline_layer_files,
        rebuild,
        recorded_sample_copies,
        register_expert_groups,
        restore_sampler,
        sample_copies,
        sampler_rng,
        sequence_parallel_size,
        store_recovery_scripts,
        trains,
        ulysses_outside_zero,
        written_suffix,
        zero_world_size,
    )
    from ucp_deepspeed.compat.lightning import lightning_deepspeed_strategy, run_ended_normally, strategy_engine
    from ucp_deepspeed.compat.megatron import (
        GroupedExperts,
        MegatronSplit,
        is_megatron_module,
        is_megatron_moe,
        is_megatron_transformer_layer,
        megatron_fused_norms,
        megatron_gpt_architecture,
        megatron_grouped_experts,
        megatron_layer_number,
        megatron_split,
        megatron_tied_output_stage,
    )
    from ucp_deepspeed.compat.optimizers import (
        Kernel,
        StepCount,
        optimizer_kernel,
        scalar_device,
    )
    from ucp_deepspeed.compat.s3fs import s3_read_into
    from ucp_deepspeed.compat.torch import (
        DcpWriter,
        crcs_left_to_us,
        open_shared_storage,
        share_storage,
        user_safe_globals,
    )
    from ucp_deepspeed.compat.torchdata import (
        distributed_sampler,
        is_stateful_loader,
        loader_name,
        samples_taken,
        state_at,
        state_workers,
    )
    from ucp_deepspeed.compat.torchrec import (
        dense_device,
        dense_optimizers,
        dmp_fused_lrs,
        dmp_fused_states,
        dmp_local_weights,
        dmp_sparse_modules,
        dmp_tables,
        is_2d_dmp,
        is_dmp,
        kjt_ids,
        row_state_place,
        set_dmp_fused_lrs,
        torchrec_version,
    )
    from ucp_deepspeed.compat.transformers import (
        Hook,
        accelerate_state_restore,
        hf_model_config,
        trainer_rng_restore,
    )
    from ucp_deepspeed.compat.zero import (
        FlatGroup,
        NvmeSwap,
        OwnedFragment,
        OwnedState,
        SubGroup,
        Zero3Partition,
        Zero3Position,
        full_shape,
        group_order,
        is_bf16_optimizer,
        is_zero3_param,
        nvme_offload,
        nvme_param_offload,
        nvme_swap,
        owned_fragments,
        relink_optimizer_states,
        storage_dtype,
        update_lp_params,
        zero3_fragment,
        zero3_partition,
        zero3_partition_numel,
        zero3_position,
        zero3_regather,
        zero3_resident,
        zero3_subgroups,
        zero12_fragment,
        zero12_groups,
    )

__all__ = [
    "ZERO_STAGE_ENUM",
    "DcpWriter",
    "ExpertContainer",
    "ExpertParallel",
    "ExpertStack",
    "FlatGroup",
    "GroupedExperts",
    "Hook",
    "Kernel",
    "LayerFile",
    "MegatronSplit",
    "NvmeSwap",
    "OwnedFragment",
    "OwnedState",
    "StepCount",
    "SubGroup",
    "Writes",
    "Zero3Partition",
    "Zero3Position",
    "accelerate_state_restore",
    "autoep_groups",
    "autoep_stack",
    "autotp_meta",
    "base_optimizer",
    "before_model_step",
    "buffer_names",
    "check_sampler",
    "checkpoint_writes",
    "commit_decoupled_checkpoint",
    "crcs_left_to_us",
    "data_parallel_rank",
    "data_place",
    "data_sampler",
    "deepspeed_safe_globals",
    "deepspeed_sees_megatron_moe",
    "dense_device",
    "dense_optimizers",
    "distributed_sampler",
    "dmp_fused_lrs",
    "dmp_fused_states",
    "dmp_local_weights",
    "dmp_sparse_modules",
    "dmp_tables",
    "engine_config",
    "expert_container",
    "expert_parallel",
    "full_shape",
    "group_order",
    "hf_model_config",
    "is_2d_dmp",
    "is_autotp_model",
    "is_bf16_optimizer",
    "is_dmp",
    "is_megatron_module",
    "is_megatron_moe",
    "is_megatron_transformer_layer",
    "is_stateful_loader",
    "is_ulysses_mpu",
    "is_unpartitioned",
    "is_zero3_param",
    "kjt_ids",
    "lightning_deepspeed_strategy",
    "loader_name",
    "megatron_fused_norms",
    "megatron_gpt_architecture",
    "megatron_grouped_experts",
    "megatron_layer_number",
    "megatron_split",
    "megatron_tied_output_stage",
    "native_load_files",
    "nvme_offload",
    "nvme_param_offload",
    "nvme_swap",
    "open_shared_storage",
    "optimizer_kernel",
    "owned_fragments",
    "pipeline_layer_files",
    "rebuild",
    "recorded_sample_copies",
    "register_expert_groups",
    "relink_optimizer_states",
    "restore_sampler",
    "row_state_place",
    "run_ended_normally",
    "s3_read_into",
    "sample_copies",
    "sampler_rng",
    "samples_taken",
    "scalar_device",
    "sequence_parallel_size",
    "set_dmp_fused_lrs",
    "share_storage",
    "state_at",
    "state_workers",
    "storage_dtype",
    "store_recovery_scripts",
    "strategy_engine",
    "torchrec_version",
    "trainer_rng_restore",
    "trains",
    "ulysses_outside_zero",
    "update_lp_params",
    "user_safe_globals",
    "written_suffix",
    "zero3_fragment",
    "zero3_partition",
    "zero3_partition_numel",
    "zero3_position",
    "zero3_regather",
    "zero3_resident",
    "zero3_subgroups",
    "zero12_fragment",
    "zero12_groups",
    "zero_world_size",
]

_MODULES = (
    "deepspeed",
    "lightning",
    "megatron",
    "optimizers",
    "s3fs",
    "torch",
    "torchdata",
    "torchrec",
    "transformers",
    "zero",
)


def __getattr__(name: str) -> Any:
    """A name of `__all__`, from its module, imported at first use (PEP 562): importing one module of this package
    (`io.remote` imports `compat.s3fs`) imports none of the others, so the storage layer below, which they use,
    never imports itself back through here."""
    if name in __all__:
        for module in _MODULES:
            found = vars(importlib.import_module(f"{__name__}.{module}"))
            if name in found:
                globals()[name] = found[name]
                return found[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
