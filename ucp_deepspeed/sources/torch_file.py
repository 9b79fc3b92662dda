"""Read a `torch.save` zip file lazily: the pickle is parsed, tensor bytes are read on demand.

`torch.load` materialises every tensor of a file (or maps the whole file, which then counts
towards resident memory as it is touched). Conversion needs a few fragments of each tensor at a
time, so here each tensor comes back as a `LazyTensor` that knows where its bytes sit inside the
zip archive and reads exactly the requested element range with one `pread`.

Unpickling is restricted to an allow-list of globals: a checkpoint can carry arbitrary pickled
objects, and a conversion tool must not execute code from a file it was asked to read.
"""
from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ucp_deepspeed.errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header, 30 bytes
_CRC_CHUNK = 1 << 24
_SAFE_BUILTINS = {"set", "frozenset", "slice", "range", "complex", "dict", "list", "tuple", "int", "float",
                  "bool", "str", "bytes", "bytearray"}
_SAFE_CLASS_PREFIXES = ("deepspeed.", "megatron.", "transformers.", "accelerate.")
_SAFE_FUNCTIONS = {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("argparse", "Namespace"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "Tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.nn.parameter", "Parameter"),
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
}


def _extra_allowed() -> set[str]:
    return {g.strip() for g in os.environ.get("UCP_ALLOW_PICKLE", "").split(",") if g.strip()}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor stored in a torch zip file, described by where its bytes are, not loaded."""

    file: "TorchFile" = field(repr=False, compare=False)
    key: str
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

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
            raise CheckpointError(self.file.path, f"read of [{start}, {start + numel}) outside tensor of {total} elements")
        if not self.is_contiguous():
            part = self.load().reshape(-1)[start:start + numel]
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

    def __init__(self, key: str, dtype: torch.dtype):
        self.key = key
        self.dtype = dtype


def _rebuild_parameter(data: LazyTensor, *_args: Any) -> LazyTensor:
    return data


def _rebuild_from_type(func: Any, _new_type: Any, args: tuple, _state: Any) -> Any:
    return func(*args)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tfile: "TorchFile"):
        super().__init__(io.BytesIO(data))
        self.tfile = tfile

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild_tensor
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _rebuild_parameter
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type
        qualified = f"{module}.{name}"
        allowed = ((module, name) in _SAFE_FUNCTIONS
                   or (module == "builtins" and name in _SAFE_BUILTINS)
                   or (module == "torch" and (name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype)))
                   or qualified in _extra_allowed() or f"{module}.*" in _extra_allowed())
        obj = super().find_class(module, name) if allowed or module.startswith(_SAFE_CLASS_PREFIXES) else None
        if obj is None or not (allowed or isinstance(obj, type)):
            raise CheckpointError(
                self.tfile.path, f"refusing to unpickle global '{qualified}'; if you trust this file, "
                f"allow it with UCP_ALLOW_PICKLE={qualified}")
        return obj

    def _rebuild_tensor(self, storage: _Storage, storage_offset: int, size: tuple, stride: tuple,
                        *_args: Any) -> LazyTensor:
        return LazyTensor(self.tfile, storage.key, storage.dtype, storage_offset, tuple(size), tuple(stride))

    def persistent_load(self, pid: Any) -> _Storage:
        kind, storage_type, key, _location, _numel = pid
        if kind != "storage":
            raise CheckpointError(self.tfile.path, f"unknown persistent id {kind!r}")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type._dtype
        return _Storage(str(key), dtype)


class TorchFile:
    """One `torch.save` zip file: its unpickled object with `LazyTensor` leaves, and byte-range reads."""

    def __init__(self, path: str):
        self.path = str(path)
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(self.path, "file is missing") from None
        self.size = os.fstat(self._fd).st_size
        try:
            with zipfile.ZipFile(self.path) as zf:
                infos = zf.infolist()
                pkl = next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
                if pkl is None:
                    raise CheckpointError(self.path, "not a torch.save archive (no data.pkl)")
                self._prefix = pkl.filename[: -len("data.pkl")]
                self._entries = {i.filename: i for i in infos}
                data = zf.read(pkl)
        except (zipfile.BadZipFile, EOFError, OSError) as exc:
            self.close()
            raise CheckpointError(self.path, f"truncated or corrupt torch file ({exc})") from None
        self._data_offsets: dict[str, int] = {}
        try:
            self.obj = _Unpickler(data, self).load()
        except CheckpointError:
            raise
        except Exception as exc:  # unpickling a damaged stream raises many exception types
            raise CheckpointError(self.path, f"cannot unpickle ({type(exc).__name__}: {exc})") from None

    def _data_offset(self, key: str) -> tuple[int, int]:
        name = f"{self._prefix}data/{key}"
        info = self._entries.get(name)
        if info is None:
            raise CheckpointError(self.path, f"tensor data '{name}' missing from archive")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(self.path, f"tensor data '{name}' is compressed; expected torch's stored layout")
        if key not in self._data_offsets:
            header = os.pread(self._fd, _LOCAL_HEADER.size, info.header_offset)
            if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
                raise CheckpointError(self.path, f"corrupt zip header for '{name}'")
            fields = _LOCAL_HEADER.unpack(header)
            self._data_offsets[key] = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        return self._data_offsets[key], info.file_size

    def read_storage(self, key: str, dtype: torch.dtype, start: int, numel: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Read `numel` elements of storage `key` from element `start`, straight into `out` if given."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        base, nbytes = self._data_offset(key)
        begin, length = start * itemsize, numel * itemsize
        if begin + length > nbytes or base + begin + length > self.size:
            raise CheckpointError(self.path, f"truncated: storage {key} needs bytes up to {begin + length}, "
                                  f"archive holds {min(nbytes, self.size - base)}")
        if out is None:
            out = torch.empty(numel, dtype=dtype)
        elif out.dtype != dtype or out.numel() != numel or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"read target must be a contiguous CPU {dtype} tensor of {numel} elements")
        view = memoryview(out.view(torch.uint8).numpy())
        done = 0
        while done < length:
            got = os.preadv(self._fd, [view[done:]], base + begin + done)
            if got <= 0:
                raise CheckpointError(self.path, f"truncated while reading storage {key}")
            done += got
        return out

    def verify(self) -> list[str]:
        """Records whose bytes do not match the crc32 the zip directory holds (torch.save writes one per record)."""
        bad = []
        for name, info in self._entries.items():
            if info.compress_type != zipfile.ZIP_STORED:
                continue
            key = name[len(f"{self._prefix}data/"):] if name.startswith(f"{self._prefix}data/") else None
            if key is None:
                continue
            base, nbytes = self._data_offset(key)
            crc, done = 0, 0
            while done < nbytes:
                chunk = os.pread(self._fd, min(_CRC_CHUNK, nbytes - done), base + done)
                if not chunk:
                    break
                crc, done = zlib.crc32(chunk, crc), done + len(chunk)
            if done < nbytes or crc != info.CRC:
                bad.append(f"{self.path}: record {name} fails its crc32 check"
                           + (" (truncated)" if done < nbytes else ""))
        return bad

    def close(self) -> None:
        """Release the file descriptor."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


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
    return obj
