"""Where checkpoint bytes live: a local filesystem or an object store, behind one small interface.

Every file a checkpoint holds is named by a *location*: a local path, or a URL of any filesystem fsspec serves
(`s3://bucket/run/global_step10/mp_rank_00_model_states.pt`, `gs://`, `az://`, ...). `storage_of(location)` picks
the backend; the module-level functions below do the same per call, so callers never branch on the kind.

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

Credentials never reach this module's messages: a URL that carries them is refused without repeating it, and every
error from a store is scrubbed of the secret values it could hold before it is raised.
"""

from __future__ import annotations

import abc
import contextvars
import errno
import fnmatch
import hashlib
import io
import logging
import os
import posixpath
import random
import re
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, BinaryIO, TypeVar

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.atomic import atomic_file, atomic_write
from ucp_deepspeed.io.stats import record

__all__ = [
    "BACKOFF",
    "MAX_REQUEST",
    "RETRIES",
    "Blob",
    "BlobFile",
    "FsspecStorage",
    "LocalStorage",
    "Storage",
    "StorageError",
    "Window",
    "append_line",
    "basename",
    "copy",
    "delete",
    "dirname",
    "exists",
    "find",
    "glob",
    "is_url",
    "isdir",
    "isfile",
    "islink",
    "join",
    "listdir",
    "local_path",
    "locked",
    "makedirs",
    "mtime",
    "normalize",
    "open_blob",
    "read",
    "read_text",
    "realpath",
    "scrub",
    "set_default_options",
    "size",
    "stat",
    "storage_of",
    "storage_options",
    "write",
    "writer",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SECRET_QUERY = re.compile(r"(secret|token|signature|password|credential|sig|key)", re.IGNORECASE)
_T = TypeVar("_T")

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)

RETRIES = 5
"""Attempts after the first for a request a store throttled (503 SlowDown) or dropped; backoff doubles from
`BACKOFF` seconds, jittered down to half, capped at 8 s: at most 7.75 s of waiting per request."""
BACKOFF = 0.25


class StorageError(CheckpointError):
    """A storage operation failed (unreachable, refused, missing bucket); names the object, never a secret."""


def is_url(location: str) -> bool:
    """Whether a location is a URL (`scheme://...`) rather than a local path; `file://` counts as a URL."""
    return bool(_SCHEME.match(str(location)))


def _shown(location: str) -> str:
    """A location as it may appear in a message: any user info and query removed."""
    parts = urllib.parse.urlsplit(location)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def _check_url(location: str) -> None:
    """Refuse a URL that carries credentials: they would reach logs, metadata and every error message."""
    parts = urllib.parse.urlsplit(location)
    userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    if userinfo or any(_SECRET_QUERY.search(k) for k, _ in urllib.parse.parse_qsl(parts.query)):
        raise StorageError(
            _shown(location),
            "the URL carries credentials, which are refused (they would reach logs and errors); give them through "
            "the AWS environment variables or config files, or the `storage_options` config key",
        )


# Secret values the process knows of: every error raised from a store is scrubbed of them.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AZURE_STORAGE_KEY")
_SECRET_OPTION = re.compile(r"(secret|token|key|password|credential)", re.IGNORECASE)


def _secrets(options: dict[str, Any]) -> list[str]:
    found = [os.environ.get(name, "") for name in _SECRET_ENV]

    def walk(obj: Any, secret: bool = False) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, secret or bool(_SECRET_OPTION.search(str(k))))
        elif isinstance(obj, str) and secret:
            found.append(obj)

    walk(options)
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)


def scrub(text: str, options: dict[str, Any] | None = None) -> str:
    """`text` with every secret value known to the process replaced by `***`."""
    for secret in _secrets(options or {}):
        text = text.replace(secret, "***")
    return text


class Blob(abc.ABC):
    """One stored object opened for ranged reads."""

    path: str
    concurrency = 1
    """How many of its requests a reader may have in flight at once."""

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

    def close(self) -> None:  # noqa: B027 - a store's blob holds nothing open
        """Release what the blob holds open."""


class Window(Blob):
    """Bytes `[start, start + length)` of another blob, read as a blob of their own: one item of a file that packs
    several (a DCP `.distcp` file). Its owner closes the blob underneath."""

    def __init__(self, blob: Blob, start: int, length: int, path: str):
        if start < 0 or length < 0 or start + length > blob.size:
            raise CheckpointError(blob.path, f"truncated: an item at bytes {start}..{start + length} is past its end")
        self._blob, self._start, self._length, self.path = blob, start, length, path
        self.concurrency = blob.concurrency

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


