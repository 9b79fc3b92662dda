"""Universal Checkpointing for DeepSpeed: save distributed, resume on any DP/TP/PP size or ZeRO stage.

The engine-side entry points import DeepSpeed; they load on first use, so the `ucp` command
(conversion, inspection) stays light enough to run on a laptop without initialising DeepSpeed.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# extensions register their tag kinds, config sections, savers and foreign formats on import
from ucp_deepspeed import checkn_run, interop  # noqa: F401  (registration only)
from ucp_deepspeed.convert import convert as convert
from ucp_deepspeed.errors import CheckpointError as CheckpointError
from ucp_deepspeed.format.universal import UniversalCheckpoint as UniversalCheckpoint
from ucp_deepspeed.version import __version__ as __version__

# The public surface, in one place (docs/reference/api.md): each name, and the module that defines it. The
# engine-side ones load DeepSpeed, so they are imported on first use.
_LAZY = {
    "initialize": "ucp_deepspeed.runtime.engine",
    "attach": "ucp_deepspeed.runtime.engine",
    "LoadMode": "ucp_deepspeed.runtime.planning",
    "LoadReport": "ucp_deepspeed.runtime.planning",
    "UniversalCheckpointer": "ucp_deepspeed.runtime.checkpointer",
    "UniversalConfig": "ucp_deepspeed.runtime.config",
    "install": "ucp_deepspeed.runtime.integrations",
    "uninstall": "ucp_deepspeed.runtime.integrations",
    "MegatronMpu": "ucp_deepspeed.runtime.mpu",
    "register_megatron_experts": "ucp_deepspeed.runtime.mpu",
    "megatron_kwargs": "ucp_deepspeed.hf.models",
    "resume_tag": "ucp_deepspeed.sources.tags",
    "prune": "ucp_deepspeed.sources.tags",
}

# the eager names above and the lazy ones: the whole public surface, declared once
__all__ = sorted(["CheckpointError", "UniversalCheckpoint", "__version__", "convert", *_LAZY])


def __getattr__(name: str) -> Any:
    """Import the DeepSpeed-dependent entry points when first used."""
    if name not in _LAZY:
        raise AttributeError(f"module 'ucp_deepspeed' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def _moved(old_module: str, names: tuple[str, ...]) -> Any:
    """A module `__getattr__` for an old import path: each name still resolves, with a DeprecationWarning naming
    where it lives now (kept for one release)."""

    def getattr_(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warnings.warn(
            f"{old_module}.{name} moved; import it as ucp_deepspeed.{name} ({old_module} goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return __getattr__(name)

    return getattr_
