"""Read a `torch.save` zip archive lazily and safely: parse the pickle, read tensor bytes on demand.

`torch.load` materialises every tensor of a file, and it runs whatever code the pickle names.
Here the pickle is parsed by `safe_pickle.SafeUnpickler` (no code from the file runs) and each
tensor comes back as a `LazyTensor` that knows where its bytes sit inside the archive; a read of
an element range is one `pread`.

Every read is checked. A zip directory holds a CRC-32 per record; each read computes the CRC of
the bytes it got, and `check_reads` assembles those pieces per record (reading only bytes that no
read covered, such as padding) and compares them with the directory. The archive may also carry
a save id (`.data/ucp_save_id`, see `stamp`) that binds it to the other files of one save.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import functools
import io
import math
import mmap
import os
import struct
import threading
import types
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.checksum import combine_pieces, crc32
from ucp_deepspeed.io.safe_pickle import PickledObject, SafeUnpickler, StorageType, TensorType, UnsafePickle
from ucp_deepspeed.io.stats import record
from ucp_deepspeed.io.storage import Blob, BlobFile, Closeable, open_blob

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header, 30 bytes
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # zip central directory entry, 46 bytes
_END = struct.Struct("<4s4H2LH")  # end of central directory, 22 bytes
_END64_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator, 20 bytes
_END64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory, 56 bytes
_DESCRIPTOR = b"PK\x07\x08"
_CHUNK = 1 << 24
SAVE_ID_RECORD = ".data/ucp_save_id"


@dataclass(frozen=True)
class LazyTensor:
    """A tensor stored in a torch zip file, described by where its bytes are, not loaded."""

    file: TorchFile = field(repr=False, compare=False)
    key: str
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    swap_id: str = ""  # the `ds_id` DeepSpeed pickles with a tensor whose elements it swapped to NVMe

    def numel(self) -> int:
        """Number of elements, like `torch.Tensor.numel`."""
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        """Whether the elements are laid out densely in row-major order."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def read(self, start: int = 0, numel: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read elements [start, start+numel) of the flattened tensor with one pread, into `out` if given."""
        total = self.numel()
        numel = total - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > total:
            raise CheckpointError(
                self.file.path, f"read of [{start}, {start + numel}) outside tensor of {total} elements"
            )
        if not self.is_contiguous():
            part = self.load().reshape(-1)[start : start + numel]
            return out.copy_(part) if out is not None else part.clone()
        return self.file.read_storage(self.key, self.dtype, self.storage_offset + start, numel, out)

    def load(self) -> torch.Tensor:
        """Read the whole tensor with its shape and strides."""
        if self.is_contiguous():
            return self.read().reshape(self.shape)
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if self.numel() else 0
        flat = self.file.read_storage(self.key, self.dtype, self.storage_offset, span)
        return torch.as_strided(flat, self.shape, self.stride).clone()


class _Storage:
    """Stand-in for a storage in the pickle: only its key and dtype matter."""

    __slots__ = ("dtype", "key")

    def __init__(self, key: str, dtype: torch.dtype):
        self.key = key
        self.dtype = dtype


def _ints(value: Any) -> bool:
    return isinstance(value, (tuple, list, torch.Size)) and all(type(v) is int and v >= 0 for v in value)


