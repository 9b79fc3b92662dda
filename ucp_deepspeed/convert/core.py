"""Conversion: a native DeepSpeed checkpoint to the universal format, streamed parameter by parameter.

The work is a list of jobs, one per output file. Jobs can be split across processes (`shard_jobs`):
the ranks of a loading job, or `convert(procs=N)`'s child processes; each runs its share on a thread
pool. Only one parameter's states per worker are in memory at a time. The manifest is written once
every job has finished, after every byte any process read was checked against its archive's CRC.
"""

from __future__ import annotations

import contextvars
import logging
import multiprocessing
from collections.abc import Iterable
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import torch
from tqdm import tqdm

from ucp_deepspeed.convert.output import Journal, claimed, default_output, fingerprint, prepare_output
from ucp_deepspeed.convert.plan import Job, plan_jobs, shard_jobs
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.kinds import kind_of
from ucp_deepspeed.format.manifest import (
    BufferRecord,
    FileRecord,
    GroupRecord,
    Manifest,
    ParamRecord,
    SourceRecord,
    recorded_sections,
    written_by,
)
from ucp_deepspeed.format.metadata import FP32, VALUE, ParamSlot
from ucp_deepspeed.format.paths import INTENT
from ucp_deepspeed.format.universal import encode_value, param_file
from ucp_deepspeed.format.writer import TrainingState, UniversalFiles, UniversalWriter
from ucp_deepspeed.geometry.layout import dropped_padding, merge
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.sources import NativeCheckpoint, resolve_tag
from ucp_deepspeed.sources.plan import FullTensor, Shard, refuse_drift

log = logging.getLogger("ucp_deepspeed")


def _read_shard(src: NativeCheckpoint, shard: Shard, state: str) -> torch.Tensor:
    files = src.ranks[shard.mp_rank]
    return files.read_param(shard.item, state) if isinstance(shard.item, ParamSlot) else files.read_extra(shard.item)


def assemble(src: NativeCheckpoint, tensor: FullTensor, state: str = VALUE) -> torch.Tensor:
    """One state of a full tensor, merged from its tensor-parallel shards; a replicated one is compared with its
    other ranks' copies."""
    shards = [_read_shard(src, s, state) for s in tensor.shards]
    for replica in tensor.replicas:
        refuse_drift(src.tag_dir, tensor, state, replica, shards[0], _read_shard(src, replica, state))
    if not tensor.layout.is_split and len(shards) == 1:
        return shards[0]
    lost = dropped_padding(tensor.layout, shards)
    if lost and state in (FP32, VALUE):
        log.warning(
            "ucp: %s: vocab padding beyond row %d holds values up to %.3g; they are dropped, and a model "
            "that does not mask padded logits will compute slightly different losses",
            tensor.name,
            tensor.layout.vocab,
            lost,
        )
    return merge(tensor.layout, shards, tensor.name)


def _run_job(src: NativeCheckpoint, files: UniversalFiles, job: Job) -> FileRecord:
    item = job.item
    if job.kind in ("param", "frozen"):
        if item is None:
            raise ValueError(f"{job.kind} job {job.relpath} names no tensor")
        if job.kind == "frozen":
            return files.frozen(item.name, assemble(src, item))
        keys = [FP32, *src.state_keys()]
        return files.stream_param(item.name, shape=item.shape, keys=keys, produce=lambda key: assemble(src, item, key))
    if job.kind == "buffers":
        return files.buffers({t.name: assemble(src, t) for t in src.tensors if t.kind == "buffer"})
    state = src.training_state()
    return files.state(
        TrainingState(
            lr_scheduler=state["lr_scheduler"],
            client_state=state["client_state"],
            client_states=list(state["client_states"]),
            optimizer_wrapper=state["optimizer_wrapper"],
            data_sampler=state.get("data_sampler"),
            data_sampler_rng=state.get("data_sampler_rng"),
            data_loaders=state.get("data_loaders"),
        )
    )


def run_jobs(
    src: NativeCheckpoint,
    out: str,
    jobs: list[Job],
    reusable: dict[str, FileRecord],
    workers: int = 1,
    progress: bool = True,
) -> list[FileRecord]:
    """Produce the files of `jobs` (reusing checked leftovers) with `workers` threads, showing progress."""
    records = [reusable[j.relpath] for j in jobs if j.relpath in reusable]
    todo = [j for j in jobs if j.relpath not in reusable]
    journal = Journal(out)
    bar = tqdm(
        total=sum(j.nbytes for j in todo),
        unit="B",
        unit_scale=True,
        desc="ucp convert",
        disable=not progress or not todo,
    )

    files = UniversalFiles(out)

    def run(job: Job) -> FileRecord:
        record = _run_job(src, files, job)
        journal.add(record)
        return record

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        # each job runs in a copy of this thread's context, so what it reads counts where this thread counts (io.stats)
        futures = [pool.submit(contextvars.copy_context().run, run, job) for job in todo]
        for job, future in zip(todo, futures):
            records.append(future.result())
            bar.update(job.nbytes)
    bar.close()
    return records


def _share(
    ckpt_dir: str,
    tag: str,
    layout_rules: Any,
    verify: bool,
    out: str,
    reusable: dict[str, FileRecord],
    workers: int,
    index: int,
    procs: int,
) -> tuple[list[FileRecord], dict[str, dict[str, list[tuple[int, int, int]]]]]:
    """One child process's share of a conversion: the files it wrote, and what it read (for the CRC check)."""
    with NativeCheckpoint(ckpt_dir, tag, layout_rules, check=False, verify=verify) as src:
        jobs = shard_jobs(plan_jobs(src), index, procs)
        return run_jobs(src, out, jobs, reusable, workers, progress=False), src.pieces()


