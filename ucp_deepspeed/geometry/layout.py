"""Tensor-parallel geometry: which slices of a full parameter one tensor-parallel rank holds.

A `Layout` says how a rank's local tensor is cut from the full ("universal") tensor, in the
spirit of DeepSpeed's affine shard descriptions rather than name lists:

    replicated      every rank holds the whole tensor (norm weights, row-parallel biases)
    average         like replicated, but replicas may drift; conversion keeps their mean
    split           cut along `dim` into `tp` equal chunks, rank r takes chunk r
    split + parts   the full tensor is sub-tensors of sizes `parts` concatenated along `dim`
                    (fused QKV with unequal blocks, SwiGLU gate|up); each part is split on its
                    own and a rank holds its chunk of every part, concatenated
    split + vocab   the split tensor is padded along `dim` to a multiple of tp; the full tensor
                    keeps only the first `vocab` entries, and padding is re-created as zeros
    split + shards  an uneven split: for each part along `dim` (one when nothing is fused), the
                    length each rank holds, in rank order (DeepSpeed's AutoTP gives whole heads or
                    grains to the first ranks); a rank holds its run of every part, concatenated

A split is over the tensor-parallel ranks unless `over` says the expert-parallel ones: DeepSpeed's
AutoEP stacks a layer's experts along dim 0 and gives each expert-parallel rank a contiguous run of
them. "rank" and "tp" below are then the expert-parallel rank and size.

Everything reduces to `pieces`: (offset in the full tensor, offset in the local tensor, length)
along `dim`. Merging and splitting are the same copy in opposite directions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

KINDS = ("replicated", "average", "split")


class Axis(str, Enum):
    """The ranks a split layout is cut over."""

    TENSOR = "tp"
    EXPERT = "ep"


@dataclass(frozen=True)
class Piece:
    """A run of `length` entries along the split dim: full[full_start:] <-> local[local_start:]."""

    full_start: int
    local_start: int
    length: int


@dataclass(frozen=True)
class Layout:
    """How one tensor-parallel rank's local tensor relates to the full tensor."""

    kind: str = "replicated"
    dim: int = 0
    parts: tuple[int, ...] = ()
    vocab: int = 0
    shards: tuple[tuple[int, ...], ...] = ()
    """Per part, each rank's length along `dim`: an uneven split, valid at `len(shards[0])` ranks only."""
    over: Axis = Axis.TENSOR

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown layout {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.over is not Axis.TENSOR and self.kind != "split":
            raise ValueError(f"only a split layout is cut over the {self.over.value} ranks, not {self.kind!r}")
        if self.kind != "split" and (self.parts or self.vocab or self.shards):
            raise ValueError(f"'parts', 'vocab' and 'shards' only apply to split layouts, not {self.kind!r}")
        if sum(map(bool, (self.parts, self.vocab, self.shards))) > 1:
            raise ValueError("a layout has at most one of fused 'parts', a padded 'vocab' and uneven 'shards'")
        if any(p <= 0 for p in self.parts) or self.vocab < 0 or self.dim < 0:
            raise ValueError(f"invalid layout {self}")
        if self.shards and (
            len({len(widths) for widths in self.shards}) != 1
            or any(w < 0 for widths in self.shards for w in widths)
            or any(sum(widths) == 0 for widths in self.shards)
        ):
            raise ValueError(f"invalid layout {self}: every part needs one length per rank, and some length")

    @classmethod
    def from_widths(cls, dim: int, widths: Sequence[Sequence[int]], fused: bool = False) -> Layout:
        """A split along `dim` from each part's length on each rank, as AutoTP records them: a split whose every
        part is even is the same at any size (fused `parts`, or a plain split for one part unless `fused`); an
        uneven one holds the lengths (`shards`)."""
        shards = tuple(tuple(int(w) for w in part) for part in widths)
        if any(len(set(part)) != 1 for part in shards):
            return cls("split", dim, shards=shards)
        return cls("split", dim, parts=tuple(sum(part) for part in shards) if fused or len(shards) > 1 else ())

    def local_length(self, rank: int) -> int:
        """Length along `dim` that rank `rank` holds, for an uneven split (`shards`)."""
        return sum(widths[rank] for widths in self.shards)

    @property
    def is_split(self) -> bool:
        """Whether ranks hold different slices (as opposed to copies)."""
        return self.kind == "split"

    def check(self, local_shape: Sequence[int], tp: int, rank: int | None = None) -> None:
        """Raise ValueError if a local tensor of this shape cannot be rank `rank`'s share (any rank's, if None) at
        this tp size."""
        if not self.is_split:
            return
        if self.dim >= len(local_shape):
            raise ValueError(f"split dim {self.dim} but the tensor has shape {tuple(local_shape)}")
        if self.shards:
            if len(self.shards[0]) != tp:
                raise ValueError(f"an uneven split over {len(self.shards[0])} ranks, used at {tp}")
            widths, length = [list(w) for w in self.shards], local_shape[self.dim]
            if rank is None and length not in {self.local_length(r) for r in range(tp)}:
                raise ValueError(f"no rank of the uneven split {widths} holds {length} along dim {self.dim}")
            if rank is not None and length != self.local_length(rank):
                raise ValueError(
                    f"rank {rank} of the uneven split {widths} holds {self.local_length(rank)} along dim {self.dim}, "
                    f"not {length}"
                )
            return
        padded = local_shape[self.dim] * tp
        if self.parts:
            if sum(self.parts) != padded:
                raise ValueError(
                    f"parts {list(self.parts)} sum to {sum(self.parts)}, but {tp} ranks of "
                    f"{local_shape[self.dim]} hold {padded} along dim {self.dim}"
                )
            uneven = [p for p in self.parts if p % tp]
            if uneven:
                raise ValueError(f"parts {uneven} cannot be split evenly across {tp} tensor-parallel ranks")
        if self.vocab > padded:
            raise ValueError(f"vocab {self.vocab} exceeds the {padded} entries that {tp} ranks hold")

    def full_shape(self, local_shape: Sequence[int], tp: int) -> tuple[int, ...]:
        """Shape of the full tensor, without vocab padding."""
        self.check(local_shape, tp)
        shape = list(local_shape)
        if self.shards:
            shape[self.dim] = sum(sum(widths) for widths in self.shards)
        elif self.is_split:
            shape[self.dim] = self.vocab or local_shape[self.dim] * tp
        return tuple(shape)

    def pieces(self, local_shape: Sequence[int], rank: int, tp: int) -> list[Piece]:
        """The runs along `dim` that rank `rank` of `tp` holds; padding is in no piece."""
        self.check(local_shape, tp, rank)
        if not local_shape:
            return [Piece(0, 0, 1)]
        local_len = local_shape[self.dim]
        if not self.is_split:
            return [Piece(0, 0, local_len)]
        out = []
        local, base = 0, 0
        if self.shards:
            for widths in self.shards:
                if widths[rank]:
                    out.append(Piece(base + sum(widths[:rank]), local, widths[rank]))
                local, base = local + widths[rank], base + sum(widths)
            return out
        for size in self.parts or (local_len * tp,):
            chunk = size // tp
            start = base + rank * chunk
            length = min(chunk, self.vocab - start) if self.vocab else chunk
            if length > 0:
                out.append(Piece(start, local, length))
            local, base = local + chunk, base + size
        return out

    def to_json(self) -> dict[str, Any]:
        """Compact JSON form, as written in metadata and accepted in layout rules."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.is_split:
            out["dim"] = self.dim
        if self.parts:
            out["parts"] = list(self.parts)
        if self.vocab:
            out["vocab"] = self.vocab
        if self.shards:
            out["shards"] = [list(widths) for widths in self.shards]
        if self.over is not Axis.TENSOR:
            out["over"] = self.over.value
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Layout:
        """Inverse of `to_json`."""
        return cls(
            kind=raw["kind"],
            dim=int(raw.get("dim", 0)),
            parts=tuple(int(p) for p in raw.get("parts", ())),
            vocab=int(raw.get("vocab", 0)),
            shards=tuple(tuple(int(w) for w in widths) for widths in raw.get("shards", ())),
            over=Axis(raw.get("over", Axis.TENSOR.value)),
        )


REPLICATED = Layout()


def _narrow(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return t.reshape(1).narrow(0, start, length) if t.dim() == 0 else t.narrow(dim, start, length)


def merge(layout: Layout, shards: Sequence[torch.Tensor], name: str = "") -> torch.Tensor:
    """The full tensor from every tensor-parallel rank's local tensor, in rank order."""
    tp = len(shards)
    local_shape = tuple(shards[0].shape)
    if layout.kind == "replicated" or (layout.kind == "average" and all(torch.equal(shards[0], s) for s in shards)):
        return shards[0].clone()
    if layout.kind == "average":
        return torch.stack([s.double() for s in shards]).mean(0).to(shards[0].dtype)
    full = torch.zeros(layout.full_shape(local_shape, tp), dtype=shards[0].dtype)
    for rank, shard in enumerate(shards):
        expected = list(local_shape)
        if layout.shards:
            expected[layout.dim] = layout.local_length(rank)
        if list(shard.shape) != expected:
            raise ValueError(
                f"{name}: tensor-parallel rank {rank} holds {tuple(shard.shape)}, expected {tuple(expected)}"
            )
        for piece in layout.pieces(tuple(shard.shape), rank, tp):
            _narrow(full, layout.dim, piece.full_start, piece.length).copy_(
                _narrow(shard, layout.dim, piece.local_start, piece.length)
            )
    return full


def dropped_padding(layout: Layout, shards: Sequence[torch.Tensor]) -> float:
    """Largest |value| in the vocab padding that `merge` drops (non-zero means information is lost)."""
    if not layout.vocab:
        return 0.0
    tp, local_len = len(shards), shards[0].shape[layout.dim]
    worst = 0.0
    for rank, shard in enumerate(shards):
        kept = sum(p.length for p in layout.pieces(tuple(shard.shape), rank, tp))
        if kept < local_len:
            pad = shard.narrow(layout.dim, kept, local_len - kept)
            worst = max(worst, pad.abs().max().item())
    return worst


def split(
    layout: Layout,
    local_shape: Sequence[int],
    rank: int,
    tp: int,
    read: Callable[[int, int, int], torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rank `rank`'s local tensor, built from `read(dim, start, length)` slices of the full tensor."""
    local = torch.zeros(tuple(local_shape), dtype=dtype)
    dim = layout.dim if layout.is_split else 0
    for piece in layout.pieces(local_shape, rank, tp):
        _narrow(local, dim, piece.local_start, piece.length).copy_(
            read(dim, piece.full_start, piece.length).reshape(_narrow(local, dim, 0, piece.length).shape)
        )
    return local
