"""The universal format: one safetensors file per parameter, a JSON manifest written last.

    <out>/params/<name>.safetensors   fp32 master + optimizer states (trainable) or `value` (frozen)
    <out>/buffers.safetensors         persistent module buffers, in their own dtypes
    <out>/state.pt                    LR scheduler, client_state, optimizer-wrapper state
    <out>/manifest.json               version, origin topology, tables, crc32 of every file

The manifest is the commit marker: a folder without it is an unfinished conversion.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as st_save

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.layout import Layout, split
from ucp_deepspeed.meta import VALUE
from ucp_deepspeed.sources.torch_file import TorchFile, materialize

FORMAT = "ucp_deepspeed/universal"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BUFFERS = "buffers.safetensors"
STATE = "state.pt"
_CHUNK = 64 << 20


def param_file(name: str) -> str:
    """Relative path of a parameter's tensor file."""
    return f"params/{name}.safetensors"


@dataclass(frozen=True)
class FileRecord:
    """A finished output file: its relative path, size and crc32."""

    path: str
    nbytes: int
    crc32: str


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
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        yield f


def atomic_write(path: str, data: bytes | memoryview) -> None:
    """Write a whole file atomically (see `atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)


def write_tensors(root: str, relpath: str, tensors: dict[str, torch.Tensor]) -> FileRecord:
    """Write tensors to one safetensors file atomically and return its record."""
    data = st_save({k: v.contiguous() for k, v in tensors.items()})
    atomic_write(os.path.join(root, relpath), data)
    return FileRecord(relpath, len(data), f"{zlib.crc32(data):08x}")


_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


def stream_tensors(root: str, relpath: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                   produce: Callable[[str], torch.Tensor]) -> FileRecord:
    """Write a safetensors file one tensor at a time: `produce(key)` is called in order and then dropped.

    The header is computed from the declared dtypes and shapes, so at most one tensor is in memory
    and its bytes go to the file without a serialised copy. Written atomically, like every file.
    """
    header, offset = {}, 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    prefix = struct.pack("<Q", len(head)) + head
    with atomic_file(os.path.join(root, relpath)) as f:
        f.write(prefix)
        crc = zlib.crc32(prefix)
        for key, dtype, shape in entries:
            tensor = produce(key)
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{relpath}: '{key}' is {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"declared {dtype} {tuple(shape)}")
            data = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
            f.write(data)
            crc = zlib.crc32(data, crc)
            del tensor, data
    return FileRecord(relpath, len(prefix) + offset, f"{crc:08x}")


def write_object(root: str, relpath: str, obj: Any) -> FileRecord:
    """Write a picklable object (scheduler, client state) with torch.save, atomically."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    atomic_write(os.path.join(root, relpath), data)
    return FileRecord(relpath, len(data), f"{zlib.crc32(data):08x}")


def file_record(root: str, relpath: str) -> FileRecord:
    """Record of a file already on disk (used when resuming an interrupted conversion)."""
    path = os.path.join(root, relpath)
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return FileRecord(relpath, os.path.getsize(path), f"{crc:08x}")


