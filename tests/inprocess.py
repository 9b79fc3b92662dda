"""Real DeepSpeed engines in the pytest process (one rank, gloo): builders, training steps and whole-state snapshots.

What a one-rank test can show without a launch: a refused load leaves every state as it was, a checkpoint engine
writes files a later load accepts, and so on. Every rank of a larger world, one after another in this process:
`tests/fakeworld.py`.
"""

from __future__ import annotations

import os
from typing import Any

import torch


class Net(torch.nn.Module):
    """An embedding table, a layer norm, a frozen projection and a buffer: every kind of state a restore writes."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(64, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 3)
        self.frozen = torch.nn.Linear(3, 1)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.head(self.norm(self.table(ids))) * self.scale).pow(2).mean()


def one_rank() -> None:
    """A one-rank gloo process group in this process, as `deepspeed.initialize` needs one (idempotent)."""
    import torch.distributed as dist

    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)


def build(
    stage: int, seed: int = 0, adagrad: bool = False, universal: dict[str, Any] | None = None, **checkpoint: Any
) -> Any:
    """An engine of `Net` at a ZeRO stage; `universal` options, and `checkpoint` entries beside them (DeepSpeed's own,
    or Check-N-Run's sections)."""
    import ucp_deepspeed

    torch.manual_seed(seed)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "checkpoint": {"universal": {"enabled": True, "progress": False, **(universal or {})}, **checkpoint},
    }
    groups = [
        {"params": [model.table.weight, model.head.weight], "weight_decay": 0.0 if adagrad else 0.1},
        {"params": [model.norm.weight, model.norm.bias, model.head.bias], "weight_decay": 0.0},
    ]
    # Check-N-Run needs an optimizer that leaves rows without gradient as they were; torch's Adagrad makes its state
    # when built, which ZeRO-1/2's partitioning of a second group trips over
    # the table last, so that a restore has read every other parameter when it reaches a damaged table
    trainable = [model.norm.weight, model.norm.bias, model.head.weight, model.head.bias, model.table.weight]
    optimizer = torch.optim.Adagrad(trainable, lr=0.01) if adagrad else torch.optim.AdamW(groups, lr=0.01)
    return ucp_deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def train(engine: Any, steps: int, offset: int = 0) -> None:
    for step in range(offset, offset + steps):
        ids = torch.tensor([[step % 64, (7 * step + 3) % 64], [(5 * step + 1) % 64, (11 * step) % 64]])
        engine.backward(engine(ids))
        engine.step()


def _copy(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def state(engine: Any) -> dict[str, Any]:
    """Everything a load may write, copied."""
    return _copy(
        {
            "module": dict(engine.module.state_dict()),
            "optimizer": engine.optimizer.state_dict(),
            "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps),
            "scheduler": engine.lr_scheduler.state_dict(),
        }
    )


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}" for k in set(a) ^ set(b)]
        return out + [d for k in set(a) & set(b) for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if type(a).__module__.startswith("deepspeed"):  # a loss scaler or other DeepSpeed object: compare its fields
        return differences(vars(a), vars(b), where) if type(a) is type(b) else [where]
    return [] if a == b else [where]
