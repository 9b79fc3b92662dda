"""PyTorch Distributed Checkpoint (DCP) folders, read lazily and without running code from them.

    <dir>/.metadata       a pickle of `torch.distributed.checkpoint.metadata.Metadata`: every flattened key with its
                          global shape, dtype and chunks (a tensor) or as bytes (any other object); `planner_data`
                          maps a key to its path in the nested state dict; `storage_data` maps each (key, chunk
                          offset) to a file, a byte offset and a length
    <dir>/__R_N.distcp    rank R's items, each a whole `torch.save` archive: a tensor chunk, or a pickled object

`.metadata` is read by the same no-code unpickler as every checkpoint file, with the DCP classes kept as data
(`PickledObject` stand-ins). Each item is opened as a `storage.Window` of its file and read as a torch archive:
CRC-checked, its pickle unpickled safely. megatron-core's `torch_dist` backend writes these same files.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.safe_pickle import PickledObject, SafeUnpickler, UnsafePickle, standin
from ucp_deepspeed.io.torch_file import LazyTensor, TorchFile, load_file

METADATA = ".metadata"
MAX_METADATA = 1 << 28
_DCP = "torch.distributed.checkpoint.metadata."
_LAYOUTS = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}


class _MetadataIndex(PickledObject):
    """`MetadataIndex` kept as data, hashed by what identifies it (a stand-in hashes by class, so a dict of
    thousands of them would take quadratic time to build)."""

    qualname = _DCP + "MetadataIndex"
    __slots__ = ()

    def __hash__(self) -> int:
        state = object.__getattribute__(self, "state")
        if not isinstance(state, dict):
            return 0
        offset = state.get("offset")
        return hash((state.get("fqn"), tuple(offset) if isinstance(offset, (tuple, list)) else None))


def _layout(name: Any) -> torch.layout:
    if name not in _LAYOUTS:
        raise UnsafePickle(f"tensor layout {name!r}")
    return _LAYOUTS[name]


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise UnsafePickle("a path made of something other than strings")
    return "/".join(parts)


_CLASSES: dict[tuple[str, str], Any] = {
    **{
        (_DCP.rstrip("."), n): standin(_DCP + n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    },
    (_DCP.rstrip("."), "MetadataIndex"): _MetadataIndex,
    # megatron-core's torch_dist backend keeps every rank's save plan in `.metadata` (`all_local_plans`)
    **{
        ("torch.distributed.checkpoint.planner", n): standin(f"torch.distributed.checkpoint.planner.{n}")
        for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): standin(
        "torch.distributed.checkpoint.filesystem._StorageInfo"
    ),
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
}


def _refuse_pid(pid: Any) -> Any:
    raise UnsafePickle("a persistent id in DCP metadata")


@dataclass(frozen=True)
class Item:
    """Where one stored item is: its file (relative to the folder) and byte range."""

    file: str
    start: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: where it sits in the global tensor, and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    item: Item


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint: its flattened key, global shape, dtype and stored chunks."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]


def _state(obj: Any, what: str, path: str) -> dict[str, Any]:
    state = obj.state if isinstance(obj, PickledObject) else None
    if not isinstance(state, dict):
        raise CheckpointError(path, f"{what} is not a DCP {what} record")
    return state


def _ints(value: Any, what: str, path: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise CheckpointError(path, f"{what} {value!r} is not a list of non-negative integers")
    return tuple(value)


class DcpCheckpoint(st.Closeable):
    """One DCP folder: its table of tensors and objects, read item by item on demand.

    Args:
        folder: the checkpoint folder (a local path or a store URL).
        verify: check the CRC-32 of every record read (always on, except to measure what it costs).

    Example:
        >>> ckpt = DcpCheckpoint("/ckpt/step-100")
        >>> ckpt.tensor("model.layers.0.attention.wq.weight").shape
    """

    def __init__(self, folder: str, verify: bool = True):
        self.folder = st.normalize(folder)
        self.verify = verify
        self.path = st.join(self.folder, METADATA)
        data = st.read(self.path, MAX_METADATA)
        try:
            meta = SafeUnpickler(data, _refuse_pid, _CLASSES).load()
        except UnsafePickle as exc:
            raise CheckpointError(self.path, str(exc)) from None
        except Exception as exc:  # a damaged or hostile stream raises many exception types
            raise CheckpointError(self.path, f"cannot unpickle ({type(exc).__name__}: {exc})") from None
        if not isinstance(meta, PickledObject) or meta.qualname != _DCP + "Metadata":
            raise CheckpointError(self.path, "does not hold DCP Metadata")
        state = _state(meta, "Metadata", self.path)
        self.extra = {k: v for k, v in state.items() if k not in ("state_dict_metadata", "storage_data")}
        entries, storage = state.get("state_dict_metadata"), state.get("storage_data")
        if not isinstance(entries, dict) or not isinstance(storage, dict):
            raise CheckpointError(self.path, "has no state_dict_metadata or storage_data table")
        items: dict[tuple[str, tuple[int, ...] | None], Item] = {}
        for index, info in storage.items():
            where, place = _state(index, "MetadataIndex", self.path), _state(info, "_StorageInfo", self.path)
            if place.get("transform_descriptors"):
                raise CheckpointError(self.path, f"item {where.get('fqn')!r} is stored transformed; not read")
            file, start, length = place.get("relative_path"), place.get("offset"), place.get("length")
            if not isinstance(file, str) or "/" in file or file.startswith(".") or type(start) is not int:
                raise CheckpointError(self.path, f"item {where.get('fqn')!r} names a bad file or offset")
            if type(length) is not int or start < 0 or length < 0:
                raise CheckpointError(self.path, f"item {where.get('fqn')!r} has a bad length")
            offset = where.get("offset")
            items[(str(where.get("fqn")), None if offset is None else _ints(offset, "offset", self.path))] = Item(
                file, start, length
            )
        self.tensors: dict[str, TensorEntry] = {}
        self.objects: dict[str, Item] = {}
        for key, entry in entries.items():
            if not isinstance(key, str) or not isinstance(entry, PickledObject):
                raise CheckpointError(self.path, f"entry {key!r} is not a DCP storage record")
            if entry.qualname.endswith("BytesStorageMetadata"):
                if (key, None) not in items:
                    raise CheckpointError(self.path, f"object {key!r} has no stored item")
                self.objects[key] = items[(key, None)]
                continue
            self.tensors[key] = self._tensor_entry(key, entry, items)
        planner = self.extra.get("planner_data")
        self.paths: dict[str, tuple[Any, ...]] = {
            k: tuple(planner[k]) if isinstance(planner, dict) and isinstance(planner.get(k), (tuple, list)) else (k,)
            for k in [*self.tensors, *self.objects]
        }
        self._files: dict[str, st.Blob] = {}

    def _tensor_entry(self, key: str, entry: PickledObject, items: dict[Any, Any]) -> TensorEntry:
        state = _state(entry, "TensorStorageMetadata", self.path)
        shape = _ints(state.get("size"), f"{key}: size", self.path)
        props = state.get("properties")
        pstate = props.state if isinstance(props, PickledObject) else None
        dtype = pstate[0] if isinstance(pstate, tuple) and pstate else (pstate or {}).get("dtype")
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(self.path, f"tensor {key!r} has no dtype")
        chunks, covered = [], 0
        for chunk in state.get("chunks") or []:
            cstate = _state(chunk, "ChunkStorageMetadata", self.path)
            offsets = _ints(cstate.get("offsets"), f"{key}: chunk offsets", self.path)
            sizes = _ints(cstate.get("sizes"), f"{key}: chunk sizes", self.path)
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise CheckpointError(self.path, f"tensor {key!r} has a chunk of another rank than its shape")
            if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
                raise CheckpointError(self.path, f"tensor {key!r} has a chunk at {offsets} outside {shape}")
            if (key, offsets) not in items:
                raise CheckpointError(self.path, f"tensor {key!r} chunk at {offsets} has no stored item")
            chunks.append(Chunk(offsets, sizes, items[(key, offsets)]))
            covered += math.prod(sizes)
        if covered != math.prod(shape) or len({c.offsets for c in chunks}) != len(chunks):
            raise CheckpointError(
                self.path, f"tensor {key!r}: its chunks hold {covered} elements, not the {math.prod(shape)} of {shape}"
            )
        return TensorEntry(key, shape, dtype, tuple(chunks))

    def _window(self, key: str, item: Item) -> st.Window:
        if item.file not in self._files:
            self._files[item.file] = st.open_blob(st.join(self.folder, item.file))
        blob = self._files[item.file]
        return st.Window(blob, item.start, item.length, f"{blob.path} (item {key!r} at byte {item.start})")

    def _open(self, key: str, item: Item) -> TorchFile:
        return TorchFile(self._window(key, item), self.verify)

    @staticmethod
    def _lazy(tfile: TorchFile, entry: TensorEntry, chunk: Chunk) -> LazyTensor:
        lazy = tfile.obj
        if not isinstance(lazy, LazyTensor) or lazy.shape != chunk.sizes or lazy.dtype != entry.dtype:
            raise CheckpointError(
                tfile.path, f"holds {getattr(lazy, 'shape', type(lazy).__name__)}, not a {chunk.sizes} chunk"
            )
        return lazy

    def _chunk(self, entry: TensorEntry, chunk: Chunk) -> torch.Tensor:
        """One stored chunk of a tensor, every byte checked."""
        with self._open(entry.key, chunk.item) as tfile:
            value = self._lazy(tfile, entry, chunk).load()
            tfile.check_reads()
            return value

    @contextlib.contextmanager
    def ranged(self) -> Iterator[RangedReads]:
        """Reads of parts of tensors (`RangedReads`) that read only the bytes asked for; every record read from is
        checked when the block ends, so what they returned is trusted only then (an importer that wrote it leaves
        its output uncommitted when the check raises)."""
        with contextlib.ExitStack() as stack:
            reads = RangedReads(self, stack)
            try:
                yield reads
            finally:  # on a failure too: a damaged byte read in the block explains it better than what it raised
                reads.check()

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor stored under `key`, assembled from its chunks, every byte checked."""
        entry = self.tensors[key]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        for chunk in entry.chunks:
            out[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))].copy_(self._chunk(entry, chunk))
        return out

    def object(self, key: str) -> Any:
        """The object stored under `key` (a hyperparameter, a counter, a list of names), unpickled safely."""
        return load_file(self._window(key, self.objects[key]))

    def close(self) -> None:
        """Release every opened file."""
        for blob in self._files.values():
            blob.close()
        self._files = {}


