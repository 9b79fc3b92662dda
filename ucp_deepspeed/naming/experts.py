"""Experts by global id: each expert-parallel rank numbers its local experts from 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ucp_deepspeed import compat


@dataclass(frozen=True)
class ExpertBlock:
    """The local experts of one DeepSpeed MoE layer: `prefix<i>.` is local expert i."""

    prefix: str
    num_local: int
    group: str

    def expert_of(self, name: str) -> int | None:
        """Local expert index of a parameter name, or None if the name is not in this block."""
        if not name.startswith(self.prefix):
            return None
        head = name[len(self.prefix) :].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def rename(self, name: str, ep_rank: int) -> str:
        """The name of local expert parameter `name` as held by expert-parallel rank `ep_rank`, by global id."""
        local = self.expert_of(name)
        if local is None:
            raise ValueError(f"{name} is not an expert of {self.prefix}")
        rest = name[len(self.prefix) + len(str(local)) :]
        return f"{self.prefix}{ep_rank * self.num_local + local}{rest}"


def expert_blocks(module: torch.nn.Module) -> list[ExpertBlock]:
    """The experts of every MoE layer, whose local ids restart on each expert-parallel rank.

    DeepSpeed's `MoE` keeps them in `deepspeed_moe.experts.deepspeed_experts.<i>`, megatron-core's
    `MoELayer` (SequentialMLP) in `experts.local_experts.<i>`; both carry `num_local_experts` and,
    once registered with DeepSpeed, `expert_group_name`.
    """
    out = []
    for path, sub in module.named_modules():
        found = compat.expert_container(sub)
        if found is not None:
            prefix = f"{path}.{found.path}" if path else found.path
            out.append(ExpertBlock(prefix=prefix, num_local=found.num_local, group=found.group))
    return out
