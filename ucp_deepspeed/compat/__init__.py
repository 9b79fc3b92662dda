"""Every reach into DeepSpeed, megatron-core, transformers, accelerate, torch's DCP and s3fs internals, each behind one
small named function, one module per library reached into.

The rest of the package reads and writes framework state only through here (`from ucp_deepspeed import compat;
compat.x(...)`): private optimizer attributes (flat groups, `_hp_mapping`, ZeRO-3 sub-groups), `ds_*` parameter
attributes, engine privates, DeepSpeed's expert-group registries and its MoE type check, megatron-core's
tensor-parallel attributes, and the classes DeepSpeed pickles. `tests/test_compat.py` has a one-process canary per
function: an upgrade that moves one of these fails there by name, not inside a multi-rank reshard test. The
frameworks are imported inside the functions that need them, so the `ucp` command imports none of them.

- `deepspeed`: engines, the classes DeepSpeed pickles, Ulysses and pipeline layout, expert groups, AutoTP and AutoEP
- `zero`: ZeRO-1/2/3 optimizers: flat partitions, the piece of each parameter a rank owns, NVMe swapping
- `optimizers`: how torch's optimizers and DeepSpeed's kernels keep their algorithm's state
- `megatron`: megatron-core modules, their tensor-parallel attributes, a GPTModel's architecture
- `transformers`: transformers and accelerate: a model's config, the per-process restores `install()` widens
- `torch`: the globals `torch.load` may build, and the DCP writer
- `s3fs`: a ranged GET received straight into the caller's buffers
"""

from __future__ import annotations

from ucp_deepspeed.compat.deepspeed import (
    ZERO_STAGE_ENUM,
    ExpertContainer,
    ExpertParallel,
    ExpertStack,
    LayerFile,
    autoep_groups,
    autoep_stack,
    autotp_meta,
    base_optimizer,
    before_model_step,
    buffer_names,
    commit_decoupled_checkpoint,
    data_parallel_rank,
    deepspeed_safe_globals,
    deepspeed_sees_megatron_moe,
    engine_config,
    expert_container,
    expert_parallel,
    is_autotp_model,
    is_ulysses_mpu,
    is_unpartitioned,
    pipeline_layer_files,
    rebuild,
    register_expert_groups,
    sequence_parallel_size,
    store_recovery_scripts,
    ulysses_outside_zero,
    zero_world_size,
)
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
    user_safe_globals,
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
    "Zero3Partition",
    "Zero3Position",
    "accelerate_state_restore",
    "autoep_groups",
    "autoep_stack",
    "autotp_meta",
    "base_optimizer",
    "before_model_step",
    "buffer_names",
    "commit_decoupled_checkpoint",
    "data_parallel_rank",
    "deepspeed_safe_globals",
    "deepspeed_sees_megatron_moe",
    "engine_config",
    "expert_container",
    "expert_parallel",
    "full_shape",
    "hf_model_config",
    "is_autotp_model",
    "is_bf16_optimizer",
    "is_megatron_module",
    "is_megatron_moe",
    "is_megatron_transformer_layer",
    "is_ulysses_mpu",
    "is_unpartitioned",
    "is_zero3_param",
    "megatron_fused_norms",
    "megatron_gpt_architecture",
    "megatron_grouped_experts",
    "megatron_layer_number",
    "megatron_split",
    "megatron_tied_output_stage",
    "nvme_offload",
    "nvme_param_offload",
    "nvme_swap",
    "optimizer_kernel",
    "owned_fragments",
    "pipeline_layer_files",
    "rebuild",
    "register_expert_groups",
    "relink_optimizer_states",
    "s3_read_into",
    "scalar_device",
    "sequence_parallel_size",
    "storage_dtype",
    "store_recovery_scripts",
    "trainer_rng_restore",
    "ulysses_outside_zero",
    "update_lp_params",
    "user_safe_globals",
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
