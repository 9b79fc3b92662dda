"""Conversion: a native DeepSpeed checkpoint to the universal format, streamed parameter by parameter.

The work is a list of jobs, one per output file. Jobs can be split across the ranks of a loading
job (`shard_jobs`) and run on a thread pool within each; only one parameter's states per worker
are in memory at a time. The manifest is written once every job has finished.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib.metadata import version as package_version
from typing import Any

import torch
from tqdm import tqdm

from ucp_deepspeed.checkn_run.chain import is_element, materialize
from ucp_deepspeed.convert.plan import FullTensor
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.format.paths import INTENT, check_output
from ucp_deepspeed.format.universal import (
    BUFFERS,
    MANIFEST,
    STATE,
    CheckedFile,
    FileRecord,
    atomic_write,
    encode_value,
    is_complete,
    param_file,
    read_manifest,
    stream_tensors,
    write_manifest,
    write_object,
    write_tensors,
)
from ucp_deepspeed.geometry.layout import dropped_padding, merge
from ucp_deepspeed.sources import NativeCheckpoint, resolve_tag
from ucp_deepspeed.version import __version__

JOURNAL = ".ucp_journal."
log = logging.getLogger("ucp_deepspeed")


@dataclass(frozen=True)
class Job:
    """One output file to produce; `item` is the parameter or frozen tensor it holds, if any."""

    kind: str
    relpath: str
    nbytes: int
    item: FullTensor | None = None


def default_output(src: NativeCheckpoint) -> str:
    """Where a conversion goes when no output is given: beside the tag folder, never inside it."""
    return os.path.join(src.ckpt_dir, f"{src.tag}.universal")


def fingerprint(src: NativeCheckpoint) -> list[list[Any]]:
    """Identity of the source files (name, size, mtime) and its save id, so a stale conversion is never reused."""
    out: list[list[Any]] = []
    for path in sorted(src.source_files()):
        st = os.stat(path)
        out.append([os.path.basename(path), st.st_size, st.st_mtime_ns])
    if src.meta.save_id:
        out.append(["save_id", src.meta.save_id])
    return out


def plan_jobs(src: NativeCheckpoint) -> list[Job]:
    """Every output file of a conversion, with its approximate size for load balancing."""
    n_states = 1 + len(src.state_keys())
    jobs = [Job(t.kind, param_file(t.name), t.nbytes * (n_states if t.kind == "param" else 1), t)
            for t in src.tensors if t.kind != "buffer"]
    jobs.append(Job("buffers", BUFFERS, 0))
    jobs.append(Job("state", STATE, 0))
    return jobs


def shard_jobs(jobs: list[Job], rank: int, world: int) -> list[Job]:
    """This rank's share of the jobs: largest first to the least-loaded rank, identical on every rank."""
    loads = [0] * world
    mine = []
    for job in sorted(jobs, key=lambda j: (-j.nbytes, j.relpath)):
        target = loads.index(min(loads))
        loads[target] += max(job.nbytes, 1)
        if target == rank:
            mine.append(job)
    return mine


@contextlib.contextmanager
def claimed(out: str, sources: list[str]) -> Iterator[None]:
    """Check that `out` may be written (never inside a source, see `check_output`), then hold a lock on the
    folder itself while converting into it: a second converter waits, then finds the work done."""
    check_output(out, sources)
    os.makedirs(out, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("ucp: %s is being written by another conversion; waiting for it to finish", out)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Journal:
    """Records of finished output files, appended as each one is renamed into place.

    A rerun after a kill reuses a leftover file only if it still matches the CRCs recorded when it
    was written; anything else is deleted and written again. One journal file per process, so the
    ranks of a loading job never share one.
    """

    def __init__(self, out: str):
        self.path = os.path.join(out, f"{JOURNAL}{socket.gethostname()}.{os.getpid()}")
        self._lock = threading.Lock()

    def add(self, record: FileRecord) -> None:
        """Note a finished file (not fsynced: a lost line only costs rewriting that file)."""
        line = json.dumps({"path": record.path, **record.to_json()}) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)

    @staticmethod
    def read(out: str) -> dict[str, FileRecord]:
        """Every record in the journals of `out`; a torn last line is ignored."""
        found: dict[str, FileRecord] = {}
        for name in os.listdir(out):
            if not name.startswith(JOURNAL):
                continue
            with open(os.path.join(out, name)) as f:
                for line in f:
                    try:
                        raw = json.loads(line)
                        found[raw["path"]] = FileRecord.from_json(raw["path"], raw, out)
                    except (ValueError, KeyError, TypeError, CheckpointError):
                        continue
        return found

    @staticmethod
    def remove(out: str) -> None:
        """Delete the journals once the manifest holds the records."""
        for name in os.listdir(out):
            if name.startswith(JOURNAL):
                os.unlink(os.path.join(out, name))


