"""Any filesystem fsspec serves (S3, GCS, Azure, ...) as a `Storage`: ranged GETs of at most `MAX_REQUEST` bytes,
whole-object PUTs (multipart past two `PART`s, sent from a local spool file), bounded retries with backoff when the
store throttles, and errors that name the object and the reason with every secret scrubbed (`io/policy.py`)."""

from __future__ import annotations

import contextvars
import errno
import io
import posixpath
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, BinaryIO, TypeVar, cast

from ucp_deepspeed.compat.s3fs import s3_read_into  # a leaf: it imports nothing of this package
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.backend import Storage
from ucp_deepspeed.io.blob import Blob, views_after
from ucp_deepspeed.io.policy import StorageError, scrub, shown
from ucp_deepspeed.io.spread import KEYS, SPREAD, Spread
from ucp_deepspeed.io.stats import record

_T = TypeVar("_T")

RETRIES = 5
"""Attempts after the first for a request a store throttled (503 SlowDown) or dropped; backoff doubles from
`BACKOFF` seconds, jittered down to half, capped at 8 s: at most 7.75 s of waiting per request."""
BACKOFF = 0.25

LEARNED_FOR = 5.0
"""Seconds a folder's placement, looked up outside a load, is trusted before it is looked up again."""

MAX_REQUEST = 8 << 20
"""The largest ranged GET sent to a store: a longer run is split, so that one slow request delays little."""

PART = 50 << 20
"""The part size of an S3 multipart upload (s3fs's own): s3fs sends 10 parts at a time, so an upload holds at most
500 MiB of its file in memory; smaller parts would cost more PUTs of the requests a prefix serves a second."""


