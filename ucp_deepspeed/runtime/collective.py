"""Error fan-out for the ranks of a loading job: one rank's failure is raised on every rank.

A rank that raises alone leaves the others waiting in the next collective, so every step that can
fail on some ranks only (reading files, converting a share of the parameters) ends in `all_ok`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ucp_deepspeed.errors import CheckpointError


def failure_of(exc: BaseException) -> tuple[str, str]:
    """(path, reason) of a failure, to send to the other ranks; one that names no file names the rank."""
    if isinstance(exc, CheckpointError):
        return exc.path, exc.reason
    where = getattr(exc, "filename", None) or f"rank {dist.get_rank()}"
    return str(where), f"{type(exc).__name__}: {exc}"


def all_ok(failure: tuple[str, str] | None) -> None:
    """Raise the same error on every rank if any rank failed (collective)."""
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f), None)
    if first:
        raise CheckpointError(*first)


def guarded(work: Callable[[], Any]) -> Any:
    """Run `work` on every rank; any exception on any rank (a damaged file, a RuntimeError, running out of memory)
    is raised on all of them as the first failing rank's `CheckpointError`, chained to the local one (collective)."""
    result, failure, error = None, None, None
    try:
        result = work()
    except Exception as exc:
        failure, error = failure_of(exc), exc
    try:
        all_ok(failure)
    except CheckpointError as fanned:
        raise fanned from error
    return result


def on_rank0(work: Callable[[], Any]) -> None:
    """Run `work` on rank 0 only; a failure there is raised on every rank (collective)."""
    guarded(work if dist.get_rank() == 0 else lambda: None)


def to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 and None elsewhere: what only rank 0 acts on (the pieces to
    CRC-check, the names to compare) crosses the network once, not once per rank (collective)."""
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (collective)."""
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def everywhere(flag: bool) -> bool:
    """True when `flag` holds on every rank (collective)."""
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return all(flags)