class _Records:
    """Where each record of a zip archive is, and the CRC-32 pieces of what was read from it."""

    def __init__(self, blob: Blob, infos: list[zipfile.ZipInfo], verify: bool = True):
        self.path, self.blob, self.verify = blob.path, blob, verify
        self.infos = {i.filename: i for i in infos}
        self._offsets: dict[str, int] = {}
        self._pieces: dict[str, list[tuple[int, int, int]]] = {}
        self._lock = threading.Lock()

    def data_range(self, name: str) -> tuple[int, int]:
        """(file offset, length) of a record's bytes."""
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(self.path, f"record '{name}' missing from archive")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(self.path, f"record '{name}' is compressed; expected torch's stored layout")
        if name not in self._offsets:
            if info.header_offset + _LOCAL_HEADER.size > self.blob.size:
                raise CheckpointError(self.path, f"truncated: the zip header of '{name}' is past the end")
            header = self.blob.read(info.header_offset, _LOCAL_HEADER.size)
            if header[:4] != b"PK\x03\x04":
                raise CheckpointError(self.path, f"corrupt zip header for '{name}'")
            fields = _LOCAL_HEADER.unpack(header)
            self._offsets[name] = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        base, length = self._offsets[name], info.file_size
        if base + length > self.blob.size:
            raise CheckpointError(
                self.path, f"truncated: record '{name}' ends at byte {base + length} of {self.blob.size}"
            )
        return base, length

    def locate(self, names: Iterable[str]) -> None:
        """Find where each record's bytes start; on a store its zip header costs a round trip, so the headers are
        fetched side by side, not one after another."""
        todo = [n for n in dict.fromkeys(names) if n not in self._offsets]
        parallel = min(self.blob.concurrency, len(todo))
        if parallel <= 1:
            for name in todo:
                self.data_range(name)
            return
        with ThreadPoolExecutor(parallel, thread_name_prefix="ucp-locate") as pool:
            for future in [pool.submit(contextvars.copy_context().run, self.data_range, n) for n in todo]:
                future.result()

    def pread_into(self, views: list[memoryview], offset: int, data: bool = True) -> None:
        """Fill `views`, in order, from the file's bytes at `offset` on (one request, or a few on a store)."""
        self.blob.readinto(views, offset, data)

    def _pread_from(self, base: int, offset: int, length: int) -> bytes:
        return self.pread(base + offset, length, data=True)

    def pread(self, offset: int, length: int, data: bool = False) -> bytes:
        out = bytearray(length)
        self.pread_into([memoryview(out)], offset, data)
        return bytes(out)

    def note(self, name: str, start: int, data: memoryview) -> None:
        """Remember the CRC of bytes [start, start+len) of a record, just read."""
        if not self.verify:
            return
        piece = (start, len(data), crc32(data))
        with self._lock:
            self._pieces.setdefault(name, []).append(piece)

    def pieces(self) -> dict[str, list[tuple[int, int, int]]]:
        with self._lock:
            return {name: list(p) for name, p in self._pieces.items()}

    def add(self, pieces: dict[str, list[tuple[int, int, int]]]) -> None:
        with self._lock:
            for name, more in pieces.items():
                if name not in self.infos:
                    raise CheckpointError(self.path, f"record '{name}' missing from archive")
                self._pieces.setdefault(name, []).extend(more)

    def check(self, names: list[str] | None = None) -> list[str]:
        """Records (those read from, by default) whose bytes do not match their CRC-32; reads only what no
        read covered."""
        with self._lock:
            todo = {n: list(self._pieces.get(n, ())) for n in (self._pieces if names is None else names)}

        def one(name: str, pieces: list[tuple[int, int, int]]) -> str | None:
            try:
                base, length = self.data_range(name)
                got = combine_pieces(length, pieces, functools.partial(self._pread_from, base))
            except CheckpointError as exc:
                return str(exc)
            with self._lock:
                self._pieces[name] = [(0, length, got)] if got == self.infos[name].CRC else []
            return None if got == self.infos[name].CRC else f"{self.path}: record {name} fails its crc32 check"

        parallel = min(self.blob.concurrency, len(todo))
        if parallel <= 1:
            found = [one(name, pieces) for name, pieces in todo.items()]
        else:  # each record costs a round trip to a store (its zip header, the bytes no read covered): overlap them
            with ThreadPoolExecutor(parallel, thread_name_prefix="ucp-check") as pool:
                futures = [pool.submit(contextvars.copy_context().run, one, n, p) for n, p in todo.items()]
                found = [f.result() for f in futures]
        return [p for p in found if p is not None]


Span = tuple[str, int, int, torch.Tensor]
"""(record, first byte in the record, first byte in the file, where the bytes go)."""


MERGE_GAP = 1 << 16
"""Spans of one file at most this many bytes apart are read in one request, gap included: on a disk or an object
store a request costs more than reading 64 KiB more."""


def _read_spans(records: _Records, spans: list[Span]) -> None:
    """Read spans in file order, each run of spans less than `MERGE_GAP` apart in one request, noting each span for
    the CRC check."""
    read_archives([(records, spans)])


