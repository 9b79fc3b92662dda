"""The top-level entries DeepSpeed itself writes into a model-states file; anything else is client_state.

One list for every reader (metadata inference, DeepSpeed-universal import), checked against what
`DeepSpeedEngine._save_checkpoint` writes by `tests/test_compat.py`.
"""

from __future__ import annotations

DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
        "ep_world_size",
        "moe_world_size",
        "ds_autotp_universal_checkpoint_info",
        # a MoE model's (`_save_moe_checkpoint`): expert counts per layer, AutoEP's placement, AutoEP x AutoTP folding
        "num_experts",
        "ds_autoep_layers",
        "folding",
    }
)

OPTIMIZER_WRAPPER_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")
"""The loss-scaler and clipping state DeepSpeed's optimizer wrappers keep as attributes and save beside the
partitions: carried as the universal format's `optimizer_wrapper`."""
