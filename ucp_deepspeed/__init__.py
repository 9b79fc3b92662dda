"""Universal Checkpointing for DeepSpeed: save distributed, resume on any DP/TP/PP size or ZeRO stage.

The engine-side entry points import DeepSpeed; they load on first use, so the `ucp` command
(conversion, inspection) stays light enough to run on a laptop without initialising DeepSpeed.
"""

from __future__ import annotations

import importlib
from typing import Any

# extensions register their tag kinds, config sections, savers and foreign formats on import
from ucp_deepspeed import checkn_run, interop  # noqa: F401  (registration only)
from ucp_deepspeed.convert import convert
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.universal import UniversalCheckpoint
from ucp_deepspeed.version import __version__

_LAZY = {
    "initialize": "ucp_deepspeed.runtime.engine",
    "attach": "ucp_deepspeed.runtime.engine",
    "LoadReport": "ucp_deepspeed.runtime.engine",
    "UniversalConfig": "ucp_deepspeed.runtime.config",
    "install": "ucp_deepspeed.runtime.integrations",
    "uninstall": "ucp_deepspeed.runtime.integrations",
}

__all__ = [
    "CheckpointError",
    "LoadReport",
    "UniversalCheckpoint",
    "UniversalConfig",
    "__version__",
    "attach",
    "convert",
    "initialize",
    "install",
    "uninstall",
]


def __getattr__(name: str) -> Any:
    """Import the DeepSpeed-dependent entry points when first used."""
    if name not in _LAZY:
        raise AttributeError(f"module 'ucp_deepspeed' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
