"""Every rank of a resuming job, simulated in one process: what each plans and reads of a checkpoint, and what it costs.

A resharding load gives each rank an element range of every state of every parameter it holds. This module
computes those ranges for any target layout the way DeepSpeed cuts them (ZeRO-1/2: each param group's flat buffer
of the rank's pipeline stage and tensor-parallel share, padded to a multiple of 2 x DP, in DP partitions; ZeRO-3:
ceil(numel / DP) of every parameter), then runs, for each rank in turn, exactly the reads a direct resharding load
makes (`DirectCheckpoint` over the shared metadata and manifest, `read_local` inside one `batch` per state, as
`runtime.restore` does) and records their cost with `io.stats`. The pieces of all ranks are checked against the
source's full tensors by the caller.

Metadata, the manifest and the index of where each optimizer file holds its states are read once, by "rank 0", and
handed to every rank, as the load broadcasts them; the cost of reading them is reported apart (`Simulation.shared`).
"""

from __future__ import annotations

import math
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ucp_deepspeed.convert.core import build_manifest
from ucp_deepspeed.convert.direct import DirectCheckpoint
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.geometry.layout import Layout, split
from ucp_deepspeed.io.stats import ReadStats, counting
from ucp_deepspeed.sources import NativeCheckpoint
from ucp_deepspeed.sources.native import tag_metas