def write_manifest(root: str, manifest: dict[str, Any], records: Iterable[FileRecord]) -> str:
    """Write the manifest last, atomically: from this moment the conversion counts as complete."""
    body = dict(manifest, format=FORMAT, version=FORMAT_VERSION,
                files={r.path: {"bytes": r.nbytes, "crc32": r.crc32} for r in sorted(records, key=lambda r: r.path)})
    path = os.path.join(root, MANIFEST)
    atomic_write(path, json.dumps(body, indent=1).encode())
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def encode_value(value: Any) -> Any:
    """Encode a hyperparameter or scalar state as JSON without losing its type."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {"tensor": str(value.dtype).removeprefix("torch."), "value": value.item()}
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
        return torch.tensor(value["value"], dtype=getattr(torch, value["tensor"]))
    if isinstance(value, dict) and "tuple" in value:
        return tuple(decode_value(v) for v in value["tuple"])
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    return value


def is_complete(root: str) -> bool:
    """Whether a folder holds a finished conversion (its manifest exists)."""
    return os.path.isfile(os.path.join(root, MANIFEST))


class UniversalCheckpoint:
    """A finished universal checkpoint, opened for slice reads."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        path = os.path.join(self.root, MANIFEST)
        if not os.path.isfile(path):
            raise CheckpointError(path, "manifest missing: not a universal checkpoint, or an unfinished conversion")
        try:
            with open(path) as f:
                self.manifest: dict[str, Any] = json.load(f)
        except json.JSONDecodeError as exc:
            raise CheckpointError(path, f"manifest is not valid JSON ({exc})") from None
        if "differential" in self.manifest:
            raise CheckpointError(path, "a Check-N-Run chain element, which holds only part of some tables: load it "
                                  "with load_checkpoint, or make a full copy with `ucp convert DIR --tag TAG`")
        if self.manifest.get("format") != FORMAT:
            raise CheckpointError(path, f"format {self.manifest.get('format')!r} is not {FORMAT!r}")
        if self.manifest.get("version") != FORMAT_VERSION:
            raise CheckpointError(path, f"unknown format version {self.manifest.get('version')!r}; "
                                  f"this ucp_deepspeed reads version {FORMAT_VERSION}")
        self.params: dict[str, dict[str, Any]] = self.manifest["params"]
        self.buffers: dict[str, dict[str, Any]] = self.manifest["buffers"]
        self._handles: dict[str, Any] = {}

    def _checked_path(self, relpath: str) -> str:
        path = os.path.join(self.root, relpath)
        if relpath not in self.manifest["files"]:
            raise CheckpointError(path, "file is not listed in the manifest")
        expected = self.manifest["files"][relpath]["bytes"]
        if not os.path.isfile(path):
            raise CheckpointError(path, "file listed in the manifest is missing")
        if os.path.getsize(path) != expected:
            raise CheckpointError(path, f"size {os.path.getsize(path)} differs from manifest ({expected}): "
                                  "truncated or replaced")
        return path

    def _open(self, relpath: str) -> Any:
        if relpath not in self._handles:
            path = self._checked_path(relpath)
            try:
                self._handles[relpath] = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(path, f"cannot open safetensors file ({exc})") from None
        return self._handles[relpath]

    def read(self, name: str, key: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start+numel) of a parameter state, flattened; reads only the rows covering them."""
        record = self.params[name]
        handle = self._open(record["file"])
        shape = record["shape"]
        total = math.prod(shape)
        numel = total - start if numel is None else numel
        if not shape or numel == total:
            return handle.get_tensor(key).reshape(-1)[start:start + numel]
        row = total // shape[0]
        first, last = start // row, -(-(start + numel) // row)
        rows = handle.get_slice(key)[first:last]
        return rows.reshape(-1)[start - first * row:start - first * row + numel]

    def read_slice(self, name: str, key: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries [start, start+length) along `dim` of a parameter state."""
        handle = self._open(self.params[name]["file"])
        if not self.params[name]["shape"]:
            return handle.get_tensor(key).reshape(1)
        index = (slice(None),) * dim + (slice(start, start + length),)
        return handle.get_slice(key)[index]

    def read_local(self, name: str, key: str, layout: Layout, local_shape: Sequence[int], rank: int, tp: int,
                   start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start+numel) of tensor-parallel rank `rank`'s flattened share of a state.

        When the share is one run of whole rows (replicated, or split on dim 0) only the rows that
        cover the range are read; otherwise the share is assembled first.
        """
        total = math.prod(local_shape)
        numel = total - start if numel is None else numel
        pieces = layout.pieces(local_shape, rank, tp)
        dtype = torch.float32 if key != VALUE else getattr(torch, self.params[name]["dtype"])
        if (layout.dim == 0 or not layout.is_split) and len(pieces) <= 1:
            row = math.prod(local_shape[1:])
            kept = max(0, min(pieces[0].length * row - start, numel)) if pieces else 0
            if kept == numel:
                return self.read(name, key, pieces[0].full_start * row + start, numel).to(dtype)
            out = torch.zeros(numel, dtype=dtype)
            if kept:
                out[:kept] = self.read(name, key, pieces[0].full_start * row + start, kept)
            return out
        local = split(layout, local_shape, rank, tp, lambda d, s, n: self.read_slice(name, key, d, s, n), dtype)
        return local.reshape(-1)[start:start + numel]

    def read_buffer(self, name: str) -> torch.Tensor:
        """A whole module buffer."""
        return self._open(BUFFERS).get_tensor(name)

    def load_state(self) -> dict[str, Any]:
        """The non-tensor training state: scheduler, client state, optimizer-wrapper state."""
        tfile = TorchFile(self._checked_path(STATE))
        try:
            return materialize(tfile.obj)
        finally:
            tfile.close()

    def verify(self, relpaths: Iterable[str] | None = None) -> list[str]:
        """Check sizes and crc32 of the given files (all by default); return one line per problem."""
        files = self.manifest["files"]
        problems = []
        for relpath in (files if relpaths is None else relpaths):
            want = files[relpath]
            path = os.path.join(self.root, relpath)
            if not os.path.isfile(path):
                problems.append(f"{path}: missing")
                continue
            got = file_record(self.root, relpath)
            if got.nbytes != want["bytes"]:
                problems.append(f"{path}: {got.nbytes} bytes, manifest says {want['bytes']}")
            elif got.crc32 != want["crc32"]:
                problems.append(f"{path}: crc32 {got.crc32} does not match manifest {want['crc32']}")
        return problems
