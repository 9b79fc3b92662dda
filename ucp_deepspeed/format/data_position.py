"""Where each rank's data loader stood at a save, in a form a resume at another data-parallel size can continue.

A save with a data loader (`engine.save_checkpoint(..., data_loader=loader)`) keeps one record per rank: the loader's
own `state_dict()`, which resumes that rank at the same size whatever the loader, and, for a map-style loader over a
`DistributedSampler`, the global order it draws from. Such a sampler shuffles the dataset with `seed + epoch`
(independently of the number of ranks) and hands rank r of N the indices r, r+N, r+2N, ... of that permutation; so
N ranks that each took `samples` indices consumed exactly its first `N * samples`, and M ranks continue it when each
skips `N * samples / M` of its own.

In a tag folder the records are one file, `data_loader.pt` (the list, by rank), written by rank 0 through DeepSpeed's
checkpoint engine, so bound to the save like every other file; the tag's metadata says how many ranks it holds
(`SaveMeta.data_loaders`), so a file left by an earlier save of the same tag is never read. A universal folder keeps
the list in `state.pt` (`TrainingState.data_loaders`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ucp_deepspeed.errors import CheckpointError

LOADER_FILE = "data_loader.pt"


@dataclass(frozen=True)
class GlobalOrder:
    """A map-style loader over a `DistributedSampler` (or torchdata's `StatefulDistributedSampler`): the permutation
    every data-parallel size shares, and how far this rank went into its share of it this epoch."""

    sampler: str
    """The sampler's class name."""
    dataset_len: int
    seed: int
    shuffle: bool
    drop_last: bool
    epoch: int
    num_replicas: int
    rank: int
    """The sampler's own rank and size: the data-parallel ones, not the world's."""
    samples: int
    """Indices this rank's sampler has handed to the loader this epoch."""
    finished: bool
    """Whether the loader had finished the epoch."""

    def same_order(self, other: GlobalOrder) -> str | None:
        """What keeps `other` from being the same permutation (another dataset, seed, epoch...), or None."""
        for key in ("sampler", "dataset_len", "seed", "shuffle", "drop_last", "epoch"):
            if getattr(self, key) != getattr(other, key):
                return f"{key} {getattr(self, key)!r} against {getattr(other, key)!r}"
        return None


@dataclass(frozen=True)
class LoaderRecord:
    """One rank's data loader at a save."""

    rank: int
    world: int
    dp_rank: int
    dp_size: int
    """The engine's data-parallel rank and size: which stream of the data this rank's loader reads."""
    loader: str
    """The loader's and its dataset's class names, for messages."""
    state: dict[str, Any]
    """The loader's `state_dict()`."""
    order: GlobalOrder | None
    """The global order it draws from, where it has one (see the module docstring)."""

    def encode(self) -> dict[str, Any]:
        """Plain data, for `torch.save` and `state.pt`."""
        return {
            "rank": self.rank,
            "world": self.world,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "loader": self.loader,
            "state": self.state,
            "order": asdict(self.order) if self.order is not None else None,
        }

    @classmethod
    def decode(cls, raw: Any, where: str) -> LoaderRecord:
        """A record read from `where`, checked field by field."""
        if not isinstance(raw, dict):
            raise CheckpointError(where, f"a data-loader record is a {type(raw).__name__}, not a dict")
        for key in ("rank", "world", "dp_rank", "dp_size"):
            if type(raw.get(key)) is not int or raw[key] < 0:
                raise CheckpointError(where, f"data-loader record: {key} {raw.get(key)!r} is not a rank count")
        if not isinstance(raw.get("loader"), str) or not isinstance(raw.get("state"), dict):
            raise CheckpointError(where, "data-loader record: no loader name or no state dict")
        order = raw.get("order")
        if order is not None:
            order = _order(order, where)
        return cls(
            rank=raw["rank"],
            world=raw["world"],
            dp_rank=raw["dp_rank"],
            dp_size=raw["dp_size"],
            loader=raw["loader"],
            state=raw["state"],
            order=order,
        )


_ORDER_TYPES = {
    "sampler": str,
    "dataset_len": int,
    "seed": int,
    "shuffle": bool,
    "drop_last": bool,
    "epoch": int,
    "num_replicas": int,
    "rank": int,
    "samples": int,
    "finished": bool,
}


def _order(raw: Any, where: str) -> GlobalOrder:
    if not isinstance(raw, dict) or set(raw) != set(_ORDER_TYPES):
        raise CheckpointError(where, f"data-loader record: the global order has fields {sorted(raw or ())}")
    for key, kind in _ORDER_TYPES.items():
        if type(raw[key]) is not kind or (kind is int and key != "seed" and raw[key] < 0):
            raise CheckpointError(where, f"data-loader record: order {key} {raw[key]!r} is not a {kind.__name__}")
    return GlobalOrder(**raw)


class DataPositionRefused(CheckpointError):
    """A healthy checkpoint whose data position the given loader cannot continue: an older tag would not do better."""


def checked_records(raw: Any, where: str) -> list[LoaderRecord]:
    """Every saved rank's record, in rank order: one per rank of the world that saved them, or refused."""
    if not isinstance(raw, (list, tuple)) or not raw:
        raise CheckpointError(where, "data-loader records are not a list of one record per rank")
    records = [LoaderRecord.decode(r, where) for r in raw]
    world = records[0].world
    ranks = [r.rank for r in records]
    if any(r.world != world for r in records) or ranks != list(range(world)):
        raise CheckpointError(where, f"data-loader records of ranks {ranks}, for a world of {world}: some are missing")
    return records
