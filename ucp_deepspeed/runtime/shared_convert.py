"""One conversion shared by the ranks of a job: a resharding load, or `ucp convert` under torchrun.

Rank 0 checks the tag's files against its metadata and owns the output folder. Every rank converts its share of
the output files (`shard_jobs`); what each read is then checked on rank 0 against the source archives' CRCs before
the manifest is written. Any exception on any rank, not only a bad file, is raised on every rank
(`collective.guarded`), so no rank waits in a collective for one that has given up. Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch.distributed as dist

from ucp_deepspeed.convert.core import finish, run_jobs
from ucp_deepspeed.convert.output import claimed, default_output, prepare_output
from ucp_deepspeed.convert.plan import plan_jobs, shard_jobs
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.runtime.collective import from_rank0, guarded, on_rank0, to_rank0
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
    src: NativeCheckpoint = guarded(
        lambda: NativeCheckpoint(ckpt_dir, tag, layout_rules, check=rank == 0, verify=verify)
    )
    # rank 0 holds the output lock (`lock`) from preparing the folder to the manifest; it is released before `src`
    with src, contextlib.ExitStack() as lock:

        def prepare() -> tuple[Any, str]:
            out = st.normalize(output or default_output(src))  # one folder for all ranks, whatever each was told
            lock.enter_context(claimed(out, [src.tag_dir]))
            return prepare_output(src, out), out

        reusable, out = from_rank0(guarded(prepare if rank == 0 else lambda: None))
        if reusable is None:
            return out
        records = guarded(
            lambda: run_jobs(
                src, out, shard_jobs(plan_jobs(src), rank, world), reusable, workers, progress and rank == 0
            )
        )
        gathered = to_rank0((records, src.pieces())) or []

        def check_and_finish() -> None:
            if reusable and verify:  # files an interrupted run made from reads it never checked
                log.info("ucp: leftover files reused; checking every byte of the source")
                src.check_everything()
            else:
                src.check_reads([pieces for _, pieces in gathered])
            finish(src, out, [r for part, _ in gathered for r in part])

        on_rank0(check_and_finish)
        return out
