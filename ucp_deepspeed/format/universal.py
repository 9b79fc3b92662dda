"""The universal format: one safetensors file per parameter, a JSON manifest written last.

    <out>/params/<name>.safetensors   fp32 master + optimizer states (trainable) or `value` (frozen)
    <out>/buffers.safetensors         persistent module buffers, in their own dtypes
    <out>/state.pt                    LR scheduler, client_state, optimizer-wrapper state
    <out>/manifest.json               version, origin topology, tables, and for every file its
                                      size, CRC-32 and one CRC-32 per MiB block

The manifest is the commit marker: a folder without it is an unfinished conversion. Every read
checks the blocks it touches against the manifest (`Folder`), so a load verifies exactly the
bytes it uses, however the folder was named, at the cost of at most two extra blocks per read.
"""

from __future__ import annotations

import abc
import contextlib
import json
import math
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from safetensors.torch import save as st_save

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.kinds import kind_of
from ucp_deepspeed.format.manifest import BufferRecord, FileRecord, Manifest, ParamRecord, dtype_name
from ucp_deepspeed.format.metadata import VALUE
from ucp_deepspeed.geometry.layout import Layout, split
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.checksum import BLOCK, BlockHasher, block_crcs, crc32
from ucp_deepspeed.io.stats import record as record_io
from ucp_deepspeed.io.torch_file import load_file, to_bytes

FORMAT = "ucp_deepspeed/universal"
FORMAT_VERSION = 2  # 2: per-block CRCs; version-1 folders are read with a whole-file check on first use
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
BUFFERS = "buffers.safetensors"
STATE = "state.pt"
_CHUNK = 64 << 20


def param_file(name: str) -> str:
    """Relative path of a parameter's tensor file."""
    return f"params/{name}.safetensors"


def _hex(crc: int) -> str:
    return f"{crc:08x}"


def record_of(relpath: str, nbytes: int, crc: int, blocks: Sequence[int]) -> FileRecord:
    """A `FileRecord` from CRCs computed while writing."""
    return FileRecord(relpath, nbytes, _hex(crc), "".join(map(_hex, blocks or [0])))


def record_bytes(relpath: str, data: bytes | memoryview) -> FileRecord:
    """The record of a file whose bytes are in memory."""
    return record_of(relpath, len(data), crc32(data), block_crcs(data))


def write_bytes(root: str, relpath: str, data: bytes | memoryview) -> FileRecord:
    """Write one output file atomically and return its record."""
    st.write(st.join(root, relpath), data)
    return record_bytes(relpath, data)


def write_tensors(root: str, relpath: str, tensors: dict[str, torch.Tensor]) -> FileRecord:
    """Write tensors to one safetensors file atomically and return its record."""
    return write_bytes(root, relpath, st_save({k: v.contiguous() for k, v in tensors.items()}))


_ST_DTYPE = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPE_OF = {v: k for k, v in _ST_DTYPE.items()}