def is_dcp_folder(path: str) -> bool:
    """Whether `path` is a DCP checkpoint folder (it holds `.metadata`)."""
    return st.isfile(st.join(path, METADATA))


class RangedReads:
    """Parts of one DCP checkpoint's tensors, each read alone from its chunks' files, kept open until the block of
    `DcpCheckpoint.ranged` ends: a stacked key's layers one at a time, a flat bucket's ranges. Reading a whole chunk
    for each part would read a bucket's chunk once per parameter in it."""

    def __init__(self, ckpt: DcpCheckpoint, stack: contextlib.ExitStack):
        self._ckpt, self._stack = ckpt, stack
        self._opened: dict[Chunk, tuple[TorchFile, LazyTensor]] = {}

    def _lazy(self, entry: TensorEntry, chunk: Chunk) -> LazyTensor:
        if chunk not in self._opened:
            tfile = self._stack.enter_context(self._ckpt._open(entry.key, chunk.item))
            self._opened[chunk] = (tfile, self._ckpt._lazy(tfile, entry, chunk))
        return self._opened[chunk][1]

    def at(self, key: str, index: tuple[int, ...]) -> torch.Tensor:
        """`tensor(key)[index]`, for an index into its leading dims."""
        entry, depth = self._ckpt.tensors[key], len(index)
        if depth > len(entry.shape) or any(not 0 <= i < d for i, d in zip(index, entry.shape)):
            raise CheckpointError(self._ckpt.path, f"{key} {entry.shape} has no entry {list(index)}")
        out = torch.empty(entry.shape[depth:], dtype=entry.dtype)
        filled = 0
        for chunk in entry.chunks:
            lead = [i - o for i, o in zip(index, chunk.offsets)]
            if any(not 0 <= i < s for i, s in zip(lead, chunk.sizes)):
                continue
            row = math.prod(chunk.sizes[depth:])
            first = sum(i * math.prod(chunk.sizes[d + 1 : depth]) for d, i in enumerate(lead)) * row
            piece = self._lazy(entry, chunk).read(first, row).view(chunk.sizes[depth:])
            out[tuple(slice(o, o + s) for o, s in zip(chunk.offsets[depth:], chunk.sizes[depth:]))] = piece
            filled += row
        if filled != out.numel():  # overlapping chunks can hide a gap the table's total does not show
            raise CheckpointError(self._ckpt.path, f"{key}{list(index)}: its chunks cover {filled} of {out.numel()}")
        return out

    def region(self, key: str, start: int, length: int) -> torch.Tensor:
        """Elements [start, start + length) of the 1-D tensor under `key`."""
        entry = self._ckpt.tensors[key]
        if len(entry.shape) != 1 or start < 0 or start + length > entry.shape[0]:
            raise CheckpointError(self._ckpt.path, f"{key} {entry.shape} has no elements [{start}, {start + length})")
        out = torch.empty(length, dtype=entry.dtype)
        filled = 0
        for chunk in entry.chunks:
            at = chunk.offsets[0]
            lo, hi = max(start, at), min(start + length, at + chunk.sizes[0])
            if lo < hi:
                self._lazy(entry, chunk).read(lo - at, hi - lo, out[lo - start : hi - start])
                filled += hi - lo
        if filled != length:
            raise CheckpointError(
                self._ckpt.path, f"{key}: its chunks cover {filled} of elements [{start}, {start + length})"
            )
        return out

    def check(self) -> None:
        """Raise, naming the file, if a record read from fails its CRC-32 (reads only the bytes no part covered)."""
        for tfile, _ in self._opened.values():
            tfile.check_reads()
