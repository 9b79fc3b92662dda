"""Coordination of the ranks of a loading or saving job: error fan-out, and waits with a bound of our own.

A rank that raises alone leaves the others waiting in the next collective, so every step that can
fail on some ranks only (reading files, converting a share of the parameters) ends in `all_ok`.

Rank 0 alone does some unbounded work (picking and checking a tag, importing, replaying a Check-N-Run chain)
while the others wait for its answer. Under NCCL a collective that waits longer than the training group's
timeout (10 minutes by default) kills the job, so these object collectives run on a gloo group of our own
(`coordination_group`) whose timeout the user sets (`"wait_minutes"`), independent of the training backend;
`coordinated` makes it the group every helper here uses.

That group is ours to tear down: at interpreter exit (`release_groups`, an atexit hook) each one still registered is
destroyed while the interpreter is whole, instead of whenever finalization's garbage collection reaches it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch.distributed as dist

from ucp_deepspeed.errors import CheckpointError

_GROUP: ContextVar[Callable[[], Any] | None] = ContextVar("ucp_coordination_group", default=None)
"""The group the helpers use, held weakly: a context copied while it is set outlives the block in other threads
(s3fs's event loop keeps the context of every call it ran), and one that held the group would let that daemon
thread drop the last reference during interpreter shutdown, where the group's teardown aborts the process."""

# torch's in-process test worlds (one rank at a time, or ranks as threads) have no peer to wait for and no store a
# gloo group could meet over
_IN_PROCESS = ("fake", "threaded")


# the only strong references to the groups `coordination_group` made: their users hold weak ones, so that
# `release_groups` leaves nothing that keeps a destroyed group's gloo threads and sockets alive
_MADE: list[Any] = []


def coordination_group(minutes: float) -> Callable[[], Any]:
    """A gloo group over every rank whose collectives wait up to `minutes`, as a weak reference (None from it in an
    in-process world, or once `release_groups` has run) (collective: every rank calls it, in the same order)."""
    if dist.get_backend() in _IN_PROCESS:
        return lambda: None
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=minutes))
    _MADE.append(group)
    return weakref.ref(group)


@atexit.register
def release_groups() -> None:
    """At exit, destroy the groups `coordination_group` made while the interpreter is whole: a gloo group's teardown
    is local to this rank and waits for no other, whatever the training backend, so it cannot hang an exit."""
    while _MADE:
        group = _MADE.pop()
        if not dist.is_initialized():
            continue  # the user's destroy_process_group() unregistered it; dropping it is what remains
        with contextlib.suppress(ValueError):  # unregistered already
            dist.destroy_process_group(group)


@contextlib.contextmanager
def coordinated(group: Any) -> Iterator[None]:
    """The helpers here use `group` (None: the default group) until the block ends."""
    token = _GROUP.set(None if group is None else weakref.ref(group))
    try:
        yield
    finally:
        _GROUP.reset(token)


def _group() -> Any:
    """The group of the enclosing `coordinated` block (None: the default group)."""
    held = _GROUP.get()
    if held is None:
        return None
    group = held()
    if group is None:  # the default group would drop the coordination group's timeout without a word
        raise RuntimeError("ucp: the coordination group was released (at exit) while a checkpoint call still ran")
    return group


def barrier() -> None:
    """Every rank has got here (collective)."""
    dist.barrier(group=_group())


def failure_of(exc: BaseException) -> tuple[str, str]:
    """(path, reason) of a failure, to send to the other ranks; one that names no file names the rank."""
    if isinstance(exc, CheckpointError):
        return exc.path, exc.reason
    where = getattr(exc, "filename", None) or f"rank {dist.get_rank()}"
    return str(where), f"{type(exc).__name__}: {exc}"


def all_ok(failure: tuple[str, str] | None) -> None:
    """Raise the same error on every rank if any rank failed (collective)."""
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure, group=_group())
    first = next((f for f in failures if f), None)
    if first:
        raise CheckpointError(*first)


def guarded(work: Callable[[], Any], release: Callable[[Any], object] | None = None) -> Any:
    """Run `work` on every rank; any exception on any rank (a damaged file, a RuntimeError, running out of memory)
    is raised on all of them as the first failing rank's `CheckpointError`, chained to the local one (collective).
    `release(result)` frees what `work` opened on a rank where it succeeded when another rank's failed."""
    result, failure, error = None, None, None
    try:
        result = work()
    except Exception as exc:
        failure, error = failure_of(exc), exc
    try:
        all_ok(failure)
    except CheckpointError as fanned:
        if failure is None and release is not None:
            with contextlib.suppress(Exception):  # every rank reports the fanned error, not its own cleanup's
                release(result)
        raise fanned from error
    return result


def on_rank0(work: Callable[[], Any]) -> None:
    """Run `work` on rank 0 only; a failure there is raised on every rank (collective)."""
    guarded(work if dist.get_rank() == 0 else lambda: None)


def to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 and None elsewhere: what only rank 0 acts on (the pieces to
    CRC-check, the names to compare) crosses the network once, not once per rank (collective)."""
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0, group=_group())
    return gathered


def gather_at(obj: Any, dst: int) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank `dst` (its own not sent) and None elsewhere: a piece goes only to
    the rank that acts on it (collective)."""
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == dst else None
    dist.gather_object(None if rank == dst else obj, gathered, dst=dst, group=_group())
    if gathered is not None:
        gathered[dst] = obj
    return gathered


def from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (collective)."""
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=_group())
    return box[0]


def every_rank(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (collective)."""
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, obj, group=_group())
    return found


def everywhere(flag: bool) -> bool:
    """True when `flag` holds on every rank (collective)."""
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag, group=_group())
    return all(flags)
