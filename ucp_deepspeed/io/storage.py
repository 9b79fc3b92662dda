"""Where checkpoint bytes live: one call per operation on any location, local path or object-store URL alike.

Every file a checkpoint holds is named by a *location*: a local path, or a URL of any filesystem fsspec serves
(`s3://bucket/run/global_step10/mp_rank_00_model_states.pt`, `gs://`, `az://`, ...). `storage_of(location)` picks
the backend; the module-level functions below do the same per call, so callers never branch on the kind.

The rooms behind this one: `io/backend.py` (the `Storage` interface and the order a checkpoint calls it in),
`io/blob.py` (ranged reads of one object), `io/local.py` and `io/remote.py` (the local filesystem; any fsspec URL),
`io/policy.py` (URLs that carry credentials are refused, errors are scrubbed of secrets).
"""

from __future__ import annotations

import contextvars
import fnmatch
import hashlib
import os
import posixpath
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, BinaryIO

from ucp_deepspeed.io.atomic import make_durable as atomic_make_durable
from ucp_deepspeed.io.atomic import rename_durably
from ucp_deepspeed.io.backend import Storage
from ucp_deepspeed.io.blob import Blob, BlobFile, Closeable, Window
from ucp_deepspeed.io.local import LocalStorage, append, holds_parts, lock_folder
from ucp_deepspeed.io.policy import SCHEME, StorageError, check_url, is_url, scrub, shown
from ucp_deepspeed.io.remote import MAX_REQUEST, FsspecStorage, PlacementError, forget_listings, listed
from ucp_deepspeed.io.spread import Spread

__all__ = [
    "MAX_REQUEST",
    "Blob",
    "BlobFile",
    "Closeable",
    "FsspecStorage",
    "LocalStorage",
    "PlacementError",
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
    "forget_listings",
    "glob",
    "in_parts",
    "is_url",
    "isdir",
    "isfile",
    "islink",
    "join",
    "listdir",
    "listed",
    "local_path",
    "locked",
    "make_durable",
    "makedirs",
    "mtime",
    "normalize",
    "open_blob",
    "place",
    "read",
    "read_text",
    "realpath",
    "scrub",
    "set_default_options",
    "size",
    "stat",
    "storage_of",
    "storage_options",
    "unplace",
    "write",
    "writer",
]

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


def place(tag_dir: str, spread: Spread | None) -> None:
    """A save into `tag_dir` has begun: on a store, its objects go over key prefixes (`io/spread.py`), or into the
    folder itself (None), with no lookup, until `unplace`; a local folder is never spread."""
    store = storage_of(tag_dir)
    if isinstance(store, FsspecStorage):
        store.place(tag_dir, spread)


def unplace(tag_dir: str) -> None:
    """The save into `tag_dir` is over (committed or failed)."""
    store = storage_of(tag_dir)
    if isinstance(store, FsspecStorage):
        store.unplace(tag_dir)


def storage_of(location: str) -> Storage:
    """The backend that serves a location; a URL whose scheme no installed fsspec filesystem serves is refused."""
    location = str(location)
    match = SCHEME.match(location)
    if not match or match.group(1) == "file":
        return _LOCAL
    check_url(location)
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
                    shown(location), f"the '{protocol}' scheme needs a package that is not installed ({exc})"
                ) from None
            except (ValueError, ModuleNotFoundError):
                raise StorageError(
                    shown(location),
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
    with open_blob(source) as src, store.writer(dest) as out:
        for start in range(0, src.size, MAX_REQUEST):
            out.write(src.read(start, min(MAX_REQUEST, src.size - start), data=True))


def glob(folder: str, pattern: str) -> list[str]:
    """The objects directly inside `folder` whose names match a shell pattern, sorted."""
    return [join(folder, name) for name in listdir(folder) if fnmatch.fnmatchcase(name, pattern)]


def locked(folder: str, holder: str = "process") -> AbstractContextManager[None]:
    """Hold an exclusive lock on a local folder while the block runs (a second `holder` waits, saying so); a store has
    no locks, so there the block runs unguarded and what makes its output complete is an object written last."""
    path = local_path(folder)
    return nullcontext() if path is None else lock_folder(path, folder, holder)


def append_line(location: str, line: str) -> bool:
    """Append a line to a local file (not fsynced); False on a store, which cannot append."""
    path = local_path(location)
    if path is None:
        return False
    append(path, line)
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
    with open_blob(location) as blob:
        return blob.size


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


def make_durable(location: str) -> None:
    """Fsync a local file written by someone else, and its folder (`atomic.make_durable`); a store's objects are
    durable once acknowledged."""
    path = local_path(location)
    if path is not None:
        atomic_make_durable(path)


def in_parts(location: str) -> bool:
    """Whether a folder holds files stored only under FastPersist's part names (`io/local.py`), which every read here
    finds by their names and DeepSpeed's own load does not."""
    path = local_path(location)
    return path is not None and holds_parts(path)


def rename_local(source: str, dest: str) -> None:
    """Rename a local file or folder within its folder, durably (`atomic.rename_durably`): a store has no rename, and a
    caller that keeps an older save aside does so on disk only."""
    found, target = local_path(source), local_path(dest)
    if found is None or target is None:
        raise StorageError(shown(source), "an object store cannot rename; only a local path can")
    rename_durably(found, target)
