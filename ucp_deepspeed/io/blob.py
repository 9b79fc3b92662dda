"""A stored object opened for ranged reads (`Blob`), a byte window of one, and a blob seen as a file object; and
`Closeable`, what every reader that holds blobs open is.

A blob is read by byte range: `readinto` fills a list of buffers from one offset in one request, so that a reader
asks a store for exactly the bytes it needs. The backends (`io/local.py`, `io/remote.py`) implement it.
"""

from __future__ import annotations

import abc
import io
from typing import Any, TypeVar

from ucp_deepspeed.errors import CheckpointError

_C = TypeVar("_C", bound="Closeable")


class Closeable(abc.ABC):
    """Something that holds files open until `close`; `with` closes it at the block's end, as safetensors'
    `safe_open` does, so that no error path leaves a descriptor open."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what it holds open."""

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Blob(Closeable):
    """One stored object opened for ranged reads."""

    path: str
    concurrency = 1
    """How many of its requests a reader may have in flight at once."""
    request_size: int | None = None
    """The longest request worth sending alone: a reader cuts a longer run into requests of this size and sends
    them side by side (None: one request a run, as a disk's preads)."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Its length in bytes."""

    @abc.abstractmethod
    def readinto(self, views: list[memoryview], offset: int, data: bool = True) -> None:
        """Fill `views`, in order, with the object's bytes from `offset` on (one request; `data` says whether
        they are tensor bytes or metadata, for the counts of `io.stats`)."""

    def read(self, offset: int, length: int, data: bool = False) -> bytes:
        """`length` bytes from `offset`."""
        out = bytearray(length)
        self.readinto([memoryview(out)], offset, data)
        return bytes(out)

    def raw(self) -> io.RawIOBase:
        """A seekable read-only file object over the blob, for `zipfile` (see `_TailFile`)."""
        return _TailFile(self)

    def close(self) -> None:
        """Release what the blob holds open (a store's holds nothing)."""


class Window(Blob):
    """Bytes `[start, start + length)` of another blob, read as a blob of their own: one item of a file that packs
    several (a DCP `.distcp` file). Its owner closes the blob underneath."""

    def __init__(self, blob: Blob, start: int, length: int, path: str):
        if start < 0 or length < 0 or start + length > blob.size:
            raise CheckpointError(blob.path, f"truncated: an item at bytes {start}..{start + length} is past its end")
        self._blob, self._start, self._length, self.path = blob, start, length, path
        self.concurrency, self.request_size = blob.concurrency, blob.request_size

    @property
    def size(self) -> int:
        return self._length

    def readinto(self, views: list[memoryview], offset: int, data: bool = True) -> None:
        if offset + sum(len(v) for v in views) > self._length:
            raise CheckpointError(self.path, "a read runs past the end of the item")
        self._blob.readinto(views, self._start + offset, data)


class BlobFile(io.RawIOBase):
    """A blob as a seekable read-only file object; `fill` serves a read at a position (one request by default)."""

    def __init__(self, blob: Blob):
        super().__init__()
        self._blob, self._pos = blob, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = max(0, {0: 0, 1: self._pos, 2: self._blob.size}[whence] + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._blob.size - self._pos))
        if n:
            self.fill(view[:n], self._pos)
            self._pos += n
        return n

    def fill(self, view: memoryview, pos: int) -> None:
        """Put the blob's bytes from `pos` into `view`."""
        self._blob.readinto([view], pos, data=False)


class _TailFile(BlobFile):
    """A blob as a file for `zipfile`, its last `TAIL` bytes fetched in one request on first use: the end record,
    the zip64 locator and, in a rank file, the whole directory, where reading them one by one would cost three
    round trips to a store."""

    TAIL = 1 << 16

    def __init__(self, blob: Blob):
        super().__init__(blob)
        self._tail_at = max(0, blob.size - self.TAIL)
        self._tail: bytes | None = None

    def fill(self, view: memoryview, pos: int) -> None:
        if pos < self._tail_at:
            super().fill(view, pos)
            return
        if self._tail is None:
            self._tail = self._blob.read(self._tail_at, self._blob.size - self._tail_at)
        view[:] = self._tail[pos - self._tail_at : pos - self._tail_at + len(view)]


def views_after(views: list[memoryview], skip: int) -> list[memoryview]:
    """What is left of a scatter list once its first `skip` bytes are filled: where a short read resumes."""
    out = []
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        out.append(view[skip:])
        skip = 0
    return out