def _after(views: list[memoryview], skip: int) -> list[memoryview]:
    out = []
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        out.append(view[skip:])
        skip = 0
    return out


class _LocalBlob(Blob):
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

    def fileno(self) -> int:
        """The descriptor, for readers that hand it to the OS directly."""
        return self._fd

    def readinto(self, views: list[memoryview], offset: int, data: bool = True) -> None:
        for first in range(0, len(views), _IOV_MAX):
            batch = [v for v in views[first : first + _IOV_MAX] if len(v)]
            total = sum(len(v) for v in batch)
            if not total:
                continue
            record(requests=1, **{"data" if data else "metadata": total})
            done = 0
            while done < total:
                got = os.preadv(self._fd, _after(batch, done), offset + done)
                if got <= 0:
                    raise CheckpointError(self.path, f"truncated: nothing to read at byte {offset + done}")
                done += got
            offset += total

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


class Storage(abc.ABC):
    """A place checkpoint objects live; see the module docstring for the call order."""

    @abc.abstractmethod
    def open(self, path: str) -> Blob:
        """An object opened for ranged reads; a missing one is a `CheckpointError` naming it."""

    def read(self, path: str, limit: int | None = None) -> bytes:
        """A whole (small) object; one larger than `limit` bytes is refused unread."""
        blob = self.open(path)
        record(files=1)
        try:
            if limit is not None and blob.size > limit:
                raise CheckpointError(path, f"is {blob.size} bytes, larger than the {limit} such a file may hold")
            return blob.read(0, blob.size)
        finally:
            blob.close()

    @abc.abstractmethod
    def write(self, path: str, data: bytes | memoryview) -> None:
        """Write a whole object: it appears only complete, and is durable when this returns."""

    @abc.abstractmethod
    def writer(self, path: str) -> AbstractContextManager[BinaryIO]:
        """A file to stream one object into: it appears only if the block succeeds (then as `write`)."""

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


class LocalStorage(Storage):
    """The local filesystem: `preadv` on a descriptor, atomic writes by fsync and rename."""

    def open(self, path: str) -> Blob:
        return _LocalBlob(path)

    def write(self, path: str, data: bytes | memoryview) -> None:
        atomic_write(path, data)
        record(writes=1, written=len(data))

    def writer(self, path: str) -> AbstractContextManager[BinaryIO]:
        return atomic_file(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path)) if os.path.isdir(path) else []

    def sizes(self, path: str) -> dict[str, int]:
        if not os.path.isdir(path):
            return {}
        with os.scandir(path) as entries:
            return {e.name: e.stat().st_size for e in entries if e.is_file()}

    def find(self, path: str) -> list[str]:
        return sorted(
            os.path.relpath(os.path.join(folder, name), path) for folder, _, names in os.walk(path) for name in names
        )

    def stat(self, path: str) -> tuple[int, int]:
        found = os.stat(path)
        return found.st_size, found.st_mtime_ns

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

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
        atomic_write(path, data)
        folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself is durable: a crash cannot undo a commit that returned
        finally:
            os.close(folder)


def _retryable(exc: BaseException) -> bool:
    """A throttled or dropped request, worth sending again: s3fs turns 503 SlowDown and ServiceUnavailable into EBUSY;
    botocore's and aiohttp's other names are matched without importing them."""
    if isinstance(exc, OSError) and exc.errno in (errno.EBUSY, errno.ETIMEDOUT, errno.EAGAIN):
        return True
    text = f"{type(exc).__name__} {exc}"
    return any(
        mark in text
        for mark in (
            "SlowDown",
            "503",
            "ServiceUnavailable",
            "RequestTimeout",
            "Throttl",
            "ConnectionReset",
            "ServerDisconnected",
            "IncompleteRead",
            "ReadTimeout",
            "reduce your request rate",
        )
    )