class _Listings:
    """The folder listings one `listed` block has taken, by store and folder; `generation` moves at every write, so a
    listing taken before a write is not kept after it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.folders: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
        self.generation = 0

    def forget(self) -> None:
        with self.lock:
            self.folders.clear()
            self.generation += 1


_LISTINGS: ContextVar[_Listings | None] = ContextVar("ucp_store_listings", default=None)


@contextmanager
def listed() -> Iterator[None]:
    """Within the block, a store answers lookups (is there an object, its size, a folder's names) from one listing
    per folder, taken at first use, instead of a HEAD per object: a load reads a finished save, whose objects do not
    change under it, and a HEAD costs a round trip. Reads are not cached, and each is checked; a write or delete in
    the block (`forget_listings` for one made elsewhere) drops the listings taken so far."""
    if _LISTINGS.get() is not None:
        yield
        return
    token = _LISTINGS.set(_Listings())
    try:
        yield
    finally:
        _LISTINGS.reset(token)


def forget_listings() -> None:
    """What the enclosing `listed` block has listed is stale: another rank or process wrote into the store."""
    cache = _LISTINGS.get()
    if cache is not None:
        cache.forget()


def _stamp(info: dict[str, Any]) -> float:
    stamp = info.get("LastModified") or info.get("mtime") or 0
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


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
            "ConnectionClosed",  # botocore: a kept-alive connection the server closed as the request went out
            "ResponseStreamingError",  # botocore: the connection broke while a response body was arriving
            "ServerDisconnected",
            "IncompleteRead",
            "ReadTimeout",
            "reduce your request rate",
        )
    )


class PlacementError(StorageError):
    """A tag folder's keys object (`io/spread.py`) is not one: where its objects are cannot be known."""


class FsspecStorage(Storage):
    """Any filesystem fsspec serves, reached with ranged GETs and whole-object PUTs.

    Credentials come from where the filesystem's own library finds them (for S3: the AWS environment variables,
    `AWS_ENDPOINT_URL` for an S3-compatible store, the AWS config files) and from `options`.

    Paths name objects as a checkpoint sees them; a tag folder spread over key prefixes (`io/spread.py`) keeps its
    objects elsewhere, and every call here maps a path to where its object lives and lists the folder as a whole.
    """

    def __init__(self, protocol: str, options: dict[str, Any]):
        import fsspec  # imported here: a run that never names a URL needs none of it

        self.protocol, self.options = protocol, dict(options)
        self.is_s3 = protocol in ("s3", "s3a")
        kwargs = dict(options)
        if self.is_s3:  # `_call` retries, with its own bound and backoff: no retries under it
            config = dict(kwargs.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})
            kwargs["config_kwargs"] = config
        self.fs = fsspec.filesystem(protocol, skip_instance_cache=True, **kwargs)
        if self.is_s3:
            self.fs.retries = 1
        self._lock = threading.Lock()
        # by tag folder (its key): the placement of a save in progress here, and what the folder's keys object said
        # (None: it has none) when last listed or looked up
        self._saving: dict[str, Spread | None] = {}
        self._learned: dict[str, tuple[Spread | None, float]] = {}

    def _raw(self, path: str) -> str:
        """The key a path names, before placement: a folder's, or an object's outside any spread tag folder."""
        return path.split("://", 1)[1].rstrip("/")

    def _key(self, path: str) -> str:
        """The key of the object `path` names: where its tag folder's placement puts it (`_placement`)."""
        raw = self._raw(path)
        folder, name = posixpath.split(raw)
        if "/" not in folder or name == KEYS:  # a bucket's own objects are never placed: a tag has a parent folder
            return raw
        spread = self._placement(folder)
        return spread.location(folder, name) if spread is not None else raw

    def _placement(self, folder: str) -> Spread | None:
        """A save in progress here says; inside a `listed` block, the block's listing of the folder (taken once);
        outside, the folder's keys object, looked up again once what was learned is `LEARNED_FOR` seconds old (another
        process may have saved the tag again since: a stale placement finds objects missing, never wrong ones, as a
        save deletes an earlier one of the same tag first)."""
        with self._lock:
            if folder in self._saving:
                return self._saving[folder]
        url = f"{self.protocol}://{folder}"
        try:
            if self._folder(url) is None:
                with self._lock:
                    spread, when = self._learned.get(folder, (None, -LEARNED_FOR))
                if time.monotonic() - when < LEARNED_FOR:
                    return spread
                self._learn(folder, self._probe_keys(url))
        except PlacementError:
            raise
        except StorageError as exc:
            # the store failed the lookup: the request for the object itself goes out and fails with its own line;
            # a role denied the keys object reads the folder as unspread
            if "access denied" in exc.reason:
                self._learn(folder, None)
            return None
        with self._lock:
            return self._learned.get(folder, (None, 0.0))[0]

    def _probe_keys(self, folder: str) -> Spread | None:
        """A folder's keys object, read with one GET (absent: None); for folders no listing has shown."""
        path = posixpath.join(folder, KEYS)

        def get() -> bytes | None:
            try:
                return cast(bytes, self.fs.cat_file(self._raw(path)))
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return None

        record(lookups=1)
        data = self._call(path, "looking up", get)
        return None if data is None else self._parse_keys(path, data)

    def _learn(self, folder: str, spread: Spread | None) -> None:
        with self._lock:
            self._learned[folder] = (spread, time.monotonic())

    def _parse_keys(self, path: str, data: bytes) -> Spread:
        try:
            return Spread.from_json(data)
        except ValueError as exc:
            raise PlacementError(shown(path), f"keys object: {exc}") from None

    def place(self, folder: str, spread: Spread | None) -> None:
        """A save into the tag folder `folder` has begun: its objects go where `spread` places them (None: in the
        folder itself), with no lookup, until `unplace`."""
        if spread is not None and "/" not in self._raw(folder):
            raise StorageError(shown(folder), "a bucket is not a tag folder: its objects cannot be spread")
        with self._lock:
            self._saving[self._raw(folder)] = spread

    def unplace(self, folder: str) -> None:
        """The save into `folder` is over: its placement is looked up again (the keys object says)."""
        with self._lock:
            self._saving.pop(self._raw(folder), None)

    def _bucket(self, path: str) -> str:
        return f"{self.protocol}://{self._raw(path).split('/', 1)[0]}"

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
                self._bucket(path), f"access denied while {doing} {shown(path)}: check the credentials ({text})"
            )
        if "NoSuchBucket" in text or "bucket does not exist" in text:
            return StorageError(self._bucket(path), "the bucket does not exist")
        if isinstance(exc, FileNotFoundError):
            return StorageError(shown(path), "object is missing")
        return StorageError(shown(path), f"storage request failed while {doing} it ({text})")

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
        return StoreBlob(self, path)

    def read(self, path: str, limit: int | None = None) -> bytes:
        if limit is not None:
            return super().read(path, limit)
        key = self._key(path)
        data: bytes = self._call(path, "reading", lambda: self.fs.cat_file(key))
        record(files=1, requests=1, metadata=len(data))
        return data

    def write(self, path: str, data: bytes | memoryview) -> None:
        key = self._key(path)
        try:
            self._call(path, "writing", lambda: self.fs.pipe_file(key, bytes(data)))
        finally:
            forget_listings()
            self._forget_keys(path)
        record(writes=1, written=len(data))

    @contextmanager
    def writer(self, path: str) -> Iterator[BinaryIO]:
        # spooled to a local temporary file (`TMPDIR`), not held in memory: a rank's optimizer file can be as large as
        # its share of the model's states; a streamed multipart upload could not be sent again when the store throttles
        with tempfile.NamedTemporaryFile(prefix="ucp-upload-") as spool:
            yield cast(BinaryIO, spool)
            size = spool.seek(0, io.SEEK_END)
            spool.flush()
            key = self._key(path)
            try:
                self._call(path, "writing", lambda: self._put_file(spool.name, key, size))
            finally:
                forget_listings()
                self._forget_keys(path)
        record(writes=1, written=size)

    def _forget_keys(self, path: str) -> None:
        """A keys object written or deleted: its folder's placement is looked up again at next use."""
        folder, name = posixpath.split(self._raw(path))
        if name == KEYS:
            with self._lock:
                self._learned.pop(folder, None)

    def _put_file(self, local: str, key: str, size: int) -> None:
        """Upload a local file whole to `key`: one PUT, or (S3, past two parts) a multipart upload that s3fs aborts on
        error, so that the object appears only complete."""
        if self.is_s3:
            # S3 takes at most 10,000 parts
            self.fs.put_file(local, key, chunksize=max(PART, -(-size // 10_000)))
        else:
            self.fs.put_file(local, key)

    def _ls(self, path: str, detail: bool) -> list[Any]:
        """One listing of a prefix (`fs.ls`); a prefix with nothing under it is empty, a missing bucket an error."""

        def ls() -> list[Any]:
            try:
                found: list[Any] = self.fs.ls(self._raw(path), detail=detail, refresh=True)
                return found
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return []

        record(lookups=1)
        return self._call(path, "listing", ls)

    def _folder(self, folder: str) -> dict[str, dict[str, Any]] | None:
        """A folder's entries by name from the enclosing `listed` block's listing of it (taken now if not yet); None
        outside such a block, or where listing it is denied (a role that may read objects but not list there)."""
        cache = _LISTINGS.get()
        if cache is None:
            return None
        key = (id(self), folder)
        with cache.lock:
            entries, generation = cache.folders.get(key), cache.generation
        if entries is not None:
            return entries
        try:
            entries = self._merged(folder)
        except StorageError as exc:
            if "access denied" in exc.reason:
                return None
            raise
        with cache.lock:
            if cache.generation == generation:
                cache.folders[key] = entries
        return entries

    def _merged(self, folder: str) -> dict[str, dict[str, Any]]:
        """A folder's entries by name. A spread tag folder lists what reads reach: its keys object, its sub-folders,
        and from each prefix (one listing each, side by side) the objects its keys object places there; an object
        anywhere else (another prefix, the tag folder itself) is not the tag's, and is not listed."""
        raw = self._raw(folder)
        entries = {posixpath.basename(e["name"].rstrip("/")): e for e in self._ls(folder, detail=True)}
        keys = entries.get(KEYS)
        spread = None
        if "/" in raw and keys is not None and keys.get("type") == "file":
            path = posixpath.join(folder, KEYS)
            spread = self._parse_keys(path, self.read(path))
        self._learn(raw, spread)
        if spread is None:
            return entries
        entries = {n: e for n, e in entries.items() if n == KEYS or e.get("type") != "file"}
        for prefix, found in self._prefix_listings(spread.folders(raw)).items():
            for entry in found:
                name = posixpath.basename(entry["name"].rstrip("/"))
                if entry.get("type") == "file" and spread.prefix(name) == prefix and name not in entries:
                    entries[name] = entry
        return entries

    def _prefix_listings(self, folders: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
        """Each prefix's listing of its folder (prefix -> folder key), side by side."""
        if not folders:
            return {}
        with ThreadPoolExecutor(min(16, len(folders)), thread_name_prefix="ucp-list") as pool:
            listings = {
                p: pool.submit(contextvars.copy_context().run, self._ls, f"{self.protocol}://{sub}", True)
                for p, sub in folders.items()
            }
            return {p: listing.result() for p, listing in listings.items()}

    def _listed(self, path: str) -> dict[str, Any] | None:
        """What its folder's listing says of `path` inside a `listed` block: its entry, or {} when the folder does
        not list it; None outside such a block (or for a bucket, or where listing is denied)."""
        parent, name = posixpath.split(self._raw(path))
        if not parent:  # a bucket: looked up as always
            return None
        entries = self._folder(f"{self.protocol}://{parent}")
        return None if entries is None else dict(entries.get(name) or {})

    def listdir(self, path: str) -> list[str]:
        entries = self._folder(path.rstrip("/"))
        if entries is not None:
            return sorted(entries)
        return sorted(self._merged(path))

    def sizes(self, path: str) -> dict[str, int]:
        return {name: int(e["size"]) for name, e in self._merged(path).items() if e.get("type") == "file"}

    def find(self, path: str) -> list[str]:
        key = self._raw(path) + "/"
        record(lookups=1)
        found = self._call(path, "listing", lambda: self.fs.find(key, withdirs=False))
        names = {p[len(key) :] for p in found if p.startswith(key)}
        if KEYS in names:  # a spread tag folder: its objects live under their prefixes
            names |= {n for n, e in self._merged(path).items() if e.get("type") == "file"}
        return sorted(names)

    def stat(self, path: str) -> tuple[int, int]:
        # always a HEAD: a listing's time may carry another precision than a HEAD's (MinIO's has milliseconds), and
        # a conversion's fingerprint, recorded from HEADs, compares them
        record(lookups=1)
        key = self._key(path)
        info = self._call(path, "looking up", lambda: self.fs.info(key, refresh=True))
        return int(info["size"]), int(_stamp(info) * 1e9)

    def exists(self, path: str) -> bool:
        return self.isfile(path) or self.isdir(path)

    def isfile(self, path: str) -> bool:
        info = self._listed(path)
        if info is not None:
            return info.get("type") == "file"

        key = self._key(path)

        def probe() -> bool:
            try:
                return bool(self.fs.info(key, refresh=True).get("type") == "file")
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return False

        record(lookups=1)
        return self._call(path, "looking up", probe)

    def isdir(self, path: str) -> bool:
        try:
            entries = self._folder(path.rstrip("/"))  # its own listing, which the lookups inside it use next
        except PlacementError:
            return True  # a tag folder whose keys object is bad: there, and what it holds unknown
        return bool(entries) if entries is not None else bool(self._ls(path, detail=False))

    def mtime(self, path: str) -> float:
        if not self.isfile(path):
            return 0.0
        info = self._listed(path)
        if info is not None:
            return _stamp(info)
        key = self._key(path)
        record(lookups=1)
        return self._call(path, "looking up", lambda: _stamp(self.fs.info(key)))

    def delete(self, path: str) -> None:
        try:
            self._delete(path)
        finally:
            forget_listings()

    def _delete(self, path: str) -> None:
        if self.isfile(path):
            key = self._key(path)
            self._call(path, "deleting", lambda: self.fs.rm_file(key))
            self._forget_keys(path)
        elif self.isdir(path):
            folder = self._raw(path)
            names = {posixpath.basename(e.rstrip("/")) for e in self._ls(path, detail=False)}
            if KEYS in names and "/" in folder:
                # a spread tag's objects first, while its keys object still marks the folder as one; every prefix
                # beside it is looked in, whatever the keys object says (it may be what is wrong)
                parent, tag = posixpath.split(folder)
                found = self._ls(f"{self.protocol}://{posixpath.join(parent, SPREAD)}", detail=False)
                prefixes = {
                    p: posixpath.join(parent, SPREAD, p, tag)
                    for p in (posixpath.basename(e.rstrip("/")) for e in found)
                }
                spread = [e["name"] for found in self._prefix_listings(prefixes).values() for e in found]
                if spread:
                    self._call(path, "deleting", lambda: self.fs.rm(spread, recursive=True))
            self._call(path, "deleting", lambda: self.fs.rm(folder, recursive=True))
            self._learn(folder, None)

    def cat_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object: one ranged GET."""
        key = self._key(path)
        data: bytes = self._call(path, "reading", lambda: self.fs.cat_file(key, start=start, end=end))
        return data

    def receive(self, path: str, start: int, views: list[memoryview], data: bool = True) -> None:
        """Bytes of an object from `start` into `views`, filled whole: one ranged GET. On S3 the response is received
        straight into them (`compat.s3fs.s3_read_into`); elsewhere it arrives as one `bytes`, copied into them."""
        want = sum(len(v) for v in views)
        if self.is_s3:
            key = self._key(path)
            got = self._call(path, "reading", lambda: s3_read_into(self.fs, key, start, views))
            record(requests=1, **{"data" if data else "metadata": got})
        else:
            body = self.cat_range(path, start, start + want)
            got = len(body)
            record(requests=1, copied=got if data else 0, **{"data" if data else "metadata": got})
            at = 0
            for view in views:
                n = min(len(view), got - at)
                view[:n] = body[at : at + n]
                at += n
        if got < want:
            raise CheckpointError(shown(path), f"truncated: the object ends before byte {start + want}")

    def size(self, path: str) -> int:
        """An object's length (one HEAD, or the folder's listing inside a `listed` block)."""
        info = self._listed(path)
        if info is not None and info.get("type") == "file":
            return int(info["size"])
        key = self._key(path)
        record(lookups=1)
        return int(self._call(path, "opening", lambda: self.fs.info(key)["size"]))


class StoreBlob(Blob):
    """An object in a store, read by ranged GETs; it holds nothing open, and its size costs one HEAD on first use."""

    concurrency = 16
    request_size = MAX_REQUEST

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
        for done in range(0, total, MAX_REQUEST):
            out, left = [], min(MAX_REQUEST, total - done)
            for view in views_after(views, done):
                if not left:
                    break
                out.append(view[: min(len(view), left)])
                left -= len(out[-1])
            self._store.receive(self.path, offset + done, out, data)
