"""The asynchronous save's writer: a process of its own, made once per engine, that `torch.save`s each file from host
memory it shares with the trainer, stamps it, fsyncs it and renames it into place, the disk writing while torch
serializes (`io.atomic.written_back`). Its `torch.save` skips torch's CRC pass (about 0.5 GB/s, more than the disk
takes to write the bytes), and `isal` fills the CRCs in afterwards from the page cache (over 10 GB/s): the archive is
the one torch would have written.

Serializing, checksumming and writing in a thread held the trainer's GIL for much of the write (the async stall was
no smaller than a synchronous save, measured in docs/benchmarks.md). This process holds its own. It is started with
`python -m ucp_deepspeed.runtime.write_worker` (on the CPUs `async_writer_cpus` names, if set), not by
`multiprocessing`'s spawn, which would import the user's training script again in the child. It imports torch and
this package, not DeepSpeed.

Protocol, over two pipes: the trainer sends `(job id, path, state, zipfile serialization, save id)`, pickled, with
every tensor's storage given by its shared-memory handle (`compat.share_storage`) instead of its bytes; the writer
answers `(job id, size written, error line or None)`. Both sides are this package's own code: nothing read from a
checkpoint passes through these pickles.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import IO, Any

import torch

from ucp_deepspeed import compat
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.atomic import atomic_path, written_back
from ucp_deepspeed.io.torch_file import fill_crcs, stamp

_LENGTH = struct.Struct("<Q")


def upload_file(path: str, state: Any, save_id: str = "", zipfile_serialization: bool = True) -> int:
    """`torch.save` one checkpoint file to an object store, stamped with its save id; returns its size. The archive
    streams into the store's writer (a local spool, not memory) and is sent whole once stamped."""
    with st.writer(path) as out:
        torch.save(state, out, _use_new_zipfile_serialization=zipfile_serialization)
        if save_id:
            stamp(out, save_id)
        return out.seek(0, io.SEEK_END)


def write_file(path: str, state: Any, zipfile_serialization: bool, save_id: str = "", crcs_later: bool = False) -> int:
    """`torch.save` one checkpoint file atomically, stamped with its save id; returns its size (module-level so
    tests can interrupt it). `crcs_later`: torch writes no CRCs (`compat.crcs_left_to_us`), they are filled in here."""
    if st.is_url(path):
        return upload_file(path, state, save_id, zipfile_serialization)
    with atomic_path(path) as tmp:
        with written_back(tmp):  # the disk writes while torch serializes
            torch.save(state, tmp, _use_new_zipfile_serialization=zipfile_serialization)
        if crcs_later:
            fill_crcs(tmp)
        if save_id:
            stamp(tmp, save_id)
    return st.size(path)


def _send(pipe: IO[bytes], message: bytes) -> None:
    pipe.write(_LENGTH.pack(len(message)) + message)
    pipe.flush()


def _receive(pipe: IO[bytes]) -> bytes | None:
    head = pipe.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    return pipe.read(_LENGTH.unpack(head)[0])


