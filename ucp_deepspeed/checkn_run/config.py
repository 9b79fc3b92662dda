"""The `"checkpoint": {"differential": ..., "quantize": ...}` sections, registered with the runtime's config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DifferentialConfig(BaseModel):
    """`"checkpoint": {"differential": ...}`: Check-N-Run differential checkpoints of embedding tables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["full", "one_shot", "incremental", "intermittent"] = "intermittent"
    """What each checkpoint holds: every row (`full`), rows changed since the baseline, since the previous
    checkpoint, or the second with a new baseline whenever that is cheaper on average."""
    tables: list[str] | None = None
    """Module names (regular expressions) of the embedding tables to track; default every nn.Embedding(Bag)."""


class QuantizeConfig(BaseModel):
    """`"checkpoint": {"quantize": ...}`: Check-N-Run quantization of checkpointed embedding rows."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["symmetric", "asymmetric", "adaptive", "kmeans"] = "adaptive"
    """Row-wise quantizer (see ucp_deepspeed/checkn_run/quantize.py)."""
    bits: Literal[2, 3, 4, 8] | None = None
    """Bit width; default chosen from `expected_restores`."""
    expected_restores: int | None = Field(None, ge=0)
    """How many restores the job expects: picks the bit width, and 8 bits are used once exceeded."""
    tables: list[str] | None = None
    """Tables to quantize when no differential section names them; default every nn.Embedding(Bag)."""

    @model_validator(mode="after")
    def _needs_width(self) -> QuantizeConfig:
        if self.bits is None and self.expected_restores is None:
            raise ValueError("give `bits` (2, 3, 4 or 8) or `expected_restores` to choose them from")
        return self
