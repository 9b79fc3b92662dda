"""Which embedding rows changed since the last checkpoint, recorded as they are looked up.

A forward pre-hook on each tracked `nn.Embedding` / `nn.EmbeddingBag` sets one flag per looked-up
row, on the device, so the cost is one indexed store per lookup with no wait for the device, and nothing
scans a table at save time. At save
the flags of all ranks are OR-ed together with one all-reduce of a byte per row.

A row that is not looked up gets a zero gradient. Under plain SGD or Adagrad without weight decay
a zero gradient leaves the row and its optimizer state exactly as they were, so "looked up" is
exactly "changed". Momentum, Adam or weight decay keep changing rows that were not looked up;
`check_optimizer` refuses those, because a differential checkpoint of them would silently lose updates.
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ucp_deepspeed import compat


def find_tables(module: torch.nn.Module, patterns: list[str] | None) -> dict[str, torch.nn.Module]:
    """Embedding modules to track, by module name: all of them, or those matching one of `patterns`."""
    found: dict[str, torch.nn.Module] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            if patterns is None or any(re.fullmatch(p, name) for p in patterns):
                found[name] = sub
    return found


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizer settings under which rows that were not looked up still change.

    DeepSpeed hands the base optimizer flat partitions that mix tables with dense parameters, so
    every param group must qualify.
    """
    kind = type(optimizer).__name__
    for group in optimizer.param_groups:
        decay = group.get("weight_decay", 0)
        if decay == 0 and (kind == "Adagrad" or (kind == "SGD" and group.get("momentum", 0) == 0)):
            continue
        settings = {k: v for k, v in group.items() if k in ("momentum", "weight_decay", "betas")}
        raise NotImplementedError(
            "differential checkpoints need an optimizer that leaves rows without gradient unchanged (SGD without "
            f"momentum, or Adagrad, both without weight decay); got {kind} with {settings}"
        )


class RowTracker:
    """Flags of looked-up rows per table since the last `take()`."""

    def __init__(self, tables: dict[str, torch.nn.Module]) -> None:
        self.tables = tables
        # on the device the lookups run on: setting a flag is then one kernel, with no copy of the ids to the host
        # and no wait for the device on every forward
        device = get_accelerator().current_device_name()
        self.flags = {
            name: torch.zeros(compat.full_shape(m.weight)[0], dtype=torch.bool, device=device)
            for name, m in tables.items()
        }
        self._hooks = [m.register_forward_pre_hook(self._hook(name)) for name, m in tables.items()]
        self.seconds = 0.0
        """Time spent flagging rows, so its overhead per step can be reported."""

    def _hook(self, name: str) -> Any:
        flags = self.flags[name]

        def mark(module: torch.nn.Module, inputs: tuple) -> None:
            start = time.perf_counter()
            flags[inputs[0].reshape(-1).to(flags.device)] = True
            self.seconds += time.perf_counter() - start

        return mark

    def take(self) -> dict[str, torch.Tensor]:
        """The rows looked up on any rank since the last call, per table (collective); the flags restart."""
        out = {}
        for name, flags in self.flags.items():
            merged = flags.to(dtype=torch.uint8)
            if dist.is_initialized():
                dist.all_reduce(merged, op=dist.ReduceOp.MAX)
            out[name] = merged.cpu().bool()
            flags.zero_()
        return out

    def remove(self) -> None:
        """Stop tracking."""
        for hook in self._hooks:
            hook.remove()


def rows_of(flags: torch.Tensor) -> torch.Tensor:
    """Row indices set in a flag vector."""
    return flags.nonzero().reshape(-1)