def read_spans(work: Mapping[TorchFile | IndexedArchive, list[Span]]) -> None:
    """`TorchFile.read_spans` of several archives, all at once (see `read_archives`)."""
    read_archives([(archive._records, spans) for archive, spans in work.items()])


def read_archives(work: Sequence[tuple[_Records, list[Span]]]) -> None:
    """Read the spans of several archives at once: each archive's spans in runs (see `_runs`), and on a store the
    runs of every archive cut into requests of at most the blob's `request_size`, all of them in flight together up
    to the blobs' `concurrency`, so that one rank's load keeps a store busy across its files, not one file at a
    time."""
    requests = [piece for records, spans in work for run in _runs(spans) for piece in _requests(records, run)]
    parallel = min(max((records.blob.concurrency for records, _ in work), default=1), len(requests))
    if parallel <= 1:  # a disk: preads in file order, nothing to overlap
        for one in requests:
            one.send()
        return
    # a store answers each request after a round trip: many in flight hide it
    with ThreadPoolExecutor(parallel, thread_name_prefix="ucp-read") as pool:
        done = [pool.submit(contextvars.copy_context().run, one.send) for one in requests]
        for future in done:
            future.result()


def _runs(spans: list[Span]) -> list[list[Span]]:
    """Spans in file order, grouped into runs less than `MERGE_GAP` apart: one request each, gap included."""
    runs: list[list[Span]] = []
    end = 0
    for span in sorted(spans, key=lambda s: s[2]):
        # one scatter list cannot fill two targets from the same bytes: an overlapping span starts a run of its own
        if not runs or span[2] - end > MERGE_GAP or span[2] < end:
            runs.append([])
        runs[-1].append(span)
        end = span[2] + span[3].nbytes
    return runs


def _bytes_of(out: torch.Tensor) -> memoryview:
    return out.view(torch.uint8).numpy().data if out.numel() else memoryview(b"")


def _scratch(nbytes: int) -> memoryview:
    """Room for bytes read only to be passed over (or checked): not zero-filled, since the read overwrites it."""
    return torch.empty(nbytes, dtype=torch.uint8).numpy().data


@dataclass
class _Request:
    """One ranged read: the file's bytes from `offset` into `views`, in order, then each view that is a record's
    bytes noted for the CRC check."""

    records: _Records
    offset: int
    views: list[memoryview] = field(default_factory=list)
    notes: list[tuple[str, int, memoryview]] = field(default_factory=list)

    def send(self) -> None:
        self.records.pread_into(self.views, self.offset)
        for name, begin, view in self.notes:
            self.records.note(name, begin, view)


def _requests(records: _Records, run: list[Span]) -> list[_Request]:
    """The requests for a run of non-overlapping spans in file order, straight into their targets: the bytes between
    two spans (a zip record header, or elements nobody asked for) land in scratch views of the same scatter list. A
    gap inside one record is noted for the CRC check too, so that the check need not read it again. A run longer
    than the blob's `request_size` is cut into requests of that size, to be sent side by side."""
    segments: list[tuple[memoryview, tuple[str, int] | None]] = []
    previous: Span | None = None
    for span in run:
        name, begin, at, out = span
        if previous is not None:
            p_name, p_begin, p_at, p_out = previous
            gap = at - (p_at + p_out.nbytes)
            if gap:
                same = p_name == name and p_at - p_begin == at - begin  # both spans in one record: data between
                segments.append((_scratch(gap), (name, p_begin + p_out.nbytes) if same else None))
        segments.append((_bytes_of(out), (name, begin)))
        previous = span
    limit = records.blob.request_size or sum(len(view) for view, _ in segments) or 1
    requests = [_Request(records, run[0][2])]
    room = limit
    for view, note in segments:
        at = 0
        while True:
            take = min(room, len(view) - at)
            if take or not len(view):
                piece = view[at : at + take]
                requests[-1].views.append(piece)
                if note is not None:
                    requests[-1].notes.append((note[0], note[1] + at, piece))
            at += take
            room -= take
            if at >= len(view):
                break
            requests.append(_Request(records, requests[-1].offset + limit))
            room = limit
    return requests


