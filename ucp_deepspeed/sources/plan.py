"""From per-rank metadata to the tensors of the full model: which shards make up each one.

Each model-parallel rank describes only what it holds. A full tensor is assembled from one shard
per tensor-parallel rank of the pipeline stage that owns it (split or averaged layouts), or from
tensor-parallel rank 0 (replicated). The other ranks' copies of a replicated tensor are kept as
`replicas`, which readers compare with it: a checkpoint whose replicas drifted apart is refused,
never resolved by picking one. A pipeline stage's copy of a tied weight (`alias`) is read only if
the owner's copy is absent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.metadata import ExtraTensor, ParamSlot, SaveMeta
from ucp_deepspeed.geometry.layout import Axis, Layout


@dataclass(frozen=True)
class Shard:
    """One model-parallel rank's part of a full tensor."""

    mp_rank: int
    item: ParamSlot | ExtraTensor


@dataclass(frozen=True)
class FullTensor:
    """A tensor of the full model and the shards, in tensor-parallel rank order, that make it up."""

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    layout: Layout
    group: int | None
    shards: tuple[Shard, ...]
    replicas: tuple[Shard, ...] = ()
    """The other tensor-parallel ranks' copies of a replicated tensor: each must equal `shards[0]`."""

    @property
    def nbytes(self) -> int:
        """Size of one state of the full tensor."""
        itemsize: int = getattr(torch, self.dtype).itemsize
        return math.prod(self.shape) * itemsize


def full_tensors(metas: list[SaveMeta], where: str) -> list[FullTensor]:
    """Every trainable parameter, frozen parameter and buffer of the model, with its shards."""
    tp = metas[0].topology.tp
    found: dict[str, list[tuple[SaveMeta, int, ParamSlot | ExtraTensor, bool]]] = {}
    for mp_rank, meta in enumerate(metas):
        items: list[ParamSlot | ExtraTensor] = [*meta.params, *meta.extras]
        for item in items:
            alias = isinstance(item, ParamSlot) and item.alias
            found.setdefault(item.name, []).append((meta, mp_rank, item, alias))
    out = []
    for name, entries in found.items():
        owners = [e for e in entries if not e[3]] or entries
        stages = sorted({meta.pp_rank for meta, *_ in owners})
        owners = [e for e in owners if e[0].pp_rank == stages[0]]
        over_ep = owners[0][2].layout.over is Axis.EXPERT
        size, axis = (metas[0].topology.ep, "expert") if over_ep else (tp, "tensor")
        by_rank = {
            (item.ep_rank if over_ep and isinstance(item, ParamSlot) else meta.tp_rank): (mp_rank, item)
            for meta, mp_rank, item, _ in owners
        }
        first = by_rank.get(0)
        if first is None or (sorted(by_rank) != list(range(size)) and first[1].layout.kind != "replicated"):
            raise CheckpointError(
                where,
                f"'{name}' is held by {axis}-parallel ranks {sorted(by_rank)} of stage {stages[0]}, expected "
                f"0..{size - 1}",
            )
        item = first[1]
        for rank, (_, other) in by_rank.items():
            # an uneven split (AutoTP's) gives each rank its own length along the split dim
            expected = list(item.shape)
            if item.layout.shards:
                expected[item.layout.dim] = item.layout.local_length(rank)
            if (other.layout, list(other.shape)) != (item.layout, expected):
                raise CheckpointError(
                    where,
                    f"'{name}': {axis}-parallel ranks disagree on its layout or shape "
                    f"({item.layout}, {item.shape} vs rank {rank}'s {other.layout}, {other.shape})",
                )
        replicated = item.layout.kind == "replicated"
        shards = (Shard(first[0], item),) if replicated else tuple(Shard(*by_rank[r]) for r in range(size))
        replicas = tuple(Shard(*by_rank[r]) for r in sorted(by_rank) if r) if replicated else ()
        try:
            shape = item.layout.full_shape(item.shape, size)
        except ValueError as exc:
            raise CheckpointError(where, f"'{name}': {exc}") from None
        if isinstance(item, ParamSlot):
            out.append(FullTensor(name, "param", shape, "float32", item.layout, item.group, shards, replicas))
        else:
            out.append(FullTensor(name, item.kind, shape, item.dtype, item.layout, None, shards, replicas))
    return out


def refuse_drift(
    where: str, tensor: FullTensor, state: str, replica: Shard, want: torch.Tensor, got: torch.Tensor
) -> None:
    """Refuse a replicated tensor whose copy on another tensor-parallel rank (`got`) differs from rank 0's (`want`):
    no copy is the right one to resume from."""
    if torch.equal(want.reshape(-1), got.reshape(-1)):
        return
    diff = (want.double() - got.double()).abs().max().item() if want.shape == got.shape else math.nan
    raise CheckpointError(
        where,
        f"'{tensor.name}' ({state}) is replicated over tensor parallelism, but model-parallel rank {replica.mp_rank}'s "
        f"copy differs from rank 0's (max |diff| {diff:.3g}): the ranks drifted apart during training",
    )
