"""A native checkpoint read as if it were its universal conversion, with no universal copy written.

`DirectCheckpoint` offers what `runtime.restore` reads from a `UniversalCheckpoint` (the manifest, the
parameter and buffer tables, element ranges of each state, buffers, the training state), straight from
DeepSpeed's rank files. A range of a parameter that no tensor-parallel split cuts is read from the ZeRO
fragments that overlap it, and only their overlapping part; a split parameter is merged whole first (the
last one merged is kept, since a restore reads each parameter's states one after another).
Every read is recorded for the CRC check of the source archives (`NativeCheckpoint.check_reads`).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from ucp_deepspeed.convert.core import assemble, build_manifest
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.metadata import VALUE, ParamSlot
from ucp_deepspeed.format.universal import TensorReader, torch_dtype
from ucp_deepspeed.sources import NativeCheckpoint


class DirectCheckpoint(TensorReader):
    """The universal view of a native tag, read on demand from its rank files."""

    def __init__(self, src: NativeCheckpoint):
        self.src = src
        self.root = src.tag_dir
        self.manifest = build_manifest(src)
        self.params = self.manifest.params
        self.buffers = self.manifest.buffers
        self._tensors = {t.name: t for t in src.tensors}
        self._lock = threading.Lock()
        self._merged: tuple[str, str, torch.Tensor] | None = None

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
        with self._lock:
            self._merged = (name, key, merged)
        return merged

    def read(self, name: str, key: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start+numel) of a state of a full tensor, flattened."""
        tensor = self._tensor(name)
        numel = math.prod(tensor.shape) - start if numel is None else numel
        shard = tensor.shards[0] if len(tensor.shards) == 1 else None
        if shard is not None and isinstance(shard.item, ParamSlot) and not tensor.layout.is_split and key != VALUE:
            return self.src.ranks[shard.mp_rank].read_param_range(shard.item, key, start, numel)
        return self._whole(name, key).reshape(-1)[start : start + numel]

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
