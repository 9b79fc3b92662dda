"""A native checkpoint read as if it were its universal conversion, with no universal copy written.

`DirectCheckpoint` offers what `runtime.restore` reads from a `UniversalCheckpoint` (the manifest, the
parameter and buffer tables, element ranges of each state, buffers, the training state), straight from
DeepSpeed's rank files. A range of a parameter that no tensor-parallel split cuts is read from the ZeRO
fragments that overlap it, and only their overlapping part; a split parameter is merged whole first (the
last one merged is kept, since a restore reads each parameter's states one after another). A replicated
parameter's range is read from each tensor-parallel rank's copy as well, and a copy that differs is refused.
Every read is recorded for the CRC check of the source archives (`NativeCheckpoint.check_reads`). Inside
`batch`, ranges are read once the block ends, sorted by archive and offset, each run of adjacent bytes in one
request: a rank that restores a partition made of many parameters' fragments in one source file sends one
request per run, not one per parameter.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ucp_deepspeed.convert.core import assemble, build_manifest
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import Manifest
from ucp_deepspeed.format.metadata import VALUE, ParamSlot
from ucp_deepspeed.format.universal import TensorReader, torch_dtype
from ucp_deepspeed.geometry.layout import Layout
from ucp_deepspeed.io.stats import record as record_io
from ucp_deepspeed.io.torch_file import read_spans
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.sources.native import RankFiles
from ucp_deepspeed.sources.plan import FullTensor, refuse_drift

REPLICA_CHUNK = 4 * 2**20
"""Elements of a replica compared at a time (16 MiB of fp32)."""


class DirectCheckpoint(TensorReader):
    """The universal view of a native tag, read on demand from its rank files."""

    def __init__(self, src: NativeCheckpoint, manifest: Manifest | None = None):
        """`manifest`: `build_manifest(src)` made by one rank and shared (it opens the first rank files and lists
        every file of the tag)."""
        self.src = src
        self.root = src.tag_dir
        self.manifest = manifest if manifest is not None else build_manifest(src)
        self.params = self.manifest.params
        self.buffers = self.manifest.buffers
        self._tensors = {t.name: t for t in src.tensors}
        self._lock = threading.Lock()
        self._merged: tuple[str, str, torch.Tensor] | None = None
        self._batch = threading.local()

    def _tensor(self, name: str) -> Any:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise CheckpointError(self.root, f"no tensor {name!r} in this checkpoint")
        return tensor

    def _whole(self, name: str, key: str) -> torch.Tensor:
        """One state of a full tensor, merged from its shards; the last one merged is reused."""
        with self._lock:
            if self._merged is not None and self._merged[:2] == (name, key):
                return self._merged[2]
        merged = assemble(self.src, self._tensor(name), key)
        record_io(copied=merged.nbytes if len(self._tensor(name).shards) > 1 else 0)
        with self._lock:
            self._merged = (name, key, merged)
        return merged

    def _in_place(self, name: str, key: str) -> tuple[RankFiles, ParamSlot] | None:
        """The rank files and slot a state is read from by element range, when no tensor-parallel split cuts it."""
        tensor = self._tensor(name)
        shard = tensor.shards[0] if len(tensor.shards) == 1 else None
        if shard is not None and isinstance(shard.item, ParamSlot) and not tensor.layout.is_split and key != VALUE:
            return self.src.ranks[shard.mp_rank], shard.item
        return None

    def read(self, name: str, key: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start+numel) of a state of a full tensor, flattened."""
        numel = math.prod(self._tensor(name).shape) - start if numel is None else numel
        found = self._in_place(name, key)
        if found is not None:
            out = found[0].read_param_range(found[1], key, start, numel)
            self._check([(self._tensor(name), key, start, out)])
            return out
        return self._whole(name, key).reshape(-1)[start : start + numel]

    def read_into(self, name: str, key: str, start: int, out: torch.Tensor) -> None:
        """Fill `out` from the fragments that hold the range; inside `batch`, once the block ends, merged."""
        found = self._in_place(name, key)
        if found is None or out.dtype != torch.float32 or not out.is_contiguous():
            super().read_into(name, key, start, out)
            return
        self._fill(*found, key, start, out, self._tensor(name))

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
        """A range of tensor-parallel rank `rank`'s share; a share that is exactly one saved rank's (the same split at
        the same size, no vocab padding to drop) is read by element range from that rank's fragments alone."""
        tensor = self._tensor(name)
        shard = tensor.shards[rank] if len(tensor.shards) == tp else None
        if (
            shard is None
            or key == VALUE
            or not layout.is_split
            or layout.vocab
            or layout != tensor.layout
            or not isinstance(shard.item, ParamSlot)
            or tuple(shard.item.shape) != tuple(local_shape)
            or (out is not None and (out.dtype != torch.float32 or not out.is_contiguous()))
        ):
            return super().read_local(name, key, layout, local_shape, rank, tp, start, numel, out)
        numel = (out.numel() if out is not None else math.prod(local_shape) - start) if numel is None else numel
        out = torch.empty(numel, dtype=torch.float32) if out is None else out
        self._fill(self.src.ranks[shard.mp_rank], shard.item, key, start, out)
        return out

    def _fill(
        self,
        files: RankFiles,
        slot: ParamSlot,
        key: str,
        start: int,
        out: torch.Tensor,
        tensor: FullTensor | None = None,
    ) -> None:
        """Read a range of one rank's share of a parameter into `out`: now, or at the end of the enclosing `batch`;
        then the same range of each of `tensor`'s replicas is compared with it."""
        pending = getattr(self._batch, "pending", None)
        for tfile, spans in files.param_range_spans(slot, key, start, out).items():
            if pending is None:
                tfile.read_spans(spans)
            else:
                pending.setdefault(tfile, []).extend(spans)
        checks = [(tensor, key, start, out)] if tensor is not None and tensor.replicas else []
        if pending is None:
            self._check(checks)
        else:
            self._batch.checks.extend(checks)

    def _check(self, checks: list[tuple[FullTensor, str, int, torch.Tensor]]) -> None:
        """Compare each read range (`out`, starting at element `start`) with every replica's copy of it, a bounded
        chunk at a time: a batch may hold a whole partition of replicated tensors, which copies would double."""
        if getattr(self._batch, "compared", False):
            return
        for tensor, key, start, out in checks:
            for replica in tensor.replicas:
                if not isinstance(replica.item, ParamSlot):
                    raise CheckpointError(self.root, f"'{tensor.name}' is a parameter on tensor-parallel rank 0 only")
                files = self.src.ranks[replica.mp_rank]
                for at in range(0, out.numel(), REPLICA_CHUNK):
                    want = out.reshape(-1)[at : at + REPLICA_CHUNK]
                    got = files.read_param_range(replica.item, key, start + at, want.numel())
                    refuse_drift(self.root, tensor, key, replica, want, got)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold the block's reads, then read them all at once: runs of adjacent bytes merged, every archive's
        requests in flight together on a store."""
        if getattr(self._batch, "pending", None) is not None:  # nested: the outer block reads
            yield
            return
        self._batch.pending, self._batch.checks = {}, []
        try:
            yield
            pending, checks = self._batch.pending, self._batch.checks
        finally:
            self._batch.pending = self._batch.checks = None
        read_spans(pending)
        self._check(checks)

    @contextlib.contextmanager
    def replicas_compared(self) -> Iterator[None]:
        """Reads in the block are not compared with their replicas: the ranks that restored them did (see
        `TensorReader.replicas_compared`); their CRCs are still checked."""
        before = getattr(self._batch, "compared", False)
        self._batch.compared = True
        try:
            yield
        finally:
            self._batch.compared = before

    def read_slice(self, name: str, key: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries [start, start+length) along `dim` of a state of a full tensor."""
        whole = self._whole(name, key)
        return whole.reshape(1) if not whole.dim() else whole.narrow(dim, start, length)

    def read_buffer(self, name: str) -> torch.Tensor:
        """A whole module buffer, in its saved dtype."""
        return assemble(self.src, self._tensor(name)).to(torch_dtype(self.buffers[name].dtype))

    def load_state(self) -> dict[str, Any]:
        """The non-tensor training state: scheduler, each model-parallel rank's client state, optimizer-wrapper
        state."""
        return self.src.training_state()

    def close(self) -> None:
        """Release the rank files."""
        self.src.close()
