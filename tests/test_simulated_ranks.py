"""Every rank of a large resuming job, simulated in one process: what each reads of a real DP=2 checkpoint.

A resharded load at world size W gives each rank an element range of every parameter: ZeRO-1/2 cut each param
group's flat buffer (padded to a multiple of 2 x W, DeepSpeed's alignment) into W partitions, ZeRO-3 cuts each
parameter into W pieces of ceil(numel / W). For W = 8, 64 and 1024 and both cuts, each simulated rank reads its
ranges of the fp32 master and of every optimizer state straight from the saved rank files (`DirectCheckpoint`,
the direct reshard's reader), and the pieces of all ranks put together must equal, with `torch.equal`, the
tensors an offline conversion of the same checkpoint wrote. Ranks that own nothing of a group (most of them at
W = 1024) read nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
from simulate import zero3_ranges, zero12_ranges

from ucp_deepspeed import UniversalCheckpoint, convert
from ucp_deepspeed.convert.direct import DirectCheckpoint
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.sources import NativeCheckpoint

TAG = "global_step3"


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("simulated")
    return {name: convert(str(sources[name]), TAG, output=str(out / name), progress=False) for name in ("z1", "z3")}


@pytest.mark.parametrize("source", ["z1", "z3"])
@pytest.mark.parametrize("cut", ["zero12", "zero3"])
@pytest.mark.parametrize("world", [8, 64, 1024])
def test_every_simulated_rank_reads_exactly_its_share(sources, converted, source, cut, world):
    reference = UniversalCheckpoint(converted[source])
    direct = DirectCheckpoint(NativeCheckpoint(str(sources[source]), TAG))
    try:
        trainable = {n: r for n, r in direct.params.items() if r.trainable}
        keys = [k for k in next(iter(trainable.values())).keys]
        assert FP32 in keys and len(keys) == 3  # the fp32 master and AdamW's two moments
        groups: dict[int, list[tuple[str, int]]] = {}
        for name, record in trainable.items():
            groups.setdefault(record.group, []).append((name, math.prod(record.shape)))
        plan = zero12_ranges if cut == "zero12" else zero3_ranges
        pieces: dict[tuple[str, str], list[tuple[int, torch.Tensor]]] = {}
        idle = 0
        for sizes in groups.values():
            owned = plan(sizes, world)
            idle += sum(1 for ranges in owned if not ranges)
            for ranges in owned:  # one simulated rank after another
                for name, start, numel in ranges:
                    for key in keys:
                        pieces.setdefault((name, key), []).append((start, direct.read(name, key, start, numel)))
        for name in trainable:
            for key in keys:
                got = sorted(pieces[name, key], key=lambda p: p[0])
                assert [s for s, _ in got] == sorted({s for s, _ in got}), (name, key, "a range read twice")
                whole = torch.cat([t for _, t in got])
                assert torch.equal(whole, reference.read(name, key).reshape(-1)), (name, key, world, cut)
        if world == 1024:
            assert idle > 0  # tiny groups leave ranks without a piece: they must read nothing and break nothing
    finally:
        direct.close()
        reference.close()
