"""Partition geometry: which element ranges of a parameter each data-parallel rank holds.

A parameter is described by where it sits in the flat buffers (`ParamSlot`), not by its name, so
one function per ZeRO family turns that into fragments: (rank, offset in the rank's flat buffer,
offset in the flattened parameter, length). Conversion concatenates fragments; nothing else about
ZeRO's layout leaks into the rest of the code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ParamSlot(Protocol):
    """Where a parameter sits in ZeRO's flat buffers: the save metadata's `ParamSlot` has these fields."""

    @property
    def name(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def numel(self) -> int: ...
    @property
    def partition(self) -> int: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Fragment:
    """A contiguous run of a flattened parameter stored in one rank's flat buffer."""

    rank: int
    src: int
    dst: int
    numel: int


def zero12_fragments(slot: ParamSlot, dp: int) -> list[Fragment]:
    """Fragments of a ZeRO-1/2 parameter: its extent in the flat buffer cut at partition borders.

    Partition k is in the file of data-parallel rank `slot.ranks[k]` (rank k when `ranks` is empty).
    """
    begin, end = slot.offset, slot.offset + slot.numel
    files = slot.ranks or tuple(range(dp))
    out = []
    for k, rank in enumerate(files):
        lo, hi = max(begin, k * slot.partition), min(end, (k + 1) * slot.partition)
        if lo < hi:
            out.append(Fragment(rank, lo - k * slot.partition, lo - begin, hi - lo))
    return out


def zero3_fragments(slot: ParamSlot, dp: int) -> list[Fragment]:
    """Fragments of a ZeRO-3 parameter: rank r holds elements [r*partition, (r+1)*partition)."""
    out = []
    for rank in range(dp):
        start = rank * slot.partition
        numel = min(slot.partition, slot.numel - start)
        if numel > 0:
            out.append(Fragment(rank, slot.offset, start, numel))
    return out


def fragments(slot: ParamSlot, zero_stage: int, dp: int) -> list[Fragment]:
    """Fragments of a trainable parameter for the ZeRO stage it was saved with."""
    frags = zero3_fragments(slot, dp) if zero_stage == 3 else zero12_fragments(slot, dp)
    covered = sum(f.numel for f in frags)
    if covered != slot.numel:
        raise ValueError(f"{slot.name}: fragments cover {covered} of {slot.numel} elements")
    return frags


def saved_numel(end: int, partition: int, position: int) -> int:
    """How many elements of a ZeRO-1/2 flat group the `position`-th rank's file holds.

    DeepSpeed pads a group to a multiple of twice the data-parallel size and saves each partition without the
    padding: ranks before the group's `end` save whole partitions, the rank it ends in saves the rest, and every
    later rank saves nothing. A group smaller than the data-parallel size leaves most ranks empty.
    """
    return max(0, min(partition, end - position * partition))
