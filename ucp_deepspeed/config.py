"""The `"checkpoint": {"universal": ...}` section of ds_config, validated in DeepSpeed's style."""
from __future__ import annotations

import copy
import json
from typing import Any

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import ConfigDict, Field, ValidationError, field_validator

from ucp_deepspeed.patterns import parse_rules


class UniversalConfig(DeepSpeedConfigModel):
    """Options of universal checkpointing; `"universal": true` is short for `{"enabled": true}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Save ucp metadata and reshard on load when the topology changed."""
    workers: int = Field(1, ge=1)
    """Writer threads per rank during conversion."""
    output: str | None = None
    """Folder for converted copies (`<output>/<tag>`); default `<checkpoint dir>/<tag>.universal`."""
    keep: bool = True
    """Keep the converted copy after loading, so the next reshard of the same tag skips conversion."""
    verify: bool = True
    """Check the crc32 of every file of a converted copy before reusing it."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0 during conversion."""
    async_save: bool = False
    """Write checkpoint files in a background thread: `save_checkpoint` returns once the state is in host memory."""
    vocab_size: int = Field(0, ge=0)
    """Unpadded vocabulary size: vocab-parallel embedding/output rows beyond it are padding, dropped on conversion."""
    layout_rules: str | list[dict[str, Any]] | None = None
    """Layout rules (a list, or a JSON file path) for tensor-parallel models that are not megatron-core."""

    @field_validator("layout_rules")
    @classmethod
    def _rules_parse(cls, value: Any) -> Any:
        parse_rules(value)
        return value


def load_config(config: str | dict | None) -> dict[str, Any]:
    """Read a ds_config given as a path or a dict (copied, never mutated)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    with open(config) as f:
        return json.load(f)


def split_config(config: dict[str, Any]) -> tuple[dict[str, Any], UniversalConfig]:
    """Separate our options from the config handed to DeepSpeed, validating them."""
    ds_config = copy.deepcopy(config)
    section = ds_config.get("checkpoint", {})
    raw = section.pop("universal", False) if isinstance(section, dict) else False
    if isinstance(raw, bool):
        raw = {"enabled": raw}
    elif not isinstance(raw, dict):
        raise ValueError(f'"checkpoint.universal" must be true/false or an object, got {raw!r}')
    else:
        raw = {"enabled": True, **raw}
    try:
        return ds_config, UniversalConfig(**raw)
    except ValidationError as exc:
        raise ValueError(f'invalid "checkpoint.universal" config: {exc}') from None
