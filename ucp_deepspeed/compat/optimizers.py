"""How each optimizer implementation keeps its algorithm's state: torch's optimizers and DeepSpeed's kernels (fused
and CPU Adam, Adagrad, Lion), recognised by class name and their own switches (`adam_w_mode`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class StepCount(enum.Enum):
    """How an optimizer kernel counts its steps, which decides how a saved count is restored into it."""

    TENSOR = "tensor"
    """torch's: a scalar tensor per parameter."""
    INT = "int"
    """DeepSpeed's kernels: a Python int per group."""
    NONE = "none"
    """SGD: no count."""
    AS_SAVED = "as_saved"
    """A class outside torch and the table: the saved value is restored as it is."""


@dataclass(frozen=True)
class Kernel:
    """How one optimizer class keeps the state of its algorithm.

    `algorithm` names the update rule (`adam`, `adamw`, `adagrad`, `lion`, `sgd`; another class's own name);
    `step` is how it counts steps. `states` maps its state names to the algorithm's (torch's: `exp_avg`, `exp_avg_sq`,
    `max_exp_avg_sq`, `sum`, `momentum_buffer`) where they differ.
    """

    qualname: str
    algorithm: str
    step: StepCount
    states: dict[str, str]


def optimizer_kernel(opt: Any) -> Kernel:
    """The kernel of a base optimizer (what DeepSpeed's ZeRO wrapper steps)."""
    cls = type(opt)
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    decoupled = bool(getattr(opt, "adam_w_mode", getattr(opt, "adamw_mode", True)))
    groups = getattr(opt, "param_groups", None) or [{}]
    table = {
        "torch.optim.adamw.AdamW": ("adamw", StepCount.TENSOR, {}),
        "torch.optim.adam.Adam": (
            "adamw" if any(g.get("decoupled_weight_decay") for g in groups) else "adam",
            StepCount.TENSOR,
            {},
        ),
        "deepspeed.ops.adam.fused_adam.FusedAdam": ("adamw" if decoupled else "adam", StepCount.INT, {}),
        "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam": ("adamw" if decoupled else "adam", StepCount.INT, {}),
        "torch.optim.adagrad.Adagrad": ("adagrad", StepCount.TENSOR, {}),
        "deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad": ("adagrad", StepCount.INT, {"exp_avg_sq": "sum"}),
        "deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion": ("lion", StepCount.INT, {}),
        "deepspeed.ops.lion.fused_lion.FusedLion": ("lion", StepCount.INT, {}),
        "torch.optim.sgd.SGD": ("sgd", StepCount.NONE, {}),
    }
    # torch's other optimizers keep per-parameter tensor steps too; another library's are left as saved
    other: tuple[str, StepCount, dict[str, str]] = (
        cls.__name__,
        StepCount.TENSOR if qualname.startswith("torch.optim.") else StepCount.AS_SAVED,
        {},
    )
    algorithm, step, states = table.get(qualname, other)
    return Kernel(qualname=qualname, algorithm=algorithm, step=step, states=states)


def scalar_device(group: dict[str, Any], flat: Any) -> Any:
    """Where torch keeps a group's `step` tensors: on the parameters' device for its capturable and fused
    kernels, else on the CPU."""
    import torch

    return flat.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
