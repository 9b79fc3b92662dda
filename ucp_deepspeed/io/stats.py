"""What a load costs in storage operations, counted where they happen: files opened, requests, metadata and data bytes,
and the tensor bytes copied in memory after they were read.

At a thousand ranks what decides a resume's time is not one rank's arithmetic but how many files every rank opens,
how many requests it sends and how much metadata it reads before the first tensor byte. The readers in `io` report
each operation here; `counting` collects them for one stretch of work (one simulated rank, one benchmark load) in a
context variable, so threads and ranks simulated one after another keep their counts apart.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields

__all__ = ["ReadStats", "counting", "record"]


@dataclass
class ReadStats:
    """Storage operations of one stretch of work."""

    files_opened: int = 0
    requests: int = 0
    """Read calls sent to storage: a merged read of adjacent ranges is one."""
    metadata_bytes: int = 0
    """Zip directories, pickles, metadata files: everything read to plan."""
    data_bytes: int = 0
    """Tensor bytes."""
    lookups: int = 0
    """HEADs and listings sent to a store: round trips before (or between) the reads."""
    write_requests: int = 0
    """Whole objects written through `io.storage` (one PUT each on a store)."""
    bytes_written: int = 0
    copied_bytes: int = 0
    """Tensor bytes copied in memory after they were read: out of a store's response, merged from tensor-parallel
    shards, into the engine's own tensors at the commit, and into the low-precision weights."""

    def add(self, other: ReadStats) -> None:
        """Add `other`'s counts to these."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


_current: ContextVar[ReadStats | None] = ContextVar("ucp_read_stats", default=None)


@contextmanager
def counting() -> Iterator[ReadStats]:
    """Count the storage operations of the enclosed work (nested blocks count into their enclosing ones too)."""
    outer = _current.get()
    stats = ReadStats()
    token = _current.set(stats)
    try:
        yield stats
    finally:
        _current.reset(token)
        if outer is not None:
            outer.add(stats)


_lock = threading.Lock()


def record(
    files: int = 0,
    requests: int = 0,
    metadata: int = 0,
    data: int = 0,
    writes: int = 0,
    written: int = 0,
    copied: int = 0,
    lookups: int = 0,
) -> None:
    """Report operations to the enclosing `counting` block, if any (cheap when none is open); worker threads started
    in a copy of its context (`contextvars.copy_context`) count into it too."""
    stats = _current.get()
    if stats is not None:
        with _lock:
            stats.files_opened += files
            stats.requests += requests
            stats.metadata_bytes += metadata
            stats.data_bytes += data
            stats.write_requests += writes
            stats.bytes_written += written
            stats.copied_bytes += copied
            stats.lookups += lookups
