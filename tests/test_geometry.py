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
from ucp_deepspeed.geometry.fragments import Fragment, fragments

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