def stream_tensors(
    root: str,
    relpath: str,
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> FileRecord:
    """Write a safetensors file one tensor at a time: `produce(key)` is called in order and then dropped.

    The header is computed from the declared dtypes and shapes, so at most one tensor is in memory
    and its bytes go to the file without a serialised copy. Written atomically, like every file;
    the CRCs are computed on the bytes as they go out.
    """
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    prefix = struct.pack("<Q", len(head)) + head
    hasher = BlockHasher()
    with st.writer(st.join(root, relpath)) as f:
        f.write(prefix)
        hasher.update(prefix)
        for key, dtype, shape in entries:
            tensor = produce(key)
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(
                    f"{relpath}: '{key}' is {tensor.dtype} {tuple(tensor.shape)}, declared {dtype} {tuple(shape)}"
                )
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
            f.write(data)
            hasher.update(data)
            del tensor, data
    crc, blocks = hasher.finish()
    return record_of(relpath, hasher.total, crc, blocks)


def write_object(root: str, relpath: str, obj: Any) -> FileRecord:
    """Write a picklable object (scheduler, client state) with torch.save, atomically."""
    return write_bytes(root, relpath, to_bytes(obj))


def write_manifest(root: str, manifest: Manifest, records: Iterable[FileRecord]) -> str:
    """Write the manifest last, atomically: from this moment the conversion counts as complete."""
    body = dict(
        manifest.encode(),
        format=FORMAT,
        version=FORMAT_VERSION,
        block_size=BLOCK,
        files={r.path: r.to_json() for r in sorted(records, key=lambda r: r.path)},
    )
    path = st.join(root, MANIFEST)
    st.storage_of(path).commit(path, json.dumps(body, indent=1).encode())
    return path


def read_manifest(root: str) -> Manifest:
    """A folder's manifest, parsed, checked for format and version, and validated (`Manifest.decode`)."""
    path = st.join(root, MANIFEST)
    if not st.isfile(path):
        raise CheckpointError(path, "manifest missing: not a universal checkpoint, or an unfinished conversion")
    try:
        manifest = json.loads(st.read(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"manifest is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(path, f"format {found!r} is not {FORMAT!r}")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            path,
            f"unknown format version {manifest.get('version')!r}; "
            f"this ucp_deepspeed reads versions {', '.join(map(str, READABLE_VERSIONS))}",
        )
    if int(manifest["version"]) >= 2 and manifest.get("block_size") != BLOCK:
        raise CheckpointError(path, f"block size {manifest.get('block_size')!r}, expected {BLOCK}")
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointError(path, "manifest has no file table")
    return Manifest.decode(manifest, path)


class CheckedFile(st.Closeable):
    """One file of a manifest, read by byte range; every block a read touches is checked once."""

    def __init__(self, root: str, record: FileRecord, verify: bool = True):
        self.path = st.join(root, record.path)
        self.record = record
        self.verify_reads = verify
        self._blob: st.Blob | None = None
        try:
            self._blob = st.open_blob(self.path)
            size = self._blob.size
        except CheckpointError as exc:
            self.close()
            if "missing" in exc.reason:
                raise CheckpointError(self.path, "file listed in the manifest is missing") from None
            raise
        record_io(files=1)
        if size != record.nbytes:
            self.close()
            raise CheckpointError(
                self.path, f"size {size} differs from manifest ({record.nbytes}): truncated or replaced"
            )
        self._good: set[int] = set()
        self._lock = threading.Lock()
        self._header: dict[str, Any] | None = None
        self._data_start = 0
        if not verify:
            self._good = set(range(max(1, -(-record.nbytes // BLOCK))))
        elif not record.blocks:  # a version-1 manifest has one CRC for the whole file
            try:
                self._check_whole()
            except CheckpointError:
                self.close()
                raise

    def _check_whole(self) -> None:
        crc, pos = 0, 0
        while pos < self.record.nbytes:
            chunk = self._handle().read(pos, min(_CHUNK, self.record.nbytes - pos), data=True)
            crc, pos = crc32(chunk, crc), pos + len(chunk)
        if _hex(crc) != self.record.crc32:
            raise CheckpointError(self.path, f"crc32 {_hex(crc)} does not match the manifest ({self.record.crc32})")
        self._good = set(range(-(-self.record.nbytes // BLOCK)))

    def read(self, offset: int, length: int) -> torch.Tensor:
        """Bytes [offset, offset+length) as a uint8 tensor, after checking the CRC of every block they fall in."""
        if offset < 0 or length < 0 or offset + length > self.record.nbytes:
            raise CheckpointError(self.path, f"read of bytes [{offset}, {offset + length}) outside the file")
        if not length:
            return torch.empty(0, dtype=torch.uint8)
        first, last = offset // BLOCK, (offset + length - 1) // BLOCK
        begin, end = first * BLOCK, min((last + 1) * BLOCK, self.record.nbytes)
        buf = torch.empty(end - begin, dtype=torch.uint8)
        view = buf.numpy().data
        self._handle().readinto([view], begin)
        with self._lock:
            fresh = [b for b in range(first, last + 1) if b not in self._good]
        for b in fresh:
            lo = (b - first) * BLOCK
            found = _hex(crc32(view[lo : lo + BLOCK]))
            if found != self.record.blocks[8 * b : 8 * b + 8]:
                raise CheckpointError(
                    self.path,
                    f"block {b} (bytes {b * BLOCK}-{min((b + 1) * BLOCK, self.record.nbytes)}) "
                    "fails its crc32 check: the file was damaged after it was written",
                )
        with self._lock:
            self._good.update(fresh)
        return buf[offset - begin : offset - begin + length]

    def verify(self) -> None:
        """Check every block."""
        for start in range(0, self.record.nbytes, _CHUNK):
            self.read(start, min(_CHUNK, self.record.nbytes - start))

    def header(self) -> dict[str, Any]:
        """The safetensors header: key -> dtype, shape and byte range, validated against the file size."""
        if self._header is None:
            if self.record.nbytes < 8:
                raise CheckpointError(self.path, "too short for a safetensors file")
            (size,) = struct.unpack("<Q", self.read(0, 8).numpy().tobytes())
            if size > self.record.nbytes - 8:
                raise CheckpointError(self.path, f"safetensors header of {size} bytes does not fit the file")
            try:
                raw = json.loads(self.read(8, size).numpy().tobytes())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CheckpointError(self.path, f"safetensors header is not valid JSON ({exc})") from None
            self._data_start = 8 + size
            header = {}
            for key, entry in raw.items():
                if key == "__metadata__":
                    continue
                try:
                    dtype = _DTYPE_OF[entry["dtype"]]
                    shape = tuple(int(d) for d in entry["shape"])
                    lo, hi = (int(x) for x in entry["data_offsets"])
                except (KeyError, TypeError, ValueError):
                    raise CheckpointError(self.path, f"safetensors entry {key!r} is malformed") from None
                if (
                    min(shape, default=0) < 0
                    or hi - lo != math.prod(shape) * dtype.itemsize
                    or lo < 0
                    or self._data_start + hi > self.record.nbytes
                ):
                    raise CheckpointError(self.path, f"safetensors entry {key!r} does not fit its shape or the file")
                header[key] = (dtype, shape, self._data_start + lo)
            self._header = header
        return self._header

    def keys(self) -> list[str]:
        """Tensor names in the file."""
        return list(self.header())

    def tensor(self, key: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start+numel) of a tensor, flattened (all of them by default)."""
        if key not in self.header():
            raise CheckpointError(self.path, f"no tensor {key!r}")
        dtype, shape, base = self.header()[key]
        total = math.prod(shape)
        numel = total - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > total:
            raise CheckpointError(self.path, f"{key}: elements [{start}, {start + numel}) outside {total}")
        if not numel:
            return torch.empty(0, dtype=dtype)
        return self.read(base + start * dtype.itemsize, numel * dtype.itemsize).view(dtype)

    def full(self, key: str) -> torch.Tensor:
        """A whole tensor with its shape."""
        self.header()
        return self.tensor(key).reshape(self.header()[key][1])

    def _handle(self) -> st.Blob:
        if self._blob is None:
            raise CheckpointError(self.path, "read after close")
        return self._blob

    def close(self) -> None:
        """Release the file."""
        blob, self._blob = self._blob, None
        if blob is not None:
            blob.close()


class Folder(st.Closeable):
    """The files a manifest lists, opened on first use for checked reads."""

    def __init__(self, root: str, manifest: Manifest, verify: bool = True):
        self.root = st.normalize(root)
        self.verify_reads = verify
        self.records = manifest.files
        self._open: dict[str, CheckedFile] = {}
        self._lock = threading.Lock()

    def file(self, relpath: str) -> CheckedFile:
        """A listed file, opened once."""
        with self._lock:
            if relpath not in self._open:
                if relpath not in self.records:
                    raise CheckpointError(st.join(self.root, relpath), "file is not listed in the manifest")
                self._open[relpath] = CheckedFile(self.root, self.records[relpath], self.verify_reads)
            return self._open[relpath]

    def load_object(self, relpath: str) -> Any:
        """A whole torch file of the folder (its blocks checked first), unpickled safely."""
        self.file(relpath).verify()
        return load_file(st.join(self.root, relpath))

    def verify(self, relpaths: Iterable[str] | None = None) -> list[str]:
        """Check every block of the given files (all by default); return one line per problem."""
        problems = []
        for relpath in self.records if relpaths is None else relpaths:
            try:
                with CheckedFile(self.root, self.records[relpath]) as handle:
                    handle.verify()
            except CheckpointError as exc:
                problems.append(str(exc))
        return problems

    def close(self) -> None:
        """Release every open file."""
        for f in self._open.values():
            f.close()
        self._open.clear()


def copy_checked(src: Folder, relpath: str, root: str, dest: str | None = None) -> FileRecord:
    """Copy one file of `src` into `root` (as `dest`), checking its blocks as they are read."""
    source = src.file(relpath)
    dest = dest or relpath
    hasher = BlockHasher()
    with st.writer(st.join(root, dest)) as f:
        for start in range(0, source.record.nbytes, _CHUNK):
            data = source.read(start, min(_CHUNK, source.record.nbytes - start)).numpy().data
            f.write(data)
            hasher.update(data)
    crc, blocks = hasher.finish()
    return record_of(dest, hasher.total, crc, blocks)


def torch_dtype(name: Any) -> torch.dtype:
    """The torch dtype a manifest names, refusing anything else torch has under that name."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(str(name), "is not a torch dtype")
    return dtype


def encode_value(value: Any) -> Any:
    """Encode a hyperparameter or scalar state as JSON without losing its type."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {"tensor": dtype_name(value.dtype), "value": value.item()}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} value {value!r} in the manifest")


def decode_value(value: Any) -> Any:
    """Inverse of `encode_value`."""
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["value"], dtype=torch_dtype(value["tensor"]))
    if isinstance(value, dict) and "tuple" in value:
        return tuple(decode_value(v) for v in value["tuple"])
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    return value


def is_complete(root: str) -> bool:
    """Whether a folder holds a finished conversion (its manifest exists)."""
    return st.isfile(st.join(root, MANIFEST))


class TensorReader(st.Closeable):
    """What a restore reads: full tensors of a checkpoint by element range, and its non-tensor state.

    Implemented by a universal folder (`UniversalCheckpoint`), and read in place by a native tag
    (`convert.direct.DirectCheckpoint`) and a Check-N-Run chain (`checkn_run.chain.ChainCheckpoint`).
    Call order: `manifest`/`params`/`buffers` to plan, then any number of `read`, `read_slice`,
    `read_local` and `read_buffer`, then `load_state`, then `close` (or all of it inside `with reader:`).
    """

    root: str
    manifest: Manifest
    params: dict[str, ParamRecord]
    buffers: dict[str, BufferRecord]

    @abc.abstractmethod
    def read(self, name: str, key: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start+numel) of a state of a full tensor, flattened."""

    @abc.abstractmethod
    def read_slice(self, name: str, key: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries [start, start+length) along `dim` of a state of a full tensor."""

    @abc.abstractmethod
    def read_buffer(self, name: str) -> torch.Tensor:
        """A whole module buffer."""

    @abc.abstractmethod
    def load_state(self) -> dict[str, Any]:
        """The non-tensor training state: scheduler, client state, optimizer-wrapper state."""

    def read_into(self, name: str, key: str, start: int, out: torch.Tensor) -> None:
        """Fill `out` with elements [start, start+out.numel()) of a state of a full tensor; inside `batch` a reader
        may fill it only when the block ends."""
        out.copy_(self.read(name, key, start, out.numel()))
        record_io(copied=out.nbytes)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Reads into `read_into` targets may be held until the block ends and then merged, one request per run of
        adjacent bytes; no target may be used before then. Not to be shared between threads."""
        yield

    @contextlib.contextmanager
    def replicas_compared(self) -> Iterator[None]:
        """Reads in the block are of ranges whose replicas another rank's part of the same load compared already
        (a refresh reads the partitions other ranks restored): a reader that compares replicas skips them."""
        yield

    def read_local(
        self,
        name: str,
        key: str,
        layout: Layout,
        local_shape: Sequence[int],
        rank: int,
        tp: int,
        start: int = 0,
        numel: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Elements [start, start+numel) of tensor-parallel rank `rank`'s flattened share of a state, into `out`
        if given (then possibly only when the enclosing `batch` ends).

        When the share is one run of whole rows (replicated, or split on dim 0) only the rows that
        cover the range are read; otherwise the share is assembled first.
        """
        total = math.prod(local_shape)
        numel = (out.numel() if out is not None else total - start) if numel is None else numel
        pieces = layout.pieces(local_shape, rank, tp)
        dtype = torch.float32 if key != VALUE else torch_dtype(self.params[name].dtype)
        if (layout.dim == 0 or not layout.is_split) and len(pieces) <= 1:
            row = math.prod(local_shape[1:])
            kept = max(0, min(pieces[0].length * row - start, numel)) if pieces else 0
            if out is None and kept == numel:
                return self.read(name, key, pieces[0].full_start * row + start, numel).to(dtype)
            out = torch.empty(numel, dtype=dtype) if out is None else out
            if kept:
                self.read_into(name, key, pieces[0].full_start * row + start, out[:kept])
            out[kept:].zero_()
            return out
        local = split(layout, local_shape, rank, tp, lambda d, s, n: self.read_slice(name, key, d, s, n), dtype)
        record_io(copied=local.nbytes)
        part = local.reshape(-1)[start : start + numel]
        if out is None:
            return part
        record_io(copied=out.nbytes)
        return out.copy_(part)


class FolderReader(TensorReader):
    """Full tensors read by checked byte range from the files of one manifest's folder.

    `manifest` is what the restore plans with; `folder` holds the files the reads go to. They differ only for an
    extension's tag read in place (a Check-N-Run chain element, whose tables it replays itself).
    """

    def __init__(self, root: str, manifest: Manifest, folder: Folder):
        self.root = root
        self.manifest = manifest
        self.params = manifest.params
        self.buffers = manifest.buffers
        self.folder = folder

    def _param_file(self, name: str, key: str) -> CheckedFile:
        record = self.params[name]
        handle = self.folder.file(record.file)
        if key not in record.keys:
            raise CheckpointError(handle.path, f"{name} has no state {key!r} in the manifest")
        _, shape, _ = handle.header().get(key, (None, None, 0))
        if shape is None or tuple(shape) != record.shape:
            raise CheckpointError(
                handle.path, f"{name}:{key} is {shape} in the file, {list(record.shape)} in the manifest"
            )
        return handle

    def read(self, name: str, key: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start+numel) of a parameter state, flattened; reads only the blocks covering them."""
        return self._param_file(name, key).tensor(key, start, numel)

    def read_slice(self, name: str, key: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries [start, start+length) along `dim` of a parameter state."""
        handle = self._param_file(name, key)
        shape = self.params[name].shape
        if not shape:
            return handle.tensor(key).reshape(1)
        if dim == 0:
            row = math.prod(shape[1:])
            return handle.tensor(key, start * row, length * row).reshape(length, *shape[1:])
        return handle.full(key).narrow(dim, start, length)

    def read_buffer(self, name: str) -> torch.Tensor:
        """A whole module buffer."""
        return self.folder.file(BUFFERS).full(name)

    def load_state(self) -> dict[str, Any]:
        """The non-tensor training state: scheduler, client state, optimizer-wrapper state."""
        state: dict[str, Any] = self.folder.load_object(STATE)
        return state

    def verify(self, relpaths: Iterable[str] | None = None) -> list[str]:
        """Check every block of the given files (all by default); return one line per problem."""
        return self.folder.verify(relpaths)

    def close(self) -> None:
        """Release every open file."""
        self.folder.close()


class UniversalCheckpoint(FolderReader):
    """A finished universal checkpoint, opened for checked slice reads (`verify=False` skips the checks,
    to measure what they cost)."""

    def __init__(self, root: str, verify: bool = True):
        root = st.normalize(root)
        manifest = read_manifest(root)
        kind = kind_of(root)
        if kind is not None:
            raise CheckpointError(
                st.join(root, MANIFEST),
                f"a {kind.name} tag, which may hold only part of the state: load it with "
                "load_checkpoint, or make a full copy with `ucp convert DIR --tag TAG`",
            )
        super().__init__(root, manifest, Folder(root, manifest, verify))
