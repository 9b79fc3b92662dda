"""The parallel layout and numerics a checkpoint was saved with, recorded both in our save metadata and in the
manifest of every universal folder."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

BF16_OPTIMIZER = "BF16_Optimizer"
"""DeepSpeed's optimizer for bf16 at ZeRO-0, and at ZeRO-1 with fp32 gradient accumulation: its files keep each flat
partition whole, alignment padding included, where ZeRO-1/2 save them without it."""


@dataclass(frozen=True)
class Topology:
    """The parallel layout and numerics a checkpoint was saved with."""

    dp: int
    zero_stage: int
    dtype: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    optimizer: str = ""
    sp: int = 1
    """Ulysses sequence-parallel size: every rank holds the whole model, and ZeRO's `dp` partitions span the
    sequence x data-parallel ranks."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "str":
                good = type(value) is str
            else:
                good = type(value) is int and value >= (0 if f.name == "zero_stage" else 1)
            if not good:
                raise ValueError(f"topology.{f.name} is {value!r}")

    @property
    def unpartitioned(self) -> bool:
        """ZeRO-0 in fp32: DeepSpeed steps the torch optimizer itself and saves its state dict whole."""
        return self.zero_stage == 0 and self.dtype == "fp32"

    @property
    def padded(self) -> bool:
        """Whether each rank's file holds its whole flat partition, alignment padding included (BF16_Optimizer)."""
        return self.optimizer == BF16_OPTIMIZER

    def describe(self) -> str:
        """Short human-readable form, e.g. `zero2 dp=4 fp32`."""
        parts = [f"zero{self.zero_stage}", f"dp={self.dp}"]
        parts += [f"{k}={v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep), ("sp", self.sp)) if v != 1]
        return " ".join(parts + [self.dtype])

    def same_layout(self, other: Topology) -> bool:
        """True when DeepSpeed's native loader can read a checkpoint of `other` directly."""
        # DeepSpeed before #8226 named a Ulysses rank's files by its sequence-parallel rank, which its loader no longer
        # reads: a change of sequence-parallel size goes through ucp_deepspeed's reader, which knows both schemes
        return (self.dp, self.tp, self.pp, self.ep, self.sp, self.zero_stage, self.optimizer) == (
            other.dp,
            other.tp,
            other.pp,
            other.ep,
            other.sp,
            other.zero_stage,
            other.optimizer,
        )

    def encode(self) -> dict[str, Any]:
        """The JSON form; `sp` only when set, so that what a job without Ulysses writes reads as before."""
        out = asdict(self)
        if self.sp == 1:
            del out["sp"]
        return out

    @classmethod
    def decode(cls, raw: Any) -> Topology:
        """Parse and type-check the JSON form (ValueError on anything malformed, unknown fields included)."""
        if not isinstance(raw, dict):
            raise ValueError("topology is not an object")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"topology has unknown fields {unknown}")
        return cls(**raw)
