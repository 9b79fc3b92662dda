"""Asynchronous checkpoints: training stalls only while the state is copied to host memory.

DeepSpeed's save path hands each file's state dict to the engine's checkpoint engine. This one
copies every tensor in it to host memory, a snapshot that later optimizer steps cannot change. A
writer thread then `torch.save`s the snapshot to `<file>.tmp...`, fsyncs it and renames it into
place, so a file exists only when it is whole: a tag whose writes a crash cut short is incomplete,
and `resume_tag` skips it. DeepSpeed drives such "decoupled" engines from the optimizer step: at each
step it asks whether the pending checkpoint is ready. All ranks agree through one small all-reduce,
and only when every rank has written all its files does rank 0 point `latest` at the new tag.
"""

from __future__ import annotations

import atexit
import copy
import io
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.atomic import atomic_path
from ucp_deepspeed.io.torch_file import stamp

log = logging.getLogger("ucp_deepspeed")


def snapshot(obj: Any, storages: dict[tuple, torch.UntypedStorage] | None = None) -> Any:
    """A host-memory copy of a state dict; tensors that shared a storage still share one, as torch.save keeps them."""
    storages = {} if storages is None else storages
    if isinstance(obj, torch.Tensor):
        source = obj.untyped_storage()
        key = (source.device, source.data_ptr(), source.nbytes())
        storage = storages.get(key)
        if storage is None:
            storage = storages[key] = source.cpu() if source.device.type != "cpu" else source.clone()
        copied = torch.empty(0, dtype=obj.dtype).set_(storage, obj.storage_offset(), obj.size(), obj.stride())
        return torch.nn.Parameter(copied, obj.requires_grad) if isinstance(obj, torch.nn.Parameter) else copied
    if isinstance(obj, dict):
        mapping = copy.copy(obj)  # keeps OrderedDict / defaultdict
        for name, value in obj.items():
            mapping[name] = snapshot(value, storages)
        return mapping
    if isinstance(obj, list):
        return [snapshot(v, storages) for v in obj]
    if isinstance(obj, tuple):
        items = [snapshot(v, storages) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def upload_file(path: str, state: Any, save_id: str = "", zipfile_serialization: bool = True) -> int:
    """`torch.save` one checkpoint file to an object store, stamped with its save id; returns its size. The archive
    streams into the store's writer (a local spool, not memory) and is sent whole once stamped."""
    with st.writer(path) as out:
        torch.save(state, out, _use_new_zipfile_serialization=zipfile_serialization)
        if save_id:
            stamp(out, save_id)
        return out.seek(0, io.SEEK_END)


def write_file(path: str, state: Any, zipfile_serialization: bool, save_id: str = "") -> int:
    """`torch.save` one checkpoint file atomically, stamped with its save id; returns its size (module-level so
    tests can interrupt it)."""
    if st.is_url(path):
        return upload_file(path, state, save_id, zipfile_serialization)
    with atomic_path(path) as tmp:
        torch.save(state, tmp, _use_new_zipfile_serialization=zipfile_serialization)
        if save_id:
            stamp(tmp, save_id)
    return st.size(path)


class AsyncCheckpointEngine(TorchCheckpointEngine):
    """A DeepSpeed checkpoint engine that snapshots to host memory and writes in a background thread."""

    def __init__(self, config_params: object = None) -> None:
        super().__init__(config_params)
        self.name = "UcpAsyncCheckpointEngine"
        self.stamps_itself = True  # the file exists only once the writer thread has written it
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-async-save")
        self._writes: list[tuple[str, Future]] = []
        self._pending: CheckpointCommitInfo | None = None
        atexit.register(self._report_at_exit)

    def is_decoupled(self) -> bool:
        """Tell DeepSpeed to leave `latest` alone at save time and ask `get_commit_info` at each step."""
        return True

    def create(self, info: CheckpointCommitInfo) -> None:
        """Start a checkpoint; the caller has committed the previous one (see `engine.wait_for_checkpoint`)."""
        if self._pending is not None:
            raise CheckpointError(
                st.join(str(info.save_dir), str(info.tag)),
                f"save started while {self._pending.tag} is still being written; "
                "call engine.wait_for_checkpoint() first",
            )
        self._pending = info

    def save(self, state_dict: dict, path: str) -> None:
        """Copy to host memory now, write later."""
        state = snapshot(state_dict)
        guard = getattr(self, "ucp_guard", None)
        self._writes.append(
            (
                path,
                self._writer.submit(
                    write_file, path, state, self.zipfile_serialization, guard.save_id if guard is not None else ""
                ),
            )
        )

    def uploaded(self) -> list[tuple[str, int]]:
        """(location, size) of the files of this checkpoint written to an object store: what its commit lists."""
        return [
            (path, future.result())
            for path, future in self._writes
            if st.is_url(path) and future.done() and future.exception() is None
        ]

    def wait(self) -> None:
        """Block until this rank's queued files are written (or have failed)."""
        for _, future in self._writes:
            future.exception()

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The pending checkpoint once every rank has written it, else None; collective while one is pending."""
        if self._pending is None:
            return None
        done = [future.done() for _, future in self._writes]  # read once: a write may finish meanwhile
        failures = [
            f"{path}: {future.exception()}"
            for (path, future), finished in zip(self._writes, done)
            if finished and future.exception() is not None
        ]
        counts = torch.tensor(
            [done.count(False), len(failures)], dtype=torch.int64, device=get_accelerator().current_device_name()
        )
        dist.all_reduce(counts)
        unfinished, failed = counts.tolist()
        if failed:
            # every rank raises the same line, naming a file that failed and why, whichever rank wrote it
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, failures)
            first = next(f[0] for f in everyone if f)
            raise CheckpointError(
                st.join(str(self._pending.save_dir), str(self._pending.tag)),
                f"async save: {failed} file(s) failed to write, so `latest` was not moved (first: {first})",
            )
        return self._pending if unfinished == 0 else None

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Forget the finished checkpoint; DeepSpeed then writes `latest` on rank 0."""
        self.wait()
        self._writes, self._pending = [], None
        return True

    def _report_at_exit(self) -> None:
        """At exit, finish the writes under way (no file is left half sent) and say that the save was not committed:
        committing takes every rank, which may be gone; `latest` still names the previous save."""
        if self._pending is None:
            return
        self.wait()
        failures = [f"{path}: {f.exception()}" for path, f in self._writes if f.exception() is not None]
        log.error(
            "ucp: the asynchronous save of %s was not committed before exit (%s); `latest` still names the previous "
            "save: call engine.wait_for_checkpoint() before exiting",
            st.join(str(self._pending.save_dir), str(self._pending.tag)),
            "; ".join(failures) or "no optimizer step or wait committed it",
        )

    def cleanup(self) -> None:
        """Finish this rank's writes when the engine is destroyed; `latest` moves only through a commit."""
        self.wait()
        self._writer.shutdown(wait=True)