def _still_good(out: str, record: FileRecord) -> bool:
    try:
        handle = CheckedFile(out, record)
    except CheckpointError:
        return False
    try:
        handle.verify()
        return True
    except CheckpointError:
        return False
    finally:
        handle.close()


def prepare_output(src: NativeCheckpoint, out: str) -> dict[str, FileRecord] | None:
    """Get `out` ready; return finished files that can be reused (checked), or None if the conversion is complete."""
    want = fingerprint(src)
    intent_path = os.path.join(out, INTENT)
    if is_complete(out):
        if read_manifest(out).get("source", {}).get("fingerprint") == want:
            return None
        raise CheckpointError(out, "holds a finished conversion of a different checkpoint; remove it or pick another output")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(intent_path):
        raise CheckpointError(out, "exists, is not empty and is not a ucp_deepspeed output; refusing to write into it")
    reusable: dict[str, FileRecord] = {}
    if os.path.isfile(intent_path):
        with open(intent_path) as f:
            try:
                same_source = json.load(f) == {"source": src.tag_dir, "fingerprint": want}
            except json.JSONDecodeError:
                same_source = False
        journal = Journal.read(out) if same_source else {}
        for dirpath, _, files in os.walk(out):
            for fname in files:
                path = os.path.join(dirpath, fname)
                rel = os.path.relpath(path, out)
                if rel == INTENT or (fname.startswith(JOURNAL) and same_source):
                    continue
                record = journal.get(rel)
                if record is not None and ".tmp." not in fname and _still_good(out, record):
                    reusable[rel] = record
                else:
                    os.unlink(path)
        if reusable:
            log.info("ucp: %s: reusing %d files an interrupted conversion finished (their CRCs still match)", out,
                     len(reusable))
    os.makedirs(os.path.join(out, "params"), exist_ok=True)
    atomic_write(intent_path, json.dumps({"source": src.tag_dir, "fingerprint": want}).encode())
    return reusable


def assemble(src: NativeCheckpoint, tensor: FullTensor, state: str = VALUE) -> torch.Tensor:
    """One state of a full tensor, merged from its tensor-parallel shards."""
    shards = [src.ranks[s.mp_rank].read_param(s.item, state) if tensor.kind == "param"
              else src.ranks[s.mp_rank].read_extra(s.item) for s in tensor.shards]
    if not tensor.layout.is_split and len(shards) == 1:
        return shards[0]
    lost = dropped_padding(tensor.layout, shards)
    if lost and state in (FP32, VALUE):
        log.warning("ucp: %s: vocab padding beyond row %d holds values up to %.3g; they are dropped, and a model "
                    "that does not mask padded logits will compute slightly different losses", tensor.name,
                    tensor.layout.vocab, lost)
    return merge(tensor.layout, shards, tensor.name)


def _run_job(src: NativeCheckpoint, out: str, job: Job) -> FileRecord:
    meta = src.meta
    if job.kind == "param":
        entries = [(key, torch.float32, job.item.shape) for key in [FP32, *src.state_keys()]]
        return stream_tensors(out, job.relpath, entries, lambda key: assemble(src, job.item, key))
    if job.kind == "frozen":
        return write_tensors(out, job.relpath, {VALUE: assemble(src, job.item)})
    if job.kind == "buffers":
        return write_tensors(out, job.relpath, {t.name: assemble(src, t) for t in src.tensors if t.kind == "buffer"})
    model = src.model_states(0)
    return write_object(out, job.relpath, {
        "lr_scheduler": model.lr_scheduler(),
        "client_state": model.client_state(meta.client_state_keys),
        "optimizer_wrapper": src.optim(0).wrapper_state() if meta.topology.zero_stage > 0 else {},
    })