class FsspecStorage(Storage):
    """Any filesystem fsspec serves, reached with ranged GETs and whole-object PUTs.

    Credentials come from where the filesystem's own library finds them (for S3: the AWS environment variables,
    `AWS_ENDPOINT_URL` for an S3-compatible store, the AWS config files) and from `options`.
    """

    def __init__(self, protocol: str, options: dict[str, Any]):
        import fsspec  # imported here: a run that never names a URL needs none of it

        self.protocol, self.options = protocol, dict(options)
        kwargs = dict(options)
        if protocol in ("s3", "s3a"):  # `_call` retries, with its own bound and backoff: no retries under it
            config = dict(kwargs.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})
            kwargs["config_kwargs"] = config
        self.fs = fsspec.filesystem(protocol, skip_instance_cache=True, **kwargs)
        if protocol in ("s3", "s3a"):
            self.fs.retries = 1

    def _key(self, path: str) -> str:
        return path.split("://", 1)[1]

    def _bucket(self, path: str) -> str:
        return f"{self.protocol}://{self._key(path).split('/', 1)[0]}"

    def _error(self, path: str, exc: BaseException, doing: str) -> StorageError:
        """One clear line for a failed request: the object (or bucket) and the reason, no secret."""
        text = scrub(f"{type(exc).__name__}: {exc}", self.options)[:300]
        if (
            isinstance(exc, PermissionError)
            or "AccessDenied" in text
            or "InvalidAccessKeyId" in text
            or "Forbidden" in text
        ):
            return StorageError(
                self._bucket(path), f"access denied while {doing} {_shown(path)}: check the credentials ({text})"
            )
        if "NoSuchBucket" in text or "bucket does not exist" in text:
            return StorageError(self._bucket(path), "the bucket does not exist")
        if isinstance(exc, FileNotFoundError):
            return StorageError(_shown(path), "object is missing")
        return StorageError(_shown(path), f"storage request failed while {doing} it ({text})")

    def _call(self, path: str, doing: str, fn: Callable[[], _T]) -> _T:
        """`fn()`, retried with backoff while the store throttles or drops the request; errors named (see `_error`)."""
        for attempt in range(RETRIES + 1):
            try:
                return fn()
            except Exception as exc:  # every fsspec backend raises its own types
                if attempt < RETRIES and _retryable(exc) and not isinstance(exc, FileNotFoundError):
                    time.sleep(min(8.0, BACKOFF * 2**attempt) * (0.5 + random.random() / 2))
                    continue
                raise self._error(path, exc, doing) from None
        raise AssertionError("unreachable")

    def open(self, path: str) -> Blob:
        return _StoreBlob(self, path)

    def read(self, path: str, limit: int | None = None) -> bytes:
        if limit is not None:
            return super().read(path, limit)
        data = self._call(path, "reading", lambda: self.fs.cat_file(self._key(path)))
        record(files=1, requests=1, metadata=len(data))
        return data

    def write(self, path: str, data: bytes | memoryview) -> None:
        self._call(path, "writing", lambda: self.fs.pipe_file(self._key(path), bytes(data)))
        record(writes=1, written=len(data))

    @contextmanager
    def writer(self, path: str) -> Iterator[BinaryIO]:  # type: ignore[override]
        # held in memory and sent whole: a streamed multipart upload would publish a partial object on error
        buffer = io.BytesIO()
        yield buffer
        self.write(path, buffer.getbuffer())

    def listdir(self, path: str) -> list[str]:
        def ls() -> list[str]:
            try:
                return self.fs.ls(self._key(path), detail=False, refresh=True)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return []

        return sorted({posixpath.basename(p.rstrip("/")) for p in self._call(path, "listing", ls)})

    def sizes(self, path: str) -> dict[str, int]:
        def ls() -> list[dict[str, Any]]:
            try:
                return self.fs.ls(self._key(path), detail=True, refresh=True)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return []

        return {
            posixpath.basename(e["name"].rstrip("/")): int(e["size"])
            for e in self._call(path, "listing", ls)
            if e.get("type") == "file"
        }

    def find(self, path: str) -> list[str]:
        key = self._key(path).rstrip("/") + "/"
        found = self._call(path, "listing", lambda: self.fs.find(key, withdirs=False))
        return sorted(p[len(key) :] for p in found if p.startswith(key))

    def stat(self, path: str) -> tuple[int, int]:
        info = self._call(path, "looking up", lambda: self.fs.info(self._key(path), refresh=True))
        stamp = info.get("LastModified") or info.get("mtime") or 0
        seconds = stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)
        return int(info["size"]), int(seconds * 1e9)

    def exists(self, path: str) -> bool:
        return self.isfile(path) or self.isdir(path)

    def isfile(self, path: str) -> bool:
        def probe() -> bool:
            try:
                return self.fs.info(self._key(path), refresh=True).get("type") == "file"
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return False

        return self._call(path, "looking up", probe)

    def isdir(self, path: str) -> bool:
        return bool(self.listdir(path))

    def mtime(self, path: str) -> float:
        def probe() -> float:
            info = self.fs.info(self._key(path))
            stamp = info.get("LastModified") or info.get("mtime") or 0
            return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)

        return self._call(path, "looking up", probe) if self.isfile(path) else 0.0

    def delete(self, path: str) -> None:
        key = self._key(path)
        if self.isfile(path):
            self._call(path, "deleting", lambda: self.fs.rm_file(key))
        elif self.isdir(path):
            self._call(path, "deleting", lambda: self.fs.rm(key, recursive=True))

    def cat_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object: one ranged GET."""
        return self._call(path, "reading", lambda: self.fs.cat_file(self._key(path), start=start, end=end))

    def size(self, path: str) -> int:
        """An object's length (one HEAD)."""
        return int(self._call(path, "opening", lambda: self.fs.info(self._key(path))["size"]))


