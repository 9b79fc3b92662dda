"""What a storage backend provides (`Storage`), and the order a checkpoint uses it in.

A `Storage`'s calls, in the order a checkpoint uses them:

1. save: `write` each object whole (it exists only complete, and is durable when the call returns: renamed into
   place after an fsync on disk, acknowledged by the store); then `commit` the tag's commit object, last, once every
   rank's objects are written; then `write` `latest`;
2. load: `exists` / `isdir` / `listdir` to find what is there, `read` a whole small object (metadata, `latest`),
   `open` a `Blob` for ranged reads of a large one (`readinto` fills buffers from a byte offset: one `preadv` on
   disk, one ranged GET per request on a store);
3. clean-up: `delete` a file or a folder with everything in it.

An object store has no folders and no rename: a "folder" is a key prefix, and completeness is decided by the commit
object (`format/commit.py`), never by the presence of files.
"""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager
from typing import BinaryIO

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.blob import Blob
from ucp_deepspeed.io.stats import record


class Storage(abc.ABC):
    """A place checkpoint objects live; see the module docstring for the call order."""

    @abc.abstractmethod
    def open(self, path: str) -> Blob:
        """An object opened for ranged reads; a missing one is a `CheckpointError` naming it."""

    def read(self, path: str, limit: int | None = None) -> bytes:
        """A whole (small) object; one larger than `limit` bytes is refused unread."""
        with self.open(path) as blob:
            record(files=1)
            if limit is not None and blob.size > limit:
                raise CheckpointError(path, f"is {blob.size} bytes, larger than the {limit} such a file may hold")
            return blob.read(0, blob.size)

    @abc.abstractmethod
    def write(self, path: str, data: bytes | memoryview) -> None:
        """Write a whole object: it appears only complete, and is durable when this returns."""

    @abc.abstractmethod
    def writer(self, path: str) -> AbstractContextManager[BinaryIO]:
        """A file to stream one object into, readable and seekable (a save id is stamped into an archive just
        written): the object appears only if the block succeeds (then as `write`)."""

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names directly inside a folder (or key prefix); empty when there is none."""

    @abc.abstractmethod
    def sizes(self, path: str) -> dict[str, int]:
        """The objects directly inside a folder and their sizes, from one listing."""

    @abc.abstractmethod
    def find(self, path: str) -> list[str]:
        """Every object under a folder, at any depth, as paths relative to it."""

    @abc.abstractmethod
    def stat(self, path: str) -> tuple[int, int]:
        """(size in bytes, modification time in ns) of an object: what tells a rewritten object from the old one."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether an object or folder is there."""

    @abc.abstractmethod
    def isfile(self, path: str) -> bool:
        """Whether an object (not a folder) is there."""

    @abc.abstractmethod
    def isdir(self, path: str) -> bool:
        """Whether a folder (a key prefix with objects under it, on a store) is there."""

    @abc.abstractmethod
    def mtime(self, path: str) -> float:
        """When an object or folder was last written (seconds since the epoch; 0 for a store's prefix)."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Remove an object, or a folder with everything under it; nothing there is not an error."""

    def makedirs(self, path: str) -> None:  # noqa: B027 - a store has no folders to make
        """Make a folder and its parents where folders exist (nothing to do on a store)."""

    def commit(self, path: str, data: bytes) -> None:
        """Write a tag's commit object, the last object of a save (see the module docstring)."""
        self.write(path, data)
