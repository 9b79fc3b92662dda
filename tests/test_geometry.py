"""ZeRO partition geometry without any launch: rank files are synthesized in the test, the way ZeRO-1/2 and
ZeRO-3 lay out their flat buffers, and every parameter must come back whole from its fragments.

The end-to-end matrices check the same code against DeepSpeed's real files; these check it over many more
shapes, data-parallel sizes and partition orders than a launch could afford.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_deepspeed.format.metadata import ParamSlot
from ucp_deepspeed.geometry.fragments import Fragment, fragments, fragments_in, rank_fragment

sizes = st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=8)


def _assemble(slot: ParamSlot, zero: int, dp: int, files: dict[int, torch.Tensor]) -> torch.Tensor:
    """What conversion does for one parameter: concatenate its fragments read from the ranks' flat buffers."""
    out = torch.full((slot.numel,), float("nan"))
    for f in fragments(slot, zero, dp):
        out[f.dst : f.dst + f.numel] = files[f.rank][f.src : f.src + f.numel]
    return out


@settings(max_examples=200, deadline=None)
@given(
    sizes=sizes,
    dp=st.integers(min_value=1, max_value=5),
    pad=st.integers(min_value=0, max_value=7),
    seed=st.integers(0, 10**6),
)
def test_zero12_partitions_give_back_every_parameter(sizes, dp, pad, seed):
    """ZeRO-1/2: parameters packed into one flat buffer, padded, cut into `dp` equal partitions, and partition k
    written to the file of rank `ranks[k]` (an expert's partitions live in its expert-data-parallel ranks)."""
    params = [torch.randn(n, generator=torch.Generator().manual_seed(seed + i)) for i, n in enumerate(sizes)]
    total = sum(sizes) + pad
    partition = math.ceil(total / dp)
    flat = torch.cat([*params, torch.zeros(partition * dp - sum(sizes))])
    ranks = tuple(torch.randperm(dp, generator=torch.Generator().manual_seed(seed)).tolist())
    files = {ranks[k]: flat[k * partition : (k + 1) * partition].clone() for k in range(dp)}
    offset = 0
    for i, p in enumerate(params):
        slot = ParamSlot(f"p{i}", (p.numel(),), 0, 0, offset, partition, ranks=ranks)
        assert torch.equal(_assemble(slot, 1, dp, files), p), (i, sizes, dp, ranks)
        offset += p.numel()


@settings(max_examples=200, deadline=None)
@given(sizes=sizes, dp=st.integers(min_value=1, max_value=5), seed=st.integers(0, 10**6))
def test_zero3_partitions_give_back_every_parameter(sizes, dp, seed):
    """ZeRO-3: each parameter padded to a multiple of `dp` and cut in `dp` equal parts; rank r's flat buffer holds
    part r of every parameter in turn."""
    params = [torch.randn(n, generator=torch.Generator().manual_seed(seed + i)) for i, n in enumerate(sizes)]
    parts = [math.ceil(p.numel() / dp) for p in params]
    padded = [torch.cat([p, torch.zeros(k * dp - p.numel())]) for p, k in zip(params, parts)]
    files = {r: torch.cat([q[r * k : (r + 1) * k] for q, k in zip(padded, parts)]) for r in range(dp)}
    offset = 0
    for i, (p, k) in enumerate(zip(params, parts)):
        slot = ParamSlot(f"p{i}", (p.numel(),), 0, 0, offset, k)
        assert torch.equal(_assemble(slot, 3, dp, files), p), (i, sizes, dp)
        offset += k


def test_a_parameter_cut_at_partition_borders():
    """Elements 5..16 of a flat buffer cut every 6: three fragments, in parameter order, from three ranks."""
    slot = ParamSlot("w", (3, 4), 0, 0, 5, 6)
    assert fragments(slot, 1, 3) == [Fragment(0, 5, 0, 1), Fragment(1, 0, 1, 6), Fragment(2, 0, 7, 5)]


@pytest.mark.parametrize("zero,partition", [(1, 4), (3, 3)])
def test_fragments_that_do_not_cover_the_parameter_are_refused(zero, partition):
    """Metadata whose partitions cannot hold the parameter (too few ranks) is an error, never a short tensor."""
    slot = ParamSlot("w", (4, 4), 0, 0, 0, partition)
    with pytest.raises(ValueError, match="w: fragments cover"):
        fragments(slot, zero, 2)


@settings(max_examples=300, deadline=None)
@given(
    numel=st.integers(min_value=1, max_value=300),
    offset=st.integers(min_value=0, max_value=400),
    dp=st.integers(min_value=1, max_value=1024),
    zero=st.sampled_from([1, 3]),
    data=st.data(),
)
def test_a_range_visits_only_the_fragments_it_overlaps(numel, offset, dp, zero, data):
    """`fragments_in` (what a resuming rank plans with) cuts exactly the whole parameter's fragments to a range, and
    `rank_fragment` (what checking one file uses) is a rank's own fragment, at any DP up to 1024."""
    if zero == 3:
        slot = ParamSlot("w", (numel,), 0, 0, offset % 50, -(-numel // dp))
    else:
        partition = -(-(offset + numel) // (2 * dp)) * 2
        slot = ParamSlot("w", (numel,), 0, 0, offset, partition)
    whole = fragments(slot, zero, dp)
    start = data.draw(st.integers(0, numel - 1))
    end = data.draw(st.integers(start + 1, numel))
    cut = [
        Fragment(f.rank, f.src + lo - f.dst, lo, hi - lo)
        for f in whole
        for lo, hi in [(max(start, f.dst), min(end, f.dst + f.numel))]
        if lo < hi
    ]
    assert fragments_in(slot, zero, dp, start, end) == cut
    for rank in {0, dp - 1, data.draw(st.integers(0, dp - 1))}:
        mine = [f for f in whole if f.rank == rank]
        assert [f for f in [rank_fragment(slot, zero, dp, rank)] if f is not None] == mine


def test_zero3_partitions_over_an_expert_data_parallel_group():
    """AutoEP at ZeRO-3 partitions an expert stack over its expert-data-parallel group: partition k is in the file of
    `ranks[k]`, and the other ranks' files hold none of it."""
    slot = ParamSlot("w1", shape=(10,), group=1, flat=1, offset=3, partition=5, ranks=(1, 3))
    assert fragments(slot, 3, 4) == [Fragment(1, 3, 0, 5), Fragment(3, 3, 5, 5)]
    assert rank_fragment(slot, 3, 4, 3) == Fragment(3, 3, 5, 5)
    assert rank_fragment(slot, 3, 4, 0) is None and rank_fragment(slot, 3, 4, 2) is None
