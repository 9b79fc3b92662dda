"""What a conversion writes: one job per output file, and each rank's share of them."""

from __future__ import annotations

from dataclasses import dataclass

from ucp_deepspeed.format.universal import BUFFERS, STATE, param_file
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.sources.plan import FullTensor


@dataclass(frozen=True)
class Job:
    """One output file to produce; `item` is the parameter or frozen tensor it holds, if any."""

    kind: str
    relpath: str
    nbytes: int
    item: FullTensor | None = None


def plan_jobs(src: NativeCheckpoint) -> list[Job]:
    """Every output file of a conversion, with its approximate size for load balancing."""
    n_states = 1 + len(src.state_keys())
    jobs = [
        Job(t.kind, param_file(t.name), t.nbytes * (n_states if t.kind == "param" else 1), t)
        for t in src.tensors
        if t.kind != "buffer"
    ]
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