KEYS = (FP32, "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Target:
    """The layout of the resuming job."""

    dp: int
    zero_stage: int
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        """Its number of ranks."""
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class Owned:
    """A run of one parameter's tensor-parallel share that a rank restores."""

    name: str
    tp_rank: int
    start: int
    numel: int


@dataclass
class RankCost:
    """What one simulated rank spent."""

    stats: ReadStats
    plan_s: float
    read_s: float
    peak_heap: int = 0
    """Peak Python heap while planning and reading (tracemalloc), for the ranks sampled with `heap=True`."""


@dataclass
class Simulation:
    """The pieces every rank read and what each rank spent; `shared` is rank 0's reading of metadata and manifest."""

    target: Target
    pieces: dict[tuple[str, str, int], list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    costs: list[RankCost] = field(default_factory=list)
    shared: ReadStats = field(default_factory=ReadStats)
    shared_s: float = 0.0


def local_shape(layout: Layout, full: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of one tensor-parallel rank's share of a full tensor."""
    if not layout.is_split:
        return full
    shape = list(full)
    along = sum(layout.parts) if layout.parts else -(-full[layout.dim] // tp) * tp
    shape[layout.dim] = along // tp
    return tuple(shape)


def zero12_ranges(sizes: list[tuple[str, int]], dp: int) -> list[list[tuple[str, int, int]]]:
    """Per DP rank, (parameter, start, numel) of one param group's flat buffer cut as ZeRO-1/2 cuts it."""
    total = sum(n for _, n in sizes)
    partition = -(-total // (2 * dp)) * 2
    owned: list[list[tuple[str, int, int]]] = [[] for _ in range(dp)]
    offset = 0
    for name, numel in sizes:
        for rank in range(offset // partition, min(dp, -(-(offset + numel) // partition))):
            lo, hi = max(offset, rank * partition), min(offset + numel, (rank + 1) * partition)
            if lo < hi:
                owned[rank].append((name, lo - offset, hi - lo))
        offset += numel
    return owned


def zero3_ranges(sizes: list[tuple[str, int]], dp: int) -> list[list[tuple[str, int, int]]]:
    """Per DP rank, (parameter, start, numel) of what ZeRO-3 gives it: ceil(numel / dp) of every parameter."""
    owned: list[list[tuple[str, int, int]]] = [[] for _ in range(dp)]
    for name, numel in sizes:
        piece = -(-numel // dp)
        for rank in range(min(dp, -(-numel // piece))):
            owned[rank].append((name, rank * piece, min(piece, numel - rank * piece)))
    return owned


def plan(
    params: list[tuple[str, tuple[int, ...], Layout, int, int]], target: Target
) -> Iterator[tuple[int, list[Owned]]]:
    """(global rank, its runs) for every rank of `target`; `params` are (name, full shape, layout, param group,
    pipeline stage) of every trainable parameter in module order."""
    for pp_rank in range(target.pp):
        for tp_rank in range(target.tp):
            mine = [
                (name, math.prod(local_shape(layout, shape, target.tp)), group)
                for name, shape, layout, group, stage in params
                if stage == pp_rank
            ]
            per_dp: list[list[Owned]] = [[] for _ in range(target.dp)]
            groups = sorted({g for *_, g in mine})
            cut = zero3_ranges if target.zero_stage == 3 else zero12_ranges
            for group in groups if target.zero_stage != 3 else [None]:
                sizes = [(n, k) for n, k, g in mine if group is None or g == group]
                for dp_rank, runs in enumerate(cut(sizes, target.dp)):
                    per_dp[dp_rank] += [Owned(n, tp_rank, s, k) for n, s, k in runs]
            for dp_rank, runs in enumerate(per_dp):
                yield (pp_rank * target.tp + tp_rank) * target.dp + dp_rank, runs


def simulate(
    ckpt_dir: str,
    tag: str,
    params: list[tuple[str, tuple[int, ...], Layout, int, int]],
    target: Target,
    heap_ranks: frozenset[int] = frozenset(),
    shared_index: bool = True,
) -> Simulation:
    """Plan and read, rank after rank, what each rank of `target` restores from the tag (see the module docstring).

    With `shared_index` (what the load does) "rank 0" also indexes every optimizer file and the ranks read at those
    offsets; without it each rank opens and parses the files it reads itself."""
    sim = Simulation(target)
    start = time.perf_counter()
    with counting() as sim.shared:
        metas = tag_metas(f"{ckpt_dir}/{tag}")
        first = NativeCheckpoint(ckpt_dir, tag, check=False, metas=metas)
        manifest = build_manifest(first)
        index = first.file_index() if shared_index else None
        first.close()
    sim.shared_s = time.perf_counter() - start
    layouts = {name: layout for name, _, layout, _, _ in params}
    for rank, runs in plan(params, target):
        if rank in heap_ranks:
            tracemalloc.start()
        with counting() as stats:
            t0 = time.perf_counter()
            src = NativeCheckpoint(ckpt_dir, tag, check=False, metas=metas)
            if index is not None:
                src.use_index(index)
            reader = DirectCheckpoint(src, manifest)
            t1 = time.perf_counter()
            got = []
            for key in KEYS:
                with reader.batch():
                    for run in runs:
                        shape = local_shape(layouts[run.name], manifest.params[run.name].shape, target.tp)
                        out = torch.empty(run.numel, dtype=torch.float32)
                        reader.read_local(
                            run.name, key, layouts[run.name], shape, run.tp_rank, target.tp, run.start, run.numel, out
                        )
                        got.append(((run.name, key, run.tp_rank), run.start, out))
            reader.close()
            t2 = time.perf_counter()
        peak = 0
        if rank in heap_ranks:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        sim.costs.append(RankCost(stats, t1 - t0, t2 - t1, peak))
        for where, first, value in got:
            sim.pieces.setdefault(where, []).append((first, value))
    return sim


def check_exact(sim: Simulation, expected: dict[str, dict[str, torch.Tensor]], layouts: dict[str, Layout]) -> int:
    """Every element of every state of every parameter's tensor-parallel shares covered exactly once, equal to the
    source (`torch.equal`); returns how many (parameter, state, share) were checked."""
    tp = sim.target.tp
    checked = 0
    for name, states in expected.items():
        if name not in layouts or FP32 not in states:  # frozen tensors and buffers: not read by element range
            continue
        for key in KEYS:
            full = states[key]
            for tp_rank in range(tp):
                shape = local_shape(layouts[name], tuple(full.shape), tp)
                want = split(
                    layouts[name], shape, tp_rank, tp, lambda d, s, n, full=full: full.narrow(d, s, n)
                ).reshape(-1)
                got = torch.full_like(want, float("nan"))
                covered = torch.zeros(want.numel(), dtype=torch.int32)
                for first, value in sim.pieces.get((name, key, tp_rank), []):
                    got[first : first + value.numel()] = value
                    covered[first : first + value.numel()] += 1
                assert bool((covered == 1).all()), (name, key, tp_rank, covered.tolist()[:40])
                assert torch.equal(got, want), (name, key, tp_rank)
                checked += 1
    return checked
