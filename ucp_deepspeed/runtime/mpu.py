"""DeepSpeed's `mpu` interface on top of megatron-core's `parallel_state`.

DeepSpeed asks an `mpu` for "model parallel" and "data parallel" groups; megatron-core names its
groups differently and has no such object. DeepSpeed uses the model-parallel rank to name checkpoint
files and the model-parallel group to reduce gradient norms, so here "model parallel" is the whole
tensor x pipeline group (unique file names per stage, norms summed over every stage). The
tensor-parallel rank, which DeepSpeed uses to count replicated parameters once, comes from
`get_tensor_model_parallel_rank`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ucp_deepspeed import compat


def megatron_initialized() -> bool:
    """Whether megatron-core is imported and its model-parallel state is set up."""
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps is not None and ps.model_parallel_is_initialized()


class MegatronMpu:
    """Adapter from megatron-core's parallel_state to the names DeepSpeed calls."""

    def __init__(self) -> None:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "call megatron.core.parallel_state.initialize_model_parallel() before ucp_deepspeed.initialize"
            )
        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:
            # DeepSpeed would reduce gradients over the data-parallel group alone, leaving the context-parallel
            # ranks' halves of each sequence unsummed, and those ranks would write files of the same names
            raise NotImplementedError(
                f"megatron-core context parallelism (context_parallel_size={cp}) is not supported under DeepSpeed: "
                "its data-parallel group leaves out the context-parallel ranks, so their gradients would never be "
                "reduced together; train with context_parallel_size=1"
            )
        self.ps = parallel_state

    def get_model_parallel_group(self) -> Any:
        """Tensor x pipeline group of this rank."""
        return self.ps.get_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        """Ranks holding distinct parts of one model replica."""
        return dist.get_world_size(group=self.get_model_parallel_group())

    def get_model_parallel_rank(self) -> int:
        """Position in the model-parallel group: pipeline stage * tp + tensor rank."""
        return (
            self.get_pipeline_model_parallel_rank() * self.get_tensor_model_parallel_world_size()
            + self.get_tensor_model_parallel_rank()
        )

    def get_tensor_model_parallel_group(self) -> Any:
        """Tensor-parallel group."""
        return self.ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_world_size(self) -> int:
        """Tensor-parallel size."""
        return self.ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self) -> int:
        """Tensor-parallel rank."""
        return self.ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of tensor-parallel rank 0 in this rank's group."""
        return self.ps.get_tensor_model_parallel_src_rank()

    def get_pipeline_model_parallel_group(self) -> Any:
        """Pipeline group."""
        return self.ps.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_world_size(self) -> int:
        """Number of pipeline stages."""
        return self.ps.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.ps.get_pipeline_model_parallel_rank()

    def get_data_parallel_group(self) -> Any:
        """Data-parallel group (the ZeRO partitioning group)."""
        return self.ps.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        """Data-parallel size."""
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        """Data-parallel rank."""
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_group_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group."""
        return dist.get_process_group_ranks(self.get_data_parallel_group())


def megatron_moe_layers(model: Any) -> list[Any]:
    """megatron-core MoE layers (`MoELayer`) in a model."""
    return [m for m in model.modules() if compat.is_megatron_moe(m)]


def register_megatron_experts(model: Any) -> str | None:
    """Make megatron-core experts DeepSpeed MoE parameters; call before building optimizer param groups.

    DeepSpeed partitions and reduces a parameter over an expert-data-parallel group when it is
    marked `allreduce=False` (megatron-core does that) and names its group in `group_name`. Here that
    group is megatron-core's own expert-parallel / expert-data-parallel pair, registered with
    DeepSpeed under `ep_size_<N>` (DeepSpeed reads the size from the name). Returns the group name,
    or None when the model has no MoE layer. Then split the param groups with DeepSpeed's
    `split_params_into_different_moe_groups_for_optimizer`.
    """
    layers = megatron_moe_layers(model)
    if not layers:
        return None
    from megatron.core import parallel_state as ps

    name = f"ep_size_{ps.get_expert_model_parallel_world_size()}"
    compat.register_expert_groups(name, ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_group())
    for layer in layers:
        layer.num_experts = layer.config.num_moe_experts
        layer.expert_group_name = name
        for p in layer.experts.parameters():
            p.allreduce = False  # megatron-core sets it only when expert parallelism is on
            p.group_name = name
    return name


@contextlib.contextmanager
def megatron_moe_visible(model: Any) -> Iterator[None]:
    """While an engine is built, let DeepSpeed count megatron-core MoE layers as MoE layers.

    DeepSpeed decides `has_moe_layers` (and so whether ZeRO uses expert-data-parallel groups) with
    `isinstance(module, deepspeed.moe.layer.MoE)` in its engine module. Only that lookup is widened,
    only while `deepspeed.initialize` runs.
    """
    if register_megatron_experts(model) is None:
        yield
        return
    with compat.deepspeed_sees_megatron_moe():
        yield