MAX_REQUEST = 8 << 20
"""The largest ranged GET sent to a store: a longer run is split, so that one slow request delays little."""


class _StoreBlob(Blob):
    concurrency = 16

    def __init__(self, store: FsspecStorage, path: str):
        self.path, self._store = path, store
        self._size: int | None = None

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = self._store.size(self.path)
        return self._size

    def readinto(self, views: list[memoryview], offset: int, data: bool = True) -> None:
        total = sum(len(v) for v in views)
        done = 0
        while done < total:
            want = min(MAX_REQUEST, total - done)
            got = self._store.cat_range(self.path, offset + done, offset + done + want)
            record(requests=1, copied=len(got) if data else 0, **{"data" if data else "metadata": len(got)})
            if len(got) < want:
                raise CheckpointError(
                    _shown(self.path), f"truncated: the object ends before byte {offset + done + want}"
                )
            at = 0
            for view in _after(views, done):
                n = min(len(view), len(got) - at)
                view[:n] = got[at : at + n]
                at += n
                if at == len(got):
                    break
            done += want


_OPTIONS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("ucp_storage_options", default=None)
_DEFAULT_OPTIONS: dict[str, Any] = {}
_STORES: dict[tuple[str, str], FsspecStorage] = {}
_REACH_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
_LOCK = threading.Lock()
_LOCAL = LocalStorage()


@contextmanager
def storage_options(options: dict[str, Any] | None) -> Iterator[None]:
    """Pass `options` to the fsspec filesystem of every URL used inside the block (the `storage_options` key)."""
    token = _OPTIONS.set(dict(options or {}))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def set_default_options(options: dict[str, Any] | None) -> None:
    """Make `options` the process's storage options outside any `storage_options` block (an engine's config)."""
    _DEFAULT_OPTIONS.clear()
    _DEFAULT_OPTIONS.update(options or {})


def storage_of(location: str) -> Storage:
    """The backend that serves a location; a URL whose scheme no installed fsspec filesystem serves is refused."""
    location = str(location)
    match = _SCHEME.match(location)
    if not match or match.group(1) == "file":
        return _LOCAL
    _check_url(location)
    protocol = match.group(1).lower()
    options = _OPTIONS.get()
    options = _DEFAULT_OPTIONS if options is None else options
    # the environment picks the endpoint and credentials: a changed one is another store (a hash: no secret kept)
    reach = hashlib.sha256(repr([os.environ.get(k) for k in _REACH_ENV]).encode()).hexdigest()
    key = (protocol, repr(sorted(options.items())) + reach)
    with _LOCK:
        store = _STORES.get(key)
        if store is None:
            try:
                import fsspec

                fsspec.get_filesystem_class(protocol)
            except ImportError as exc:
                raise StorageError(
                    _shown(location), f"the '{protocol}' scheme needs a package that is not installed ({exc})"
                ) from None
            except (ValueError, ModuleNotFoundError):
                raise StorageError(
                    _shown(location),
                    f"'{protocol}://' is not a storage scheme fsspec knows; give a local path or a URL such as "
                    "s3://bucket/prefix",
                ) from None
            store = _STORES[key] = FsspecStorage(protocol, options)
    return store


def normalize(location: str) -> str:
    """A location in the one form the rest of the code compares: an absolute local path, or a checked URL without
    a trailing slash (`file://` becomes a path)."""
    location = os.fspath(location)
    if location.startswith("file://"):
        return os.path.abspath(location[len("file://") :])
    if is_url(location):
        storage_of(location)
        return location.rstrip("/")
    return os.path.abspath(location)


