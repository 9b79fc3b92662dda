"""How each optimizer implementation keeps its algorithm's state: torch's optimizers and DeepSpeed's kernels (fused
and CPU Adam, Adagrad, Lion), recognised by class name and their own switches (`adam_w_mode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