class _SharedPickler(pickle.Pickler):
    """Pickles a staged state: each storage as its shared-memory handle, never its bytes."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            return ("storage", compat.share_storage(obj._untyped_storage), obj.dtype)
        if isinstance(obj, torch.UntypedStorage):
            return ("storage", compat.share_storage(obj), torch.uint8)
        return None


class _SharedUnpickler(pickle.Unpickler):
    """Rebuilds a staged state in the writer, each storage mapped from the trainer's shared memory once, so tensors
    that shared one there share one here (torch.save writes it once)."""

    def __init__(self, file: IO[bytes]):
        super().__init__(file)
        self._mapped: dict[tuple, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        _, handle, dtype = pid
        storage = self._mapped.get(handle)
        if storage is None:
            storage = self._mapped[handle] = compat.open_shared_storage(handle)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


class WriterProcess:
    """The trainer's side: the writer process and a thread that turns its answers into each job's `Future`."""

    def __init__(self, cpus: Sequence[int] | None = None) -> None:
        """Start the writer, on `cpus` if given (else on this process's)."""
        if cpus is not None and not hasattr(os, "sched_setaffinity"):
            raise ValueError(f'"async_writer_cpus": this platform ({sys.platform}) cannot bind a process to CPUs')
        to_child_r, self._to_child_w = os.pipe()
        self._from_child_r, from_child_w = os.pipe()
        where = [",".join(map(str, cpus))] if cpus is not None else []
        self._process = subprocess.Popen(
            [sys.executable, "-m", "ucp_deepspeed.runtime.write_worker", str(to_child_r), str(from_child_w), *where],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        if cpus is not None:
            # here too, so that CPUs the machine or this job's cgroup lacks fail now, in the trainer, by name
            try:
                os.sched_setaffinity(self._process.pid, cpus)
            except (OSError, ValueError, OverflowError, TypeError) as exc:
                os.close(self._to_child_w)
                os.close(self._from_child_r)
                self._process.wait()
                reason = exc.strerror if isinstance(exc, OSError) else str(exc)
                raise ValueError(f'"async_writer_cpus" {list(cpus)}: {reason}') from None
        self._jobs: dict[int, Future] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._out = os.fdopen(self._to_child_w, "wb")
        self._reader = threading.Thread(target=self._answers, name="ucp-async-writer-answers", daemon=True)
        self._reader.start()

    def submit(self, path: str, state: Any, zipfile_serialization: bool, save_id: str) -> Future:
        """Queue one file for the writer; the future gives its size, or raises why it was not written."""
        buf = io.BytesIO()
        _SharedPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump((path, state, zipfile_serialization, save_id))
        future: Future = Future()
        with self._lock:
            job, self._next = self._next, self._next + 1
            self._jobs[job] = future
            try:
                _send(self._out, _LENGTH.pack(job) + buf.getvalue())
            except OSError as exc:  # the writer is gone: its exit is reported by the answers thread
                self._jobs.pop(job)
                future.set_exception(CheckpointError(path, f"the async writer process is not running ({exc})"))
        return future

    def _answers(self) -> None:
        with os.fdopen(self._from_child_r, "rb") as pipe:
            while (message := _receive(pipe)) is not None:
                job, size, error = pickle.loads(message)
                with self._lock:
                    future = self._jobs.pop(job)
                if error is None:
                    future.set_result(size)
                else:
                    future.set_exception(CheckpointError(error[0], error[1]))
        code = self._process.wait()
        with self._lock:
            left, self._jobs = list(self._jobs.values()), {}
        for future in left:
            future.set_exception(CheckpointError("async save", f"the writer process exited (code {code})"))

    def close(self) -> None:
        """Let the writer finish what it was given, then end it."""
        with self._lock:
            if not self._out.closed:
                # an empty message, not the pipe's end: a process forked from the trainer (a data loader's worker)
                # holds the pipe open too
                try:
                    _send(self._out, b"")
                except OSError:
                    pass  # gone already
                self._out.close()
        self._process.wait()
        self._reader.join()


def _serve(inbox: IO[bytes], outbox: IO[bytes]) -> None:
    # this process is ours alone, so torch's CRC switch stays off for its life: no other code saves here
    with compat.crcs_left_to_us() as crcs_later:
        _serve_jobs(inbox, outbox, crcs_later)


def _serve_jobs(inbox: IO[bytes], outbox: IO[bytes], crcs_later: bool) -> None:
    while message := _receive(inbox):  # None: the trainer is gone; empty: it asked the writer to end
        (job,) = _LENGTH.unpack(message[: _LENGTH.size])
        path, state = "?", None
        answer: tuple[int, int, tuple[str, str] | None]
        try:
            path, state, zipfile_serialization, save_id = _SharedUnpickler(io.BytesIO(message[_LENGTH.size :])).load()
            answer = (job, write_file(path, state, zipfile_serialization, save_id, crcs_later), None)
        except CheckpointError as exc:
            answer = (job, 0, (exc.path, exc.reason))
        except Exception as exc:  # a full disk, a failed rename: the save fails at its commit, naming the file
            answer = (job, 0, (path, f"{type(exc).__name__}: {exc}"))
        state = None  # its shared memory is unmapped before the next job
        _send(outbox, pickle.dumps(answer))


def bind_threads(cpus: set[int]) -> None:
    """Run every thread of this process on `cpus`: `sched_setaffinity` binds one thread, and torch starts threads
    of its own at import (the writer's trainer sets its first thread's too, as soon as it started)."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(thread), cpus)


if __name__ == "__main__":
    if len(sys.argv) > 3:
        bind_threads({int(c) for c in sys.argv[3].split(",")})
    torch.set_num_threads(1)  # the trainer's cores are the trainer's
    with os.fdopen(int(sys.argv[1]), "rb") as inbox, os.fdopen(int(sys.argv[2]), "wb") as outbox:
        _serve(inbox, outbox)
