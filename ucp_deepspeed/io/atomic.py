"""Atomic file writes: a file appears under its name only whole and on disk, or not at all."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import BinaryIO


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary name to write `path` under: fsynced and renamed into place if the block succeeds, else removed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[BinaryIO]:
    """An open file written under a temporary name and moved into place whole (see `atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "w+b") as f:
        yield f


def atomic_write(path: str, data: bytes | memoryview) -> None:
    """Write a whole file atomically (see `atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)