def local_path(location: str) -> str | None:
    """The local path a location names, or None for an object-store URL."""
    location = os.fspath(location)
    if location.startswith("file://"):
        return location[len("file://") :]
    return None if is_url(location) else location


def join(base: str, *parts: str) -> str:
    """`os.path.join` for a path, `/`-joined for a URL."""
    return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def dirname(location: str) -> str:
    """The folder a location is in."""
    if is_url(location):
        scheme, rest = location.split("://", 1)
        return f"{scheme}://{posixpath.dirname(rest.rstrip('/'))}"
    return os.path.dirname(location)


def basename(location: str) -> str:
    """The last part of a location."""
    return posixpath.basename(location.rstrip("/")) if is_url(location) else os.path.basename(location)


def realpath(location: str) -> str:
    """A location in a form two names of one object share (symlinks resolved on disk)."""
    return location.rstrip("/") if is_url(location) else os.path.realpath(location)


def open_blob(location: str) -> Blob:
    """`Storage.open` of the location's backend."""
    return storage_of(location).open(location)


def read(location: str, limit: int | None = None) -> bytes:
    """`Storage.read` of the location's backend."""
    return storage_of(location).read(location, limit)


def islink(location: str) -> bool:
    """Whether a local path is a symbolic link (a store has none)."""
    path = local_path(location)
    return path is not None and os.path.islink(path)


def read_text(location: str) -> str:
    """A whole small object, decoded as UTF-8."""
    return read(location).decode("utf-8")


def write(location: str, data: bytes | memoryview | str) -> None:
    """`Storage.write` of the location's backend."""
    storage_of(location).write(location, data.encode("utf-8") if isinstance(data, str) else data)


def writer(location: str) -> AbstractContextManager[BinaryIO]:
    """`Storage.writer` of the location's backend."""
    return storage_of(location).writer(location)


def copy(source: str, dest: str) -> None:
    """Copy one object, whole and checked by nothing: for files whose own checks travel with them."""
    store = storage_of(dest)
    src = open_blob(source)
    try:
        with store.writer(dest) as out:
            for start in range(0, src.size, MAX_REQUEST):
                out.write(src.read(start, min(MAX_REQUEST, src.size - start), data=True))
    finally:
        src.close()


def glob(folder: str, pattern: str) -> list[str]:
    """The objects directly inside `folder` whose names match a shell pattern, sorted."""
    return [join(folder, name) for name in listdir(folder) if fnmatch.fnmatchcase(name, pattern)]


@contextmanager
def locked(folder: str, holder: str = "process") -> Iterator[None]:
    """Hold an exclusive lock on a local folder while the block runs (a second `holder` waits, saying so); a store has
    no locks, so there the block runs unguarded and what makes its output complete is an object written last."""
    path = local_path(folder)
    if path is None:
        yield
        return
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger("ucp_deepspeed").warning(
                "ucp: %s is being written by another %s; waiting for it to finish", folder, holder
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def append_line(location: str, line: str) -> bool:
    """Append a line to a local file (not fsynced); False on a store, which cannot append."""
    path = local_path(location)
    if path is None:
        return False
    with open(path, "a") as f:
        f.write(line)
    return True


def listdir(location: str) -> list[str]:
    """`Storage.listdir` of the location's backend."""
    return storage_of(location).listdir(location)


def exists(location: str) -> bool:
    """`Storage.exists` of the location's backend."""
    return storage_of(location).exists(location)


def isfile(location: str) -> bool:
    """`Storage.isfile` of the location's backend."""
    return storage_of(location).isfile(location)


def size(location: str) -> int:
    """An object's length in bytes."""
    blob = open_blob(location)
    try:
        return blob.size
    finally:
        blob.close()


def find(location: str) -> list[str]:
    """`Storage.find` of the location's backend."""
    return storage_of(location).find(location)


def stat(location: str) -> tuple[int, int]:
    """`Storage.stat` of the location's backend."""
    return storage_of(location).stat(location)


def isdir(location: str) -> bool:
    """`Storage.isdir` of the location's backend."""
    return storage_of(location).isdir(location)


def mtime(location: str) -> float:
    """`Storage.mtime` of the location's backend."""
    return storage_of(location).mtime(location)


def delete(location: str) -> None:
    """`Storage.delete` of the location's backend."""
    storage_of(location).delete(location)


def makedirs(location: str) -> None:
    """`Storage.makedirs` of the location's backend."""
    storage_of(location).makedirs(location)