def _run_in_processes(
    src: NativeCheckpoint,
    out: str,
    reusable: dict[str, FileRecord],
    workers: int,
    procs: int,
    layout_rules: Any,
    verify: bool,
) -> list[FileRecord]:
    """Run the jobs in `procs` fresh processes (spawned: no inherited threads or file handles); check every byte
    they read here."""
    context = multiprocessing.get_context("spawn")
    args = (src.ckpt_dir, src.tag, layout_rules, verify, out, reusable, workers)
    try:
        with ProcessPoolExecutor(max_workers=procs, mp_context=context) as pool:
            parts = list(pool.map(_share, *zip(*[(*args, i, procs) for i in range(procs)])))
    except BrokenExecutor:
        raise CheckpointError(out, "a conversion process died (out of memory?); running again resumes") from None
    log.info("ucp: %d processes wrote %s files", procs, ", ".join(str(len(records)) for records, _ in parts))
    _check_source(src, reusable, verify, [pieces for _, pieces in parts])
    return [record for records, _ in parts for record in records]


def _check_source(src: NativeCheckpoint, reusable: dict[str, FileRecord], verify: bool, pieces: list[Any]) -> None:
    """Check what was read (here and by `pieces` elsewhere); all of the source if leftovers of an interrupted
    run, made from reads it never checked, were reused."""
    if reusable and verify:
        log.info("ucp: leftover files reused; checking every byte of the source")
        src.check_everything()
    else:
        src.check_reads(pieces)


def build_manifest(src: NativeCheckpoint) -> Manifest:
    """The manifest body for a conversion of `src` (file table added when written)."""
    meta = src.meta
    hyperparams, scalars = src.optimizer_groups()
    keys = [FP32] + src.state_keys()
    params: dict[str, ParamRecord] = {}
    buffers: dict[str, BufferRecord] = {}
    for t in src.tensors:
        if t.kind == "buffer":
            buffers[t.name] = BufferRecord(tuple(t.shape), t.dtype)
        else:
            params[t.name] = ParamRecord(
                shape=tuple(t.shape),
                dtype=t.dtype,
                group=t.group,
                trainable=t.kind == "param",
                file=param_file(t.name),
                keys=tuple(keys) if t.kind == "param" else (VALUE,),
            )
    groups = []
    for g in range(meta.num_groups):
        hp = hyperparams[g] if hyperparams is not None else None
        groups.append(
            GroupRecord(
                {k: encode_value(v) for k, v in hp.items()} if hp is not None else None,
                {k: encode_value(v) for k, v in scalars.get(g, {}).items()},
            )
        )
    return Manifest(
        created_by=written_by(),
        source=SourceRecord(src.tag_dir, src.tag, meta.topology, meta.versions, fingerprint(src)),
        counters=src.model_states(0).counters(),
        param_groups=tuple(groups),
        params=params,
        buffers=buffers,
        tied={k: v for m in src.metas for k, v in m.tied.items()},
        frozen_excluded=any(m.frozen_excluded for m in src.metas),
        extra=recorded_sections(
            next((m.model for m in src.metas if m.model is not None), None),
            next((m.hf_config for m in src.metas if m.hf_config is not None), None),
            next((m.optimizer for m in src.metas if m.optimizer is not None), None),
        ),
    )


def finish(src: NativeCheckpoint, out: str, records: Iterable[FileRecord]) -> str:
    """Write the manifest, which marks the conversion complete, and drop the intent file and journals."""
    records = list(records)
    expected = {j.relpath for j in plan_jobs(src)}
    missing = expected - {r.path for r in records}
    if missing:
        raise CheckpointError(out, f"conversion incomplete, {len(missing)} files not produced: {sorted(missing)[:5]}")
    with UniversalWriter(root=out) as writer:
        writer.add_files(records)
        path = writer.commit(build_manifest(src))
    st.delete(st.join(out, INTENT))
    Journal.remove(out)
    return path


def convert(
    ckpt_dir: str,
    tag: str | None = None,
    output: str | None = None,
    workers: int = 1,
    progress: bool = True,
    layout_rules: Any = None,
    verify: bool = True,
    procs: int = 1,
) -> str:
    """Convert a checkpoint; resumes an interrupted run; returns the output folder.

    Every byte read from the source is checked against its archive's CRC-32 before the manifest is
    written; a resumed conversion checks every byte of the source, since the files it reuses were made
    from reads an interrupted run never checked. A tag of a registered kind is materialized instead (a
    Check-N-Run chain replayed into full tables). `layout_rules` (a JSON file path or a list) describe a
    tensor-parallel checkpoint saved without our metadata. `verify=False` skips the CRC checks of the
    source reads, to measure their cost.
    `procs` > 1 splits the output files over that many child processes, each with `workers` threads.
    """
    tag = resolve_tag(ckpt_dir, tag)
    kind = kind_of(st.join(ckpt_dir, tag))
    if kind is not None:
        out = st.normalize(output or st.join(ckpt_dir, f"{tag}.universal"))
        with claimed(out, [st.join(ckpt_dir, tag)]):
            return kind.materialize(ckpt_dir, tag, out)
    with NativeCheckpoint(ckpt_dir, tag, layout_rules, verify=verify) as src:
        out = st.normalize(output or default_output(src))
        with claimed(out, [src.tag_dir]):
            reusable = prepare_output(src, out)
            if reusable is None:
                log.info("ucp: %s already holds this conversion (same source files); nothing to do", out)
            else:
                if procs > 1:
                    records = _run_in_processes(src, out, reusable, workers, procs, layout_rules, verify)
                else:
                    records = run_jobs(src, out, plan_jobs(src), reusable, workers, progress)
                    _check_source(src, reusable, verify, [])
                finish(src, out, records)
        return out
