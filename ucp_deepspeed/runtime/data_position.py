"""Where each rank's data loader stands: saved with a checkpoint, and continued at any data-parallel size.

A save given `data_loader=` keeps every rank's `LoaderRecord` (`format.data_position`). A load given one decides,
before the engine is touched, what the loader gets:

- the same ranks, each with its own sampler rank: its own saved state, whatever the loader (iterable datasets too);
- another data-parallel size, for a map-style loader over a `DistributedSampler`: a state that skips this rank's
  share of the global order the saved ranks consumed, with the sampler's epoch;
- anything else is refused, naming the loader, with the engine as it was.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ucp_deepspeed import compat
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.data_position import GlobalOrder, LoaderRecord, checked_records

log = logging.getLogger("ucp_deepspeed")


def capture(loader: Any) -> LoaderRecord:
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
        taken, finished = compat.samples_taken(state)
        order = dataclasses.replace(_order_of(sampler), samples=taken, finished=finished)
    return LoaderRecord(
        rank=dist.get_rank(), world=dist.get_world_size(), loader=compat.loader_name(loader), state=state, order=order
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


def resume_plan(saved: Any, loader: Any, where: str) -> Callable[[], None]:
    """What to do to this rank's `loader` once the load has committed; raises `CheckpointError` if it cannot continue
    where the saved ranks stood. `saved` is the checkpoint's list of records (None when the save kept none)."""
    name = compat.loader_name(loader)
    if saved is None:
        log.warning("ucp: %s holds no data-loader state; %s starts its epoch from the beginning", where, name)
        return lambda: None
    records = checked_records(saved, where)
    sampler = compat.distributed_sampler(loader)
    live = _order_of(sampler) if sampler is not None else None
    if records[0].world == dist.get_world_size():
        mine = records[dist.get_rank()]
        if (
            mine.order is None
            or live is None
            or (mine.order.num_replicas, mine.order.rank)
            == (
                live.num_replicas,
                live.rank,
            )
        ):
            _same_order(mine.order, live, name, where)
            return _install(loader, sampler, mine.state, mine.order)
    return _reshard(records, loader, sampler, live, name, where)


def _reshard(
    records: list[LoaderRecord], loader: Any, sampler: Any, live: GlobalOrder | None, name: str, where: str
) -> Callable[[], None]:
    """The state that continues the saved ranks' global order at this rank's sampler (see the module docstring)."""
    saved_at = f"saved by {records[0].world} ranks"
    orders = [r.order for r in records]
    first = orders[0]
    if live is None or first is None or any(o is None for o in orders):
        kept = records[0].loader if first is None else name
        raise CheckpointError(
            where,
            f"{kept}, {saved_at}, cannot continue at another data-parallel size: only a map-style loader over a "
            "DistributedSampler, batched by batch_size, has a global order to continue (an iterable dataset's "
            "position is its own state); resume at the saved size, or load without data_loader to start the epoch "
            "again",
        )
    for record, order in zip(records, orders):
        assert order is not None  # checked above
        differs = first.same_order(order) or (
            None if order.num_replicas == first.num_replicas else f"num_replicas {order.num_replicas}"
        )
        if differs is not None:
            raise CheckpointError(where, f"{name}: saved rank {record.rank} drew from another order ({differs})")
        if order.samples != first.samples:
            raise CheckpointError(
                where,
                f"{name}: the saved ranks stood at different positions (rank 0 had taken {first.samples} samples, "
                f"rank {record.rank} {order.samples}), so no global position continues them",
            )
    _same_order(first, live, name, where)
    if all(o.finished for o in orders if o is not None):
        return _install(loader, sampler, None, first)  # the epoch was over: the next one starts from its beginning
    consumed = first.samples * first.num_replicas
    if consumed % live.num_replicas:
        raise CheckpointError(
            where,
            f"{name}: the {consumed} samples the {first.num_replicas} saved data-parallel ranks took do not split "
            f"evenly over {live.num_replicas} ranks, so no state continues the global order at this size",
        )
    return _install(loader, sampler, compat.state_at(loader, consumed // live.num_replicas), first)


def _same_order(saved: GlobalOrder | None, live: GlobalOrder | None, name: str, where: str) -> None:
    """Refuse a saved order that is not the live sampler's permutation (the epoch is the saved one's to set)."""
    if saved is None or live is None:
        return
    differs = saved.same_order(dataclasses.replace(live, epoch=saved.epoch))
    if differs is not None:
        raise CheckpointError(where, f"{name}: saved over another data order than the live sampler's: {differs}")


def _install(loader: Any, sampler: Any, state: dict[str, Any] | None, order: GlobalOrder | None) -> Callable[[], None]:
    def install() -> None:
        if order is not None and sampler is not None:
            sampler.set_epoch(order.epoch)
        if state is not None:
            loader.load_state_dict(state)

    return install
