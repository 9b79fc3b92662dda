"""The local filesystem as a `Storage`: ranged reads by `preadv` on a descriptor, whole writes by fsync and rename,
and the two things only a local folder can do, take a lock and append a line."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import BinaryIO

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.atomic import atomic_file, atomic_write
from ucp_deepspeed.io.backend import Storage
from ucp_deepspeed.io.blob import Blob, views_after
from ucp_deepspeed.io.stats import record

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# DeepSpeed's FastPersist writer (`"writer": {"type": "fast"}`) stores each file of a data-parallel save (ZeRO-0/1/2)
# as `<name>-<writer rank>.<writers>`, on torch 2.13 the whole file under each such name, while DeepSpeed's own load
# asks for `<name>`: a read of a missing `..._states.pt` finds it under its part name, and a listing gives it its name
_PART = re.compile(r"(.+_states\.pt)-([0-9]+)\.([0-9]+)")


def stored(path: str) -> str:
    """Where the local file `path` is: itself, or the lowest writer's FastPersist part when only parts were written."""
    if not path.endswith("_states.pt") or os.path.lexists(path):
        return path
    folder, name = os.path.split(path)
    try:
        found = os.stat(folder or ".")
    except OSError:
        return path
    # a folder lists once, not once per missing name (a 1,000-rank load probes names that no save wrote, such as
    # the bf16 prefix on a non-bf16 tag, at every rank); a listing younger than the clock's grain is not kept, as a
    # file added within it leaves the folder's time as it was
    settled = time.time_ns() - found.st_mtime_ns > _FRESH_NS
    parts = (_lowest_parts if settled else _lowest_parts.__wrapped__)(folder or ".", found.st_ino, found.st_mtime_ns)
    return os.path.join(folder, parts[name]) if name in parts else path


_FRESH_NS = 2_000_000_000


@functools.lru_cache(maxsize=64)
def _lowest_parts(folder: str, inode: int, mtime_ns: int) -> dict[str, str]:
    """DeepSpeed's name -> its lowest writer's part, for the folder as it was at (inode, mtime)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    lowest: dict[str, tuple[int, str]] = {}
    for n in names:
        if (m := _PART.fullmatch(n)) and (m.group(1) not in lowest or int(m.group(2)) < lowest[m.group(1)][0]):
            lowest[m.group(1)] = (int(m.group(2)), n)
    return {name: part for name, (_, part) in lowest.items()}


def holds_parts(folder: str) -> bool:
    """Whether a local folder holds files that only FastPersist's part names name (see `stored`)."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return any((m := _PART.fullmatch(n)) and m.group(1) not in names for n in names)


def name_of(part: str) -> str:
    """The name DeepSpeed gave a file its FastPersist writer stored as `part` (any other name as it is)."""
    found = _PART.fullmatch(part)
    return found.group(1) if found else part


class LocalBlob(Blob):
    """A local file held open by its descriptor, read with `preadv` straight into the caller's buffers."""

    def __init__(self, path: str):
        self.path, self._fd = path, -1
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(path, "file is missing") from None
        except OSError as exc:
            raise CheckpointError(path, f"cannot open ({exc.strerror})") from None
        self._size = os.fstat(self._fd).st_size

    @property
    def size(self) -> int:
        return self._size

    def readinto(self, views: list[memoryview], offset: int, data: bool = True) -> None:
        for first in range(0, len(views), _IOV_MAX):
            batch = [v for v in views[first : first + _IOV_MAX] if len(v)]
            total = sum(len(v) for v in batch)
            if not total:
                continue
            record(requests=1, **{"data" if data else "metadata": total})
            done = 0
            while done < total:
                got = os.preadv(self._fd, views_after(batch, done), offset + done)
                if got <= 0:
                    raise CheckpointError(self.path, f"truncated: nothing to read at byte {offset + done}")
                done += got
            offset += total

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # the package's one finalizer: a bare descriptor, unlike a file object, is not closed when it is collected,
        # so a reader dropped unclosed (an owner that never closes it, code outside the package) would hold it
        # until the process exits; every reader above a blob relies on this one instead of a finalizer of its own
        self.close()


class LocalStorage(Storage):
    """The local filesystem: `preadv` on a descriptor, atomic writes by fsync and rename."""

    def open(self, path: str) -> Blob:
        return LocalBlob(stored(path))

    def write(self, path: str, data: bytes | memoryview) -> None:
        atomic_write(path, data)
        record(writes=1, written=len(data))

    def writer(self, path: str) -> AbstractContextManager[BinaryIO]:
        return atomic_file(path)

    def listdir(self, path: str) -> list[str]:
        return sorted({name_of(n) for n in os.listdir(path)}) if os.path.isdir(path) else []

    def sizes(self, path: str) -> dict[str, int]:
        if not os.path.isdir(path):
            return {}
        with os.scandir(path) as entries:
            found = sorted((e.name, e.stat().st_size) for e in entries if e.is_file())
        out: dict[str, int] = {}
        for name, size in found:  # a FastPersist part's size under its name (the file itself first, if written)
            out.setdefault(name_of(name), size)
        return out

    def find(self, path: str) -> list[str]:
        return sorted(
            os.path.relpath(os.path.join(folder, name), path) for folder, _, names in os.walk(path) for name in names
        )

    def stat(self, path: str) -> tuple[int, int]:
        found = os.stat(stored(path))
        return found.st_size, found.st_mtime_ns

    def exists(self, path: str) -> bool:
        return os.path.exists(stored(path))

    def isfile(self, path: str) -> bool:
        return os.path.isfile(stored(path))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def mtime(self, path: str) -> float:
        return os.path.getmtime(path)

    def delete(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def commit(self, path: str, data: bytes) -> None:
        atomic_write(path, data)  # its rename is durable: a crash cannot undo a commit that returned


@contextmanager
def lock_folder(path: str, name: str, holder: str) -> Iterator[None]:
    """Hold an exclusive lock on the local folder `path` (called `name` in the message a second `holder` logs while
    it waits) while the block runs."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger("ucp_deepspeed").warning(
                "ucp: %s is being written by another %s; waiting for it to finish", name, holder
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def append(path: str, line: str) -> None:
    """Append a line to a local file, not fsynced: for logs that a crash may cut short."""
    with open(path, "a") as f:
        f.write(line)
