"""Asynchronous checkpoints: training stalls only while the state is copied to host memory.

DeepSpeed's save path hands each file's state dict to the engine's checkpoint engine. This one copies every tensor
in it into host memory that later optimizer steps cannot change: staging buffers in shared memory, made at a file's
first save and reused by every later one (`Staging`). A writer process of its own (`write_worker`), made once, then
`torch.save`s the staged state to `<file>.tmp...`, stamps, fsyncs and renames it into place, away from the trainer's
GIL, so a file exists only when it is whole: a tag whose writes a crash cut short is incomplete, and `resume_tag`
skips it. A file for an object store, or a state that shared memory cannot hold, is copied into fresh memory and
written by a thread instead (with a warning for the second). DeepSpeed drives such "decoupled" engines from the
optimizer step: at each step it asks whether the pending checkpoint is ready. All ranks agree through one small
all-reduce, and only when every rank has written all its files does rank 0 point `latest` at the new tag.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.runtime.write_worker import WriterProcess, upload_file, write_file

__all__ = ["AsyncCheckpointEngine", "Staging", "snapshot", "upload_file", "write_file"]

log = logging.getLogger("ucp_deepspeed")
SHARED_MEMORY = "/dev/shm"  # where torch's file_system sharing keeps its segments on Linux


def _key(storage: torch.UntypedStorage) -> tuple:
    return (storage.device, storage.data_ptr(), storage.nbytes())


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a state dict, in the order `_rebuilt` meets them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _rebuilt(obj: Any, storages: dict[tuple, torch.UntypedStorage]) -> Any:
    """`obj` with each tensor on the storage `storages` maps its own to (tensors that shared one still share one, as
    torch.save keeps them) and every other value copied."""
    if isinstance(obj, torch.Tensor):
        storage = storages[_key(obj.untyped_storage())]
        copied = torch.empty(0, dtype=obj.dtype).set_(storage, obj.storage_offset(), obj.size(), obj.stride())
        return torch.nn.Parameter(copied, obj.requires_grad) if isinstance(obj, torch.nn.Parameter) else copied
    if isinstance(obj, dict):
        mapping = copy.copy(obj)  # keeps OrderedDict / defaultdict
        for name, value in obj.items():
            mapping[name] = _rebuilt(value, storages)
        return mapping
    if isinstance(obj, list):
        return [_rebuilt(v, storages) for v in obj]
    if isinstance(obj, tuple):
        items = [_rebuilt(v, storages) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def _distinct_storages(obj: Any) -> dict[tuple, torch.UntypedStorage]:
    return {_key(t.untyped_storage()): t.untyped_storage() for t in _tensors(obj)}


def snapshot(obj: Any) -> Any:
    """A copy of a state dict in fresh host memory; tensors that shared a storage still share one."""
    sources = _distinct_storages(obj)
    return _rebuilt(obj, {k: s.cpu() if s.device.type != "cpu" else s.clone() for k, s in sources.items()})


class Staging:
    """Host buffers in shared memory that each file's tensors are copied into: made at the file's first save and
    reused by every later save whose storages have the same sizes (a job saves the same shapes each time), so a save
    after the first allocates nothing and faults in no fresh page. It holds one copy of this rank's checkpoint for
    the engine's life (`nbytes`); the writer process maps the same memory."""

    def __init__(self) -> None:
        self._slots: dict[str, list[torch.UntypedStorage]] = {}  # file name in the tag -> its staging storages

    @property
    def nbytes(self) -> int:
        """Shared memory held, in bytes."""
        return sum(slot.nbytes() for slots in self._slots.values() for slot in slots)

    def stage(self, name: str, state: Any) -> tuple[Any, list[Copy]] | None:
        """`state` rebuilt on the staging of file `name`, with the copies that fill it still to make, or None if new
        buffers it needs would not fit in shared memory."""
        sources = _distinct_storages(state)
        sizes = [s.nbytes() for s in sources.values()]
        slots = self._slots.get(name)
        if slots is None or [s.nbytes() for s in slots] != sizes:
            self._slots.pop(name, None)
            if sum(sizes) > _shared_memory_free():
                return None
            slots = self._slots[name] = [_shared(n) for n in sizes]
        copies = [Copy(key=key, source=source, slot=slot) for (key, source), slot in zip(sources.items(), slots)]
        return _rebuilt(state, dict(zip(sources, slots))), copies


class Copy(NamedTuple):
    """One storage of a saved state and the staging storage it is copied into."""

    key: tuple
    source: torch.UntypedStorage
    slot: torch.UntypedStorage

    def run(self) -> None:
        """Copy it (as bytes: a tensor copy, which lets other threads run meanwhile)."""
        _as_bytes(self.slot).copy_(_as_bytes(self.source))


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _shared(nbytes: int) -> torch.UntypedStorage:
    from ucp_deepspeed import compat

    storage = torch.UntypedStorage(nbytes)
    compat.share_storage(storage)  # into shared memory now, once: the copy there faults in every page
    return storage


