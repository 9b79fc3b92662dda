"""Universal Checkpointing for DeepSpeed: save distributed, resume on any DP/TP/PP size or ZeRO stage.

The engine-side entry points import DeepSpeed; they load on first use, so the `ucp` command
(conversion, inspection) stays light enough to run on a laptop without initialising DeepSpeed.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from ucp_deepspeed.convert import convert  # noqa: E402  (after __version__, which convert imports)
from ucp_deepspeed.errors import CheckpointError  # noqa: E402
from ucp_deepspeed.universal import UniversalCheckpoint  # noqa: E402

_LAZY = {"initialize": "ucp_deepspeed.engine", "attach": "ucp_deepspeed.engine", "UniversalConfig": "ucp_deepspeed.config",
         "install": "ucp_deepspeed.integrations", "uninstall": "ucp_deepspeed.integrations"}

__all__ = ["initialize", "attach", "install", "uninstall", "convert", "UniversalCheckpoint", "UniversalConfig", "CheckpointError",
           "__version__"]


def __getattr__(name: str) -> Any:
    """Import the DeepSpeed-dependent entry points when first used."""
    if name not in _LAZY:
        raise AttributeError(f"module 'ucp_deepspeed' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
