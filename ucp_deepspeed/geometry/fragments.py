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


def zero12_fragments(slot: ParamSlot, dp: int, start: int = 0, end: int | None = None) -> list[Fragment]:
    """Fragments of elements [start, end) of a ZeRO-1/2 parameter: its extent in the flat buffer cut at partition
    borders; only the partitions the range overlaps are visited.

    Partition k is in the file of data-parallel rank `slot.ranks[k]` (rank k when `ranks` is empty).
    """
    end = slot.numel if end is None else end
    begin, stop = slot.offset + start, slot.offset + end
    count = len(slot.ranks) if slot.ranks else dp
    if begin >= stop or slot.partition <= 0:
        return []
    out = []
    for k in range(begin // slot.partition, min(count, -(-stop // slot.partition))):
        lo, hi = max(begin, k * slot.partition), min(stop, (k + 1) * slot.partition)
        if lo < hi:
            rank = slot.ranks[k] if slot.ranks else k
            out.append(Fragment(rank, lo - k * slot.partition, lo - slot.offset, hi - lo))
    return out


def zero3_fragments(slot: ParamSlot, dp: int, start: int = 0, end: int | None = None) -> list[Fragment]:
    """Fragments of elements [start, end) of a ZeRO-3 parameter: partition k holds elements [k*partition,
    (k+1)*partition); only the partitions the range overlaps are visited.

    Partition k is in the file of data-parallel rank `slot.ranks[k]` (rank k when `ranks` is empty: AutoEP
    partitions an expert stack over its expert-data-parallel group only).
    """
    end = slot.numel if end is None else end
    if start >= end or slot.partition <= 0:
        return []
    out = []
    count = len(slot.ranks) if slot.ranks else dp
    for k in range(start // slot.partition, min(count, -(-end // slot.partition))):
        lo, hi = max(start, k * slot.partition), min(end, (k + 1) * slot.partition, slot.numel)
        if lo < hi:
            rank = slot.ranks[k] if slot.ranks else k
            out.append(Fragment(rank, slot.offset + lo - k * slot.partition, lo, hi - lo))
    return out


def fragments(slot: ParamSlot, zero_stage: int, dp: int) -> list[Fragment]:
    """Fragments of a trainable parameter for the ZeRO stage it was saved with."""
    frags = zero3_fragments(slot, dp) if zero_stage == 3 else zero12_fragments(slot, dp)
    covered = sum(f.numel for f in frags)
    if covered != slot.numel:
        raise ValueError(f"{slot.name}: fragments cover {covered} of {slot.numel} elements")
    return frags


def fragments_in(slot: ParamSlot, zero_stage: int, dp: int, start: int, end: int) -> list[Fragment]:
    """The fragments holding elements [start, end) of a parameter, cut to that range: O(fragments overlapped), not
    O(data-parallel size), so a rank of a 1024-rank job plans its reads without visiting every source rank."""
    frags = (zero3_fragments if zero_stage == 3 else zero12_fragments)(slot, dp, start, end)
    covered = sum(f.numel for f in frags)
    if covered != end - start:
        raise ValueError(f"{slot.name}: fragments cover {covered} of elements [{start}, {end})")
    return frags


def rank_fragment(slot: ParamSlot, zero_stage: int, dp: int, rank: int) -> Fragment | None:
    """The fragment of a parameter in data-parallel rank `rank`'s file, if it holds one: found directly, so checking
    each of a thousand files does not walk every parameter's thousand fragments."""
    files = slot.ranks or range(dp)
    if rank not in files:
        return None
    k = files.index(rank)
    if zero_stage == 3:
        start = k * slot.partition
        frags = zero3_fragments(slot, dp, start, min(slot.numel, start + slot.partition))
    else:
        begin = max(0, k * slot.partition - slot.offset)
        frags = zero12_fragments(slot, dp, begin, min(slot.numel, max(begin, (k + 1) * slot.partition - slot.offset)))
    return next((f for f in frags if f.rank == rank), None)


def saved_numel(end: int, partition: int, position: int, padded: bool = False) -> int:
    """How many elements of a ZeRO-1/2 flat group the `position`-th rank's file holds.

    DeepSpeed pads a group to a multiple of twice the data-parallel size and saves each partition without the
    padding: ranks before the group's `end` save whole partitions, the rank it ends in saves the rest, and every
    later rank saves nothing. A group smaller than the data-parallel size leaves most ranks empty. With `padded`
    (DeepSpeed's BF16_Optimizer) every rank saves its whole partition, padding included.
    """
    return partition if padded else max(0, min(partition, end - position * partition))
