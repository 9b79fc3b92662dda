"""Atomic file writes: a file appears under its name only whole and on disk, or not at all."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import BinaryIO


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary name to write `path` under: fsynced and renamed into place if the block succeeds, the rename made
    durable by an fsync of the folder (a crash cannot take it back), else removed."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync(folder)


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[BinaryIO]:
    """An open file written under a temporary name and moved into place whole (see `atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "w+b") as f:
        yield f


def atomic_write(path: str, data: bytes | memoryview) -> None:
    """Write a whole file atomically (see `atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)


@contextlib.contextmanager
def written_back(path: str, every: float = 0.05) -> Iterator[None]:
    """Keep the disk writing `path` while the block is still writing it, so that the fsync after it waits for the
    tail, not the whole file. Below the kernel's dirty threshold (10% of memory by default) nothing reaches the
    disk until that fsync, and a save took the time to serialize plus the time to write. A thread opens `path`
    once it appears and `fdatasync`s it every `every` seconds (the call releases the GIL); the error of one is
    raised here, since the file's later fsync may not see an error this descriptor was told of."""
    done = threading.Event()
    failure: list[OSError] = []

    def flush() -> None:
        fd = -1
        try:
            while not done.wait(every):
                if fd < 0:
                    with contextlib.suppress(FileNotFoundError):
                        fd = os.open(path, os.O_RDONLY)
                    continue
                os.fdatasync(fd)
        except OSError as exc:
            failure.append(exc)
        finally:
            if fd >= 0:
                os.close(fd)

    thread = threading.Thread(target=flush, name="ucp-written-back", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    if failure:
        raise failure[0]


def rename_durably(source: str, dest: str) -> None:
    """Rename a file or folder within its folder, made durable by an fsync of that folder (a crash cannot take it
    back)."""
    os.replace(source, dest)
    _fsync(os.path.dirname(dest) or ".")


def make_durable(path: str) -> None:
    """Fsync a file another writer wrote in place (DeepSpeed's `latest`) and its folder: what it holds, and its
    name, survive a crash from here on."""
    _fsync(path)
    _fsync(os.path.dirname(path) or ".")