def run_jobs(src: NativeCheckpoint, out: str, jobs: list[Job], reusable: dict[str, FileRecord], workers: int = 1,
             progress: bool = True) -> list[FileRecord]:
    """Produce the files of `jobs` (reusing checked leftovers) with `workers` threads, showing progress."""
    records = [reusable[j.relpath] for j in jobs if j.relpath in reusable]
    todo = [j for j in jobs if j.relpath not in reusable]
    journal = Journal(out)
    bar = tqdm(total=sum(j.nbytes for j in todo), unit="B", unit_scale=True, desc="ucp convert",
               disable=not progress or not todo)

    def run(job: Job) -> FileRecord:
        record = _run_job(src, out, job)
        journal.add(record)
        return record

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for job, record in zip(todo, pool.map(run, todo)):
            bar.update(job.nbytes)
            records.append(record)
    bar.close()
    return records


def build_manifest(src: NativeCheckpoint) -> dict[str, Any]:
    """The manifest body for a conversion of `src` (file table added when written)."""
    meta = src.meta
    hyperparams, scalars = src.optimizer_groups()
    keys = [FP32] + src.state_keys()
    params: dict[str, Any] = {}
    buffers: dict[str, Any] = {}
    for t in src.tensors:
        if t.kind == "buffer":
            buffers[t.name] = {"shape": list(t.shape), "dtype": t.dtype}
        else:
            params[t.name] = {"shape": list(t.shape), "dtype": t.dtype, "group": t.group, "trainable": t.kind == "param",
                              "file": param_file(t.name), "keys": keys if t.kind == "param" else [VALUE]}
    groups = []
    for g in range(meta.num_groups):
        hp = hyperparams[g] if hyperparams is not None else None
        groups.append({"hyperparams": {k: encode_value(v) for k, v in hp.items()} if hp is not None else None,
                       "scalars": {k: encode_value(v) for k, v in scalars.get(g, {}).items()}})
    return {
        "created_by": {"ucp_deepspeed": __version__, "deepspeed": package_version("deepspeed"),
                       "torch": torch.__version__},
        "source": {"path": src.tag_dir, "tag": src.tag, "topology": asdict(meta.topology),
                   "versions": meta.versions, "fingerprint": fingerprint(src)},
        "counters": src.model_states(0).counters(),
        "param_groups": groups,
        "params": params,
        "buffers": buffers,
        "tied": {k: v for m in src.metas for k, v in m.tied.items()},
        "frozen_excluded": any(m.frozen_excluded for m in src.metas),
    }


def finish(src: NativeCheckpoint, out: str, records: Iterable[FileRecord]) -> str:
    """Write the manifest, which marks the conversion complete, and drop the intent file and journals."""
    records = list(records)
    expected = {j.relpath for j in plan_jobs(src)}
    missing = expected - {r.path for r in records}
    if missing:
        raise CheckpointError(out, f"conversion incomplete, {len(missing)} files not produced: {sorted(missing)[:5]}")
    path = write_manifest(out, build_manifest(src), records)
    os.unlink(os.path.join(out, INTENT))
    Journal.remove(out)
    return path


def convert(ckpt_dir: str, tag: str | None = None, output: str | None = None, workers: int = 1,
            progress: bool = True, layout_rules: Any = None, verify: bool = True) -> str:
    """Convert a checkpoint in this process; resumes an interrupted run; returns the output folder.

    Every byte read from the source is checked against its archive's CRC-32 before the manifest is
    written. A Check-N-Run tag is materialized instead: its chain replayed into full tables.
    `layout_rules` (a JSON file path or a list) describe a tensor-parallel checkpoint saved without
    our metadata. `verify=False` skips the CRC checks of the source reads, to measure their cost.
    """
    tag = resolve_tag(ckpt_dir, tag)
    if is_element(os.path.join(ckpt_dir, tag)):
        out = os.path.abspath(output or os.path.join(ckpt_dir, f"{tag}.universal"))
        with claimed(out, [os.path.join(ckpt_dir, tag)]):
            return materialize(ckpt_dir, tag, out)
    src = NativeCheckpoint(ckpt_dir, tag, layout_rules, verify=verify)
    try:
        out = os.path.abspath(output or default_output(src))
        with claimed(out, [src.tag_dir]):
            reusable = prepare_output(src, out)
            if reusable is None:
                log.info("ucp: %s already holds this conversion (same source files); nothing to do", out)
            else:
                records = run_jobs(src, out, plan_jobs(src), reusable, workers, progress)
                src.check_reads()
                finish(src, out, records)
        return out
    finally:
        src.close()


def remove_output(out: str) -> None:
    """Delete a conversion folder (used when the user does not keep converted copies)."""
    if os.path.isfile(os.path.join(out, MANIFEST)) or os.path.isfile(os.path.join(out, INTENT)):
        shutil.rmtree(out)