def _read_run(records: _Records, run: list[Span]) -> None:
    """One run of spans, read now (see `_requests`)."""
    for one in _requests(records, run):
        one.send()


@dataclass(frozen=True)
class StorageSpan:
    """Where the elements of one 1-D tensor lie in an archive, as the rank that opened and checked it found them:
    another rank reads them with `IndexedArchive`, without reading the zip directory or the pickle again."""

    record: str
    record_offset: int
    """Byte of element 0 in the record."""
    file_offset: int
    """Byte of element 0 in the file."""
    numel: int
    dtype: str


def zip_directory(blob: Blob) -> list[zipfile.ZipInfo]:
    """The records a zip archive's directory lists, read with as few requests as its size allows."""
    try:
        with zipfile.ZipFile(blob.raw()) as zf:
            return zf.infolist()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(blob.path, f"truncated or corrupt torch file ({exc})") from None


class IndexedArchive(Closeable):
    """A torch archive read at the offsets another rank recorded (`StorageSpan`s), after that rank checked its zip
    directory, pickle and save id; what is read here is noted for that rank's CRC check (`pieces`) like any read."""

    def __init__(self, path: str, verify: bool = True):
        self.path = str(path)
        self._blob = open_blob(self.path)
        record(files=1)
        self._records = _Records(self._blob, [], verify)

    @property
    def file(self) -> IndexedArchive:
        """Itself: what was read from it is found like an opened rank file's (`pieces`)."""
        return self

    def read_spans(self, spans: list[Span]) -> None:
        """`TorchFile.read_spans`: runs of adjacent spans in one request each."""
        _read_spans(self._records, spans)

    def pieces(self) -> dict[str, list[tuple[int, int, int]]]:
        """(start, length, crc32) of every read so far, by record, for the CRC check on the rank that indexed it."""
        return self._records.pieces()

    def close(self) -> None:
        """Release the file."""
        self._blob.close()


