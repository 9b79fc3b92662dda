"""Where each rank's data loader stands: saved with a checkpoint, and continued at any data-parallel size.

A save given `data_loader=` keeps every rank's `LoaderRecord` (`format.data_position`). A load given one decides,
before the engine is touched, what the loader gets:

- a map-style loader over a `DistributedSampler`, at any data-parallel size: a state that skips this rank's share of
  the global order the saved ranks consumed, with the sampler's epoch (the next epoch, if they had finished theirs);
- any other loader, on a rank in the same place (the same world, data-parallel rank and size, and number of workers):
  its own saved state;
- anything else is refused (`DataPositionRefused`), naming the loader, with the engine as it was.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ucp_deepspeed import compat
from ucp_deepspeed.format.data_position import DataPositionRefused, GlobalOrder, LoaderRecord, checked_records
from ucp_deepspeed.protocols import Engine

log = logging.getLogger("ucp_deepspeed")


def capture(engine: Engine, loader: Any) -> LoaderRecord:
    """This rank's loader, as a save keeps it."""
    if not compat.is_stateful_loader(loader):
        raise TypeError(
            f"data_loader: a {type(loader).__name__} cannot say where it stands (no state_dict / load_state_dict); "
            "use torchdata's StatefulDataLoader"
        )
    state = loader.state_dict()
    sampler = compat.distributed_sampler(loader)
    order = None
    if sampler is not None:
        taken, finished = compat.samples_taken(loader, state)
        order = dataclasses.replace(_order_of(sampler), samples=taken, finished=finished)
    dp_rank, dp_size = compat.data_place(engine)
    return LoaderRecord(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        dp_rank=dp_rank,
        dp_size=dp_size,
        loader=compat.loader_name(loader),
        state=state,
        order=order,
    )


def _order_of(sampler: Any) -> GlobalOrder:
    return GlobalOrder(
        sampler=type(sampler).__name__,
        dataset_len=len(sampler.dataset),
        seed=int(sampler.seed),
        shuffle=bool(sampler.shuffle),
        drop_last=bool(sampler.drop_last),
        epoch=int(sampler.epoch),
        num_replicas=int(sampler.num_replicas),
        rank=int(sampler.rank),
        samples=0,
        finished=False,
    )


def resume_plan(saved: Any, loader: Any, engine: Engine, where: str) -> Callable[[], None]:
    """What to do to this rank's `loader` once the load has committed; raises `DataPositionRefused` if it cannot
    continue where the saved ranks stood. `saved` is the checkpoint's list of records (None when the save kept none)."""
    name = compat.loader_name(loader)
    if saved is None:
        log.warning("ucp: %s holds no data-loader state; %s starts its epoch from the beginning", where, name)
        return lambda: None
    try:
        records = checked_records(saved, where)
    except DataPositionRefused:
        raise
    except Exception as exc:
        raise DataPositionRefused(where, str(getattr(exc, "reason", exc))) from None
    sampler = compat.distributed_sampler(loader)
    if sampler is not None and all(r.order is not None for r in records):
        return _continue_order(records, loader, sampler, name, where)
    mine = records[dist.get_rank()] if records[0].world == dist.get_world_size() else None
    place = compat.data_place(engine)
    workers = getattr(loader, "num_workers", 0)
    if mine is not None and (mine.dp_rank, mine.dp_size) == place and compat.state_workers(mine.state) == workers:
        return _install(loader, None, mine.state, None)
    saved_at = (
        f"saved by {records[0].world} ranks at data-parallel size {records[0].dp_size} with "
        f"{compat.state_workers(records[0].state)} workers"
    )
    raise DataPositionRefused(
        where,
        f"{records[0].loader}, {saved_at}, continues only on a rank in the same place (here: data-parallel rank "
        f"{place[0]} of {place[1]}, {workers} workers): only a map-style loader over a DistributedSampler, batched by "
        "batch_size, has a global order to continue elsewhere (an iterable dataset's position is its own state); "
        "resume in the saved layout, or load without data_loader to start the epoch again",
    )


def _continue_order(
    records: list[LoaderRecord], loader: Any, sampler: Any, name: str, where: str
) -> Callable[[], None]:
    """The state that continues the saved ranks' global order at this rank's sampler (see the module docstring)."""
    orders = [r.order for r in records if r.order is not None]
    first = orders[0]
    for record, order in zip(records, orders):
        differs = first.same_order(order) or (
            None if order.num_replicas == first.num_replicas else f"num_replicas {order.num_replicas}"
        )
        if differs is not None:
            raise DataPositionRefused(where, f"{name}: saved rank {record.rank} drew from another order ({differs})")
        if order.samples != first.samples:
            raise DataPositionRefused(
                where,
                f"{name}: the saved ranks stood at different positions (rank 0 had taken {first.samples} samples, "
                f"rank {record.rank} {order.samples}), so no global position continues them",
            )
    live = _order_of(sampler)
    differs = first.same_order(dataclasses.replace(live, epoch=first.epoch))  # the epoch is the saved one's to set
    if differs is not None:
        raise DataPositionRefused(where, f"{name}: saved over another data order than the live sampler's: {differs}")
    consumed = first.samples * first.num_replicas
    if all(o.finished for o in orders) or consumed >= min(first.dataset_len, len(sampler) * live.num_replicas):
        # the epoch was over (into the sampler's padding, or all this size's sampler hands out): the next one starts
        return _install(loader, sampler, None, first.epoch + 1)
    if consumed % live.num_replicas:
        raise DataPositionRefused(
            where,
            f"{name}: the {consumed} samples the {first.num_replicas} saved data-parallel ranks took do not split "
            f"evenly over {live.num_replicas} ranks, so no state continues the global order at this size",
        )
    return _install(loader, sampler, compat.state_at(loader, consumed // live.num_replicas), first.epoch)


def _install(loader: Any, sampler: Any, state: dict[str, Any] | None, epoch: int | None) -> Callable[[], None]:
    def install() -> None:
        if epoch is not None:
            sampler.set_epoch(epoch)
        if state is not None:
            loader.load_state_dict(state)

    return install