def _shared_memory_free() -> int:
    """Bytes shared memory can still take (unbounded where there is no /dev/shm to ask)."""
    try:
        found = os.statvfs(SHARED_MEMORY)
    except OSError:
        return 1 << 62
    return found.f_bavail * found.f_frsize


def _failure(path: str, future: Future) -> str:
    """One line for a failed write: the file, then why (once, though the error names the file too)."""
    exc = future.exception()
    reason = exc.reason if isinstance(exc, CheckpointError) and exc.path == path else str(exc)
    return f"{path}: {reason}"


def _pass_on(done: Future, to: Future) -> None:
    exc = done.exception()
    if exc is None:
        to.set_result(done.result())
    else:
        to.set_exception(exc)


class AsyncCheckpointEngine(TorchCheckpointEngine):
    """A DeepSpeed checkpoint engine that stages the state in host memory and writes it in a process of its own."""

    def __init__(
        self,
        config_params: object = None,
        process: bool = True,
        module: torch.nn.Module | None = None,
        writer_cpus: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config_params)
        self.name = "UcpAsyncCheckpointEngine"
        self.stamps_itself = True  # the file exists only once the writer has written it
        self.staging = Staging()
        # started now, so that its start (it imports torch) overlaps training before the first save
        self._process: WriterProcess | None = WriterProcess(writer_cpus) if process else None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-async-save")
        # the copies into staging run here while the next forward and backward run: nothing a step changes is
        # changed before the optimizer step, which waits for them (`wait_staged`); the module's buffers, which a
        # forward may change, are copied at the save (all of it without the module to tell them)
        self._module = module
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-async-stage")
        self._copies: list[Future] = []
        self._writes: list[tuple[str, Future]] = []
        self._pending: CheckpointCommitInfo | None = None
        self._warned = False
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
        guard = getattr(self, "ucp_guard", None)
        save_id = guard.save_id if guard is not None else ""
        self._writes.append((path, self._write(state_dict, path, save_id)))

    def _write(self, state_dict: dict, path: str, save_id: str) -> Future:
        if self._process is not None and not st.is_url(path):
            staged = self.staging.stage(st.basename(path), state_dict)
            if staged is not None:
                state, copies = staged
                now = self._changed_by_a_forward()
                later = []
                for one in copies:
                    if now is None or one.key in now:
                        one.run()
                    else:
                        later.append(one)
                written: Future = Future()
                self._copies.append(self._copier.submit(self._stage_then_write, later, path, state, save_id, written))
                return written
            self._warn_once(path)
        state = snapshot(state_dict)
        return self._thread.submit(write_file, path, state, self.zipfile_serialization, save_id)

    def _changed_by_a_forward(self) -> set[tuple] | None:
        """The storages a forward may change before the optimizer step (the module's buffers); None: any."""
        if self._module is None:
            return None
        return {_key(b.untyped_storage()) for b in self._module.buffers()}

    def _stage_then_write(self, copies: list[Copy], path: str, state: Any, save_id: str, written: Future) -> None:
        try:
            for one in copies:
                one.run()
            assert self._process is not None
            inner = self._process.submit(path, state, self.zipfile_serialization, save_id)
        except Exception as exc:  # raised at the commit, on every rank, naming the file
            written.set_exception(CheckpointError(path, f"staging failed: {type(exc).__name__}: {exc}"))
            return
        inner.add_done_callback(lambda done: _pass_on(done, written))

    def wait_staged(self) -> None:
        """Block until this rank's copies into staging are made: before the optimizer step changes what they copy."""
        copies, self._copies = self._copies, []
        for one in copies:
            one.result()

    def _warn_once(self, path: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "ucp: async save: %s does not fit in shared memory (%s has %.2f GB free, %.2f GB staged already); "
                "copying it into fresh memory at each save and writing it from a thread, which shares the trainer's "
                "GIL. Enlarge %s (docker run --shm-size) for the writer process",
                path,
                SHARED_MEMORY,
                _shared_memory_free() / 1e9,
                self.staging.nbytes / 1e9,
                SHARED_MEMORY,
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
        self.wait_staged()
        for _, future in self._writes:
            future.exception()

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The pending checkpoint once every rank has written it, else None; collective while one is pending."""
        if self._pending is None:
            return None
        done = [future.done() for _, future in self._writes]  # read once: a write may finish meanwhile
        failures = [
            _failure(path, future)
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
        failures = [_failure(path, f) for path, f in self._writes if f.exception() is not None]
        log.error(
            "ucp: the asynchronous save of %s was not committed before exit (%s); `latest` still names the previous "
            "save: call engine.wait_for_checkpoint() before exiting",
            st.join(str(self._pending.save_dir), str(self._pending.tag)),
            "; ".join(failures) or "no optimizer step or wait committed it",
        )

    def cleanup(self) -> None:
        """Finish this rank's writes when the engine is destroyed, and end the writer; `latest` moves only through a
        commit."""
        self.wait()
        self._thread.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        if self._process is not None:
            self._process.close()
            self._process = None
