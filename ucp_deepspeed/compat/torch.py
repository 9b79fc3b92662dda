"""The reach into torch's checkpoint machinery: the globals `torch.load(weights_only=True)` may build beyond
DeepSpeed's, DCP's metadata classes, which `DcpWriter` fills as `FileSystemWriter` would, shared storages, and
`torch.save`'s CRC switch.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io.safe_pickle import user_allowed


def user_safe_globals() -> list[Any]:
    """The globals a user trusts (`UCP_ALLOW_PICKLE`), imported by exact name."""
    out = []
    for qualname in sorted(user_allowed()):
        module, _, name = qualname.rpartition(".")
        if not module or not name.isidentifier():
            raise CheckpointError("UCP_ALLOW_PICKLE", f"{qualname!r} is not module.Name")
        out.append(getattr(importlib.import_module(module), name))
    return out


class DcpWriter:
    """A DCP folder written one item at a time in the layout torch's `FileSystemWriter` writes (`__0_0.distcp`, each
    item a whole `torch.save` archive), `.metadata` last: the folder is a checkpoint only once that lands.

    Reaches into `torch.distributed.checkpoint`: its metadata dataclasses and `filesystem._StorageInfo`, which is what
    `FileSystemReader` expects in `storage_data`.
    """

    FILE = "__0_0.distcp"

    def __init__(self, folder: str):
        from ucp_deepspeed.io import storage as st

        self.folder, self._st = folder, st
        self._stack = contextlib.ExitStack()
        self._out = self._stack.enter_context(st.writer(st.join(folder, self.FILE)))
        self._offset = 0
        self._entries: dict[str, Any] = {}
        self._storage: dict[Any, Any] = {}
        self._paths: dict[str, tuple[Any, ...]] = {}

    def _put(self, key: str, path: tuple[Any, ...], data: bytes | memoryview, offset: Any) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        if key in self._paths:
            raise CheckpointError(self.folder, f"two entries would both be stored as {key!r}")
        self._out.write(data)
        self._storage[MetadataIndex(key, offset)] = _StorageInfo(self.FILE, self._offset, len(data))
        self._offset += len(data)
        self._paths[key] = path

    def tensor(self, key: str, path: tuple[Any, ...], value: Any, item: bytes | memoryview) -> None:
        """Add a whole tensor (`item` is its `torch.save` bytes), stored as one chunk."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

        origin = [0] * value.dim()
        self._put(key, path, item, origin)
        self._entries[key] = TensorStorageMetadata(
            TensorProperties(dtype=value.dtype),
            value.size(),
            [ChunkStorageMetadata(offsets=type(value.size())(origin), sizes=value.size())],
        )

    def object(self, key: str, path: tuple[Any, ...], item: bytes | memoryview) -> None:
        """Add any other value (`item` is its `torch.save` bytes)."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        self._put(key, path, item, None)
        self._entries[key] = BytesStorageMetadata()

    def put(self, where: tuple[Any, ...], value: Any) -> None:
        """Add the entry at `where` (its path in the nested state dict, flattened to its key as DCP flattens it): a
        tensor as one chunk of a copy of its own (a view would save its whole storage), anything else pickled."""
        from ucp_deepspeed.io.torch_file import to_bytes

        key = ".".join(str(p) for p in where)
        if isinstance(value, torch.Tensor):
            value = value.detach().contiguous().clone()
            self.tensor(key, where, value, to_bytes(value))
        else:
            self.object(key, where, to_bytes(value))

    def finish(self) -> None:
        """Close the data file, then write `.metadata`."""
        import pickle

        from torch.distributed.checkpoint.metadata import Metadata

        self._stack.close()
        meta = Metadata(self._entries, planner_data=self._paths, storage_data=self._storage, version="1.0.0")
        self._st.write(self._st.join(self.folder, ".metadata"), pickle.dumps(meta))

    def abort(self) -> None:
        """Drop what was written of the data file."""
        self._stack.__exit__(CheckpointError, CheckpointError(self.folder, "export abandoned"), None)


def share_storage(storage: torch.UntypedStorage) -> tuple[bytes, bytes, int]:
    """The handle another process opens a CPU storage by, after moving it into named shared memory once (torch's
    `file_system` sharing, whose shm manager unlinks it when no process maps it any more, a crashed one included);
    the same handle every later call."""
    handle: tuple[bytes, bytes, int] = storage._share_filename_cpu_()
    return handle


def open_shared_storage(handle: tuple[bytes, bytes, int]) -> torch.UntypedStorage:
    """The storage `share_storage` shared, mapped into this process (no copy)."""
    return torch.UntypedStorage._new_shared_filename_cpu(*handle)


@contextlib.contextmanager
def crcs_left_to_us() -> Iterator[bool]:
    """`torch.save` without its own CRC-32 pass, which runs at about 0.5 GB/s and is most of a save's time: True if
    torch could be told so, and its archives then need `torch_file.fill_crcs` before anything reads them."""
    try:
        from torch.utils.serialization import config

        before = config.save.compute_crc32
    except (ImportError, AttributeError):  # a torch before 2.6 has no such switch
        yield False
        return
    config.save.compute_crc32 = False
    try:
        yield True
    finally:
        config.save.compute_crc32 = before