class TorchFile(Closeable):
    """One `torch.save` zip file: its unpickled object with `LazyTensor` leaves, and checked byte-range reads.

    `path` is a location, or a blob already open (one item of a DCP `.distcp` file, `storage.Window`).

    `verify=False` skips the CRC checks of tensor reads, to measure what they cost; the pickle is
    always checked.
    """

    def __init__(self, path: str | Blob, verify: bool = True):
        self._blob = open_blob(path) if isinstance(path, str) else path
        self.path = self._blob.path
        record(files=1)
        try:
            self.size = self._blob.size
            infos = zip_directory(self._blob)
        except CheckpointError:
            self.close()
            raise
        pkl = next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
        if pkl is None:
            self.close()
            raise CheckpointError(self.path, "not a torch.save archive (no data.pkl)")
        self._prefix = pkl.filename[: -len("data.pkl")]
        self._records = _Records(self._blob, infos, verify)
        data = self._read_record(pkl.filename)
        extra = {
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
            ("torch._tensor", "_rebuild_from_type_v2"): self._rebuild_from_type,
        }
        try:
            self.obj = SafeUnpickler(data, self._persistent_load, extra).load()
        except CheckpointError:
            raise
        except UnsafePickle as exc:
            raise CheckpointError(self.path, str(exc)) from None
        except Exception as exc:  # a damaged or hostile stream raises many exception types
            raise CheckpointError(self.path, f"cannot unpickle ({type(exc).__name__}: {exc})") from None
        stamp_name = f"{self._prefix}{SAVE_ID_RECORD}"
        self.save_id = (
            self._read_record(stamp_name).decode("ascii", "replace") if stamp_name in self._records.infos else None
        )

    def _read_record(self, name: str) -> bytes:
        """A whole small record (the pickle, the save id), checked against its CRC-32 before use."""
        base, length = self._records.data_range(name)
        data = self._records.pread(base, length)
        if crc32(data) != self._records.infos[name].CRC:
            raise CheckpointError(self.path, f"record {name} fails its crc32 check")
        return data

    def _rebuild_tensor(self, storage: Any, storage_offset: Any, size: Any, stride: Any, *_args: Any) -> LazyTensor:
        if (
            not isinstance(storage, _Storage)
            or type(storage_offset) is not int
            or storage_offset < 0
            or not _ints(size)
            or not _ints(stride)
            or len(size) != len(stride)
        ):
            raise CheckpointError(self.path, "malformed tensor record in the pickle")
        return LazyTensor(self, storage.key, storage.dtype, storage_offset, tuple(size), tuple(stride))

    def _rebuild_from_type(self, func: Any, _new_type: Any, args: Any, _state: Any) -> Any:
        if (
            func not in (self._rebuild_tensor, _rebuild_parameter)
            or not isinstance(_new_type, TensorType)
            or type(args) is not tuple
        ):
            raise CheckpointError(self.path, "_rebuild_from_type_v2 of something other than a tensor")
        tensor = func(*args)
        attrs = _state[0] if isinstance(_state, tuple) and _state else _state
        swap_id = attrs.get("ds_id") if isinstance(attrs, dict) else None
        if isinstance(tensor, LazyTensor) and isinstance(swap_id, str):
            return dataclasses.replace(tensor, swap_id=swap_id)
        return tensor

    def _persistent_load(self, pid: Any) -> _Storage:
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], StorageType)
            or not isinstance(pid[2], str)
        ):
            raise CheckpointError(self.path, f"unknown persistent id {pid!r}"[:300])
        return _Storage(pid[2], pid[1].dtype)

    def read_storage(
        self, key: str, dtype: torch.dtype, start: int, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Read `numel` elements of storage `key` from element `start`, straight into `out` if given."""
        name, begin, at = self.storage_span(key, dtype, start, numel)
        if out is None:
            out = torch.empty(numel, dtype=dtype)
        elif out.dtype != dtype or out.numel() != numel or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"read target must be a contiguous CPU {dtype} tensor of {numel} elements")
        _read_run(self._records, [(name, begin, at, out)])
        return out

    def locate(self, keys: Iterable[str]) -> None:
        """Find the records of storages `keys` at once (see `_Records.locate`), before their `storage_span`s."""
        self._records.locate(f"{self._prefix}data/{key}" for key in keys)

    def storage_span(self, key: str, dtype: torch.dtype, start: int, numel: int) -> tuple[str, int, int]:
        """(record, first byte in the record, first byte in the file) of elements [start, start+numel) of storage
        `key`: where a merged read (`read_spans`) finds them."""
        itemsize = dtype.itemsize
        name = f"{self._prefix}data/{key}"
        base, nbytes = self._records.data_range(name)
        begin, length = start * itemsize, numel * itemsize
        if begin + length > nbytes:
            raise CheckpointError(
                self.path, f"truncated: storage {key} needs bytes up to {begin + length}, its record holds {nbytes}"
            )
        return name, begin, base + begin

    def read_spans(self, spans: list[Span]) -> None:
        """Fill each `out` of (record, first byte in the record, first byte in the file, out) from `storage_span`s:
        runs of spans that follow one another in the file are one request, and every span is noted for the CRC
        check as if read alone."""
        _read_spans(self._records, spans)

    def pieces(self) -> dict[str, list[tuple[int, int, int]]]:
        """(start, length, crc32) of every read so far, by record: to be checked here or by another process."""
        return self._records.pieces()

    def check_reads(self, more: dict[str, list[tuple[int, int, int]]] | None = None) -> None:
        """Raise if any record read from so far (here, or in `more` pieces read elsewhere) fails its CRC-32.

        Reads only bytes that no read covered, such as padding.
        """
        self._records.add(more or {})
        problems = self._records.check()
        if problems:
            raise CheckpointError(self.path, "; ".join(p.removeprefix(f"{self.path}: ") for p in problems))

    def verify(self) -> list[str]:
        """Every record whose bytes do not match the CRC-32 in the zip directory (reads the whole file)."""
        names = [n for n, i in self._records.infos.items() if i.compress_type == zipfile.ZIP_STORED]
        return self._records.check(names)

    def close(self) -> None:
        """Release the file."""
        self._blob.close()


def _rebuild_parameter(data: Any, *_args: Any) -> LazyTensor:
    if not isinstance(data, LazyTensor):
        raise CheckpointError("<pickle>", "a parameter whose data is not a tensor")
    return data


def materialize(obj: Any) -> Any:
    """Replace every `LazyTensor` inside a nested structure with the loaded tensor."""
    if isinstance(obj, LazyTensor):
        return obj.load()
    if isinstance(obj, dict):
        out = obj.copy()
        for k, v in obj.items():
            out[k] = materialize(v)
        return out
    if isinstance(obj, list):
        return [materialize(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(materialize(v) for v in obj)
    if isinstance(obj, types.SimpleNamespace):  # an argparse.Namespace (Megatron-DeepSpeed's `args`)
        return types.SimpleNamespace(**{k: materialize(v) for k, v in vars(obj).items()})
    return obj


def plain(obj: Any) -> Any:
    """`materialize`, with DeepSpeed stand-ins turned into plain data and a namespace into the `argparse.Namespace` it
    was read from, so the result can be `torch.save`d (and read back by the program that wrote it)."""
    obj = materialize(obj)
    if isinstance(obj, PickledObject):
        return obj.to_data()
    if isinstance(obj, dict):
        out = obj.copy()
        for k, v in obj.items():
            out[k] = plain(v)
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(plain(v) for v in obj)
    if isinstance(obj, types.SimpleNamespace):
        return argparse.Namespace(**{k: plain(v) for k, v in vars(obj).items()})
    return obj


def to_bytes(obj: Any) -> memoryview:
    """`obj` as a `torch.save` archive in memory, for writers that store whole objects (DCP items, `common.pt`)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer()


def load_file(path: str | Blob) -> Any:
    """A whole small torch file (scheduler or client state), unpickled safely, every byte checked."""
    with TorchFile(path) as tfile:
        obj = materialize(tfile.obj)
        tfile.check_reads()
        return obj


def stamp(target: str | IO[bytes], save_id: str) -> None:
    """Add the save id record to a torch archive just written (a local file, or one held in memory), binding it to
    the other files of its save.

    The record is appended after torch's records and the zip directory is rewritten after it;
    `torch.load` reads the archive as before and ignores the record. A file is fsynced after it (a writer that
    wrote it in another process may have left it unsynced), and one that is missing is never created.
    """
    if not isinstance(target, str):
        _add_save_id(target, "<archive in memory>", save_id)
        return
    try:
        f = open(target, "r+b")
    except FileNotFoundError:
        raise CheckpointError(target, "missing: the checkpoint writer did not write it") from None
    with f:
        _add_save_id(f, target, save_id)
        f.flush()
        os.fsync(f.fileno())


def _add_save_id(archive: IO[bytes], name: str, save_id: str) -> None:
    if not zipfile.is_zipfile(archive):  # append mode would add an empty archive after whatever it is
        raise CheckpointError(name, "not a torch.save archive (no zip directory); cannot record the save id")
    archive.seek(0)
    with zipfile.ZipFile(archive, "a") as zf:
        pkl = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
        if pkl is None:
            raise CheckpointError(name, "not a torch.save archive (no data.pkl); cannot record the save id")
        zf.writestr(pkl[: -len("data.pkl")] + SAVE_ID_RECORD, save_id.encode("ascii"))


def fill_crcs(path: str) -> None:
    """Write the CRC-32 of each record into an archive `torch.save` wrote without them (`compat.crcs_left_to_us`):
    torch's own pass computes them at about 0.5 GB/s, most of a save's time; `isal` reads them off the page cache at
    over 10 GB/s. Each goes where torch puts it: the record's data descriptor and its central directory entry. A
    file in torch's legacy format (no zip, no CRCs) is left as it is."""
    with open(path, "r+b") as f:
        if not zipfile.is_zipfile(f):
            return
        f.seek(0)
        try:
            infos = zipfile.ZipFile(f).infolist()
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
            raise CheckpointError(path, f"not a torch.save archive ({exc}); cannot fill in its CRCs") from None
        patches = []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            entry = _directory_start(path, view)
            for info in infos:
                fields = _CENTRAL.unpack_from(view, entry)
                local = _LOCAL_HEADER.unpack_from(view, info.header_offset)
                stored = fields[0] == b"PK\x01\x02" and local[0] == b"PK\x03\x04"
                if not stored or info.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(path, f"{info.filename} is not a stored zip record; cannot fill in its CRC")
                data = info.header_offset + _LOCAL_HEADER.size + local[-2] + local[-1]
                end = data + info.file_size
                crc = crc32(view[data:end]).to_bytes(4, "little")
                patches.append((entry + 16, crc))
                if info.flag_bits & 0x8:  # a data descriptor follows the bytes, its signature optional
                    patches.append((end + 4 if bytes(view[end : end + 4]) == _DESCRIPTOR else end, crc))
                else:
                    patches.append((info.header_offset + 14, crc))
                entry += _CENTRAL.size + sum(fields[-7:-4])  # name, extra field and comment
        for offset, crc in patches:
            os.pwrite(f.fileno(), crc, offset)


def _directory_start(path: str, view: memoryview) -> int:
    """Where an archive's central directory begins (from its zip64 end record when it has one, as torch's do)."""
    at = bytes(view[-(_END.size + 0xFFFF) :]).rfind(b"PK\x05\x06")
    if at < 0:
        raise CheckpointError(path, "not a zip archive (no end of central directory); cannot fill in its CRCs")
    at += len(view) - min(len(view), _END.size + 0xFFFF)
    start = _END.unpack_from(view, at)[6]
    locator = at - _END64_LOCATOR.size
    if locator >= 0 and bytes(view[locator : locator + 4]) == b"PK\x06\x07":
        end64 = _END64_LOCATOR.unpack_from(view, locator)[2]
        start = _END64.unpack_from(view, end64)[-1]
    return int(start)


def save_id_of(path: str) -> str | None:
    """The save id recorded in a torch archive, or None (reads the zip directory and one small record)."""
    with open_blob(path) as blob:
        infos = {i.filename: i for i in zip_directory(blob)}
        name = next((n for n in infos if n.endswith(SAVE_ID_RECORD)), None)
        if name is None:
            return None
        records = _Records(blob, list(infos.values()))
        return records.pread(*records.data_range(name)).decode("ascii", "replace")


def check_save_id(path: str, carried: str | None, wanted: str) -> None:
    """Refuse a file of another save: `carried` is the save id the file at `path` records, `wanted` the one its tag's
    metadata records (empty: the save recorded none, and any file is taken)."""
    if wanted and carried != wanted:
        found = f"save id {carried}" if carried else "no save id"
        raise CheckpointError(
            path,
            f"belongs to another save: it carries {found}, and the metadata of this tag records save id {wanted} "
            "(a file copied from another run or step?)",
        )


class VerifyingReader(BlobFile):
    """A file object for `torch.load` that checks the CRC-32 of every record torch reads from it.

    torch reads each record through `seek` + `readinto`; the bytes are checked as they arrive,
    so verification costs no second read. Call `check` after the load.
    """

    def __init__(self, path: str, verify: bool = True):
        super().__init__(open_blob(path))
        self.path = path
        try:
            infos = zip_directory(self._blob)
        except CheckpointError:
            self._blob.close()
            raise
        self._records = _Records(self._blob, infos, verify)
        spans = []
        for info in infos:
            if info.compress_type == zipfile.ZIP_STORED and info.file_size:
                base, length = self._records.data_range(info.filename)
                spans.append((base, base + length, info.filename))
        self._spans = sorted(spans)
        self.save_id = next(
            (
                self._records.pread(*self._records.data_range(n)).decode("ascii", "replace")
                for n in self._records.infos
                if n.endswith(SAVE_ID_RECORD)
            ),
            None,
        )

    def fill(self, view: memoryview, pos: int) -> None:
        self._blob.readinto([view], pos, data=True)
        for begin, end, name in self._spans:
            lo, hi = max(begin, pos), min(end, pos + len(view))
            if lo < hi:
                self._records.note(name, lo - begin, view[lo - pos : hi - pos])

    def check(self) -> None:
        """Raise if a record torch read fails its CRC-32."""
        problems = self._records.check()
        if problems:
            raise CheckpointError(self.path, "; ".join(p.removeprefix(f"{self.path}: ") for p in problems))

    def close(self) -> None:
        self._blob.close()
        super().close()
