"""One conversion shared by the ranks of a job: a resharding load, or `ucp convert` under torchrun.

Rank 0 checks the tag's files against its metadata and owns the output folder. Every rank converts its share of
the output files (`shard_jobs`); what each read is then checked on rank 0 against the source archives' CRCs before
the manifest is written. A failure on any rank is raised on every rank (`collective.all_ok`). Nothing here
imports DeepSpeed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch.distributed as dist

from ucp_deepspeed.convert.core import finish, run_jobs
from ucp_deepspeed.convert.output import claimed, default_output, prepare_output
from ucp_deepspeed.convert.plan import plan_jobs, shard_jobs
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.runtime.collective import all_ok, failure_of
from ucp_deepspeed.sources import NativeCheckpoint

log = logging.getLogger("ucp_deepspeed")


def convert_across_ranks(
    ckpt_dir: str,
    tag: str,
    output: str | None = None,
    layout_rules: Any = None,
    verify: bool = True,
    workers: int = 1,
    progress: bool = False,
) -> str:
    """Convert (or reuse a finished conversion of) a tag with every rank of the process group; the output folder.

    Collective: every rank calls it with the same arguments.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    src, failure = None, None
    try:
        src = NativeCheckpoint(ckpt_dir, tag, layout_rules, check=rank == 0, verify=verify)
    except (CheckpointError, OSError) as exc:
        failure = failure_of(exc)
    all_ok(failure)
    assert src is not None  # all_ok raised otherwise
    lock = contextlib.ExitStack()  # rank 0 holds the output lock from preparing the folder to the manifest
    try:
        box: list[Any] = [None]
        if rank == 0:  # one folder for all ranks, whatever each was told
            out = os.path.abspath(output or default_output(src))
            try:
                lock.enter_context(claimed(out, [src.tag_dir]))
                box = [(None, prepare_output(src, out), out)]
            except (CheckpointError, OSError) as exc:
                box = [(failure_of(exc), None, out)]
        dist.broadcast_object_list(box, src=0)
        failure, reusable, out = box[0]
        all_ok(failure)
        if reusable is None:
            return out
        records, failure = [], None
        try:
            jobs = shard_jobs(plan_jobs(src), rank, world)
            records = run_jobs(src, out, jobs, reusable, workers, progress and rank == 0)
        except (CheckpointError, OSError) as exc:
            failure = failure_of(exc)
        all_ok(failure)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (records, src.pieces()))
        if rank == 0:
            try:
                if reusable and verify:  # files an interrupted run made from reads it never checked
                    log.info("ucp: leftover files reused; checking every byte of the source")
                    src.check_everything()
                else:
                    src.check_reads([pieces for _, pieces in gathered])
                finish(src, out, [r for part, _ in gathered for r in part])
            except (CheckpointError, OSError) as exc:
                failure = failure_of(exc)
        all_ok(failure)
        return out
    finally:
        lock.close()
        src.close()
