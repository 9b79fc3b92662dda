"""What the package uses of a DeepSpeed engine, as a `Protocol`, so every layer type-checks against it without
importing DeepSpeed (which the `ucp` command never loads).

`DeepSpeedEngine` and `PipelineEngine` satisfy it; so does a test's stand-in that has these members. The private
members at the end are reached only from `compat` (tests/test_architecture.py keeps it that way), where a DeepSpeed
upgrade that moves one fails a canary by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class Engine(Protocol):
    """The members of a DeepSpeed engine that ucp_deepspeed reads, calls or (at `attach`) replaces."""

    module: torch.nn.Module
    optimizer: Any
    """The ZeRO optimizer (or DeepSpeed's wrapper of a torch optimizer); `compat` reaches into it."""
    lr_scheduler: Any
    checkpoint_engine: Any
    global_steps: int
    global_samples: int
    skipped_steps: int
    global_rank: int
    local_rank: int
    dp_world_size: int
    seq_dp_world_size: int
    seq_data_parallel_group: Any
    data_parallel_group: Any
    checkpoint_mp_rank: int
    # replaced by `attach` with the checkpointer's own, so attributes rather than methods here
    save_checkpoint: Callable[..., Any]
    load_checkpoint: Callable[..., Any]
    wait_for_checkpoint: Callable[..., Any]
    # set by `attach`
    ucp: Any
    ucp_last_load: Any

    def zero_optimization_stage(self) -> int: ...
    def zero_optimization(self) -> bool: ...
    def zero_elastic_checkpoint(self) -> bool: ...
    def bfloat16_enabled(self) -> bool: ...
    def fp16_enabled(self) -> bool: ...
    def zero_nvme_offload_optimizer(self) -> bool: ...
    def zero_offload_param(self) -> Any: ...
    def use_node_local_storage(self) -> bool: ...
    def curriculum_learning_enabled(self) -> bool: ...
    def train_batch_size(self) -> int: ...
    def load_universal_checkpoint(self) -> bool: ...
    def step(self, *args: Any, **kwargs: Any) -> Any: ...

    # DeepSpeed's internals, for `compat` alone (the two it wraps are attributes, as for `attach`)
    _config: Any
    _copy_recovery_script: Callable[[str], None]
    _take_model_step: Callable[..., Any]

    def _commit_decoupled_checkpoint(self) -> Any: ...
    def _get_buffer_names(self) -> list[str]: ...
    def _get_zero_ckpt_name(self, checkpoints_path: str, tag: str) -> str: ...
    def _get_ckpt_name(self, checkpoints_path: str, tag: str) -> str: ...
