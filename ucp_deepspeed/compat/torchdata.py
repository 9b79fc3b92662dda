"""torchdata's `StatefulDataLoader`: where its `state_dict` keeps a map-style loader's position.

The loader's state is torchdata's own format. With `num_workers=0` its keys are at the top; with workers they are
under `_snapshot._main_snapshot`. A map-style loader built with `batch_size` draws its indices through torchdata's
`BatchSampler`, whose iterator state counts the indices taken from the sampler (`_sampler_iter_state.samples_yielded`);
a loaded state skips that many (or, for a stateful sampler, hands it `sampler_state`). The batches yielded
(`_sampler_iter_yielded`, `_num_yielded`, `_snapshot_step`) are bookkeeping for snapshots.
"""

from __future__ import annotations

import copy
from typing import Any

_STATEFUL_SAMPLER = "StatefulDistributedSampler"


def is_stateful_loader(loader: Any) -> bool:
    """Whether `loader` saves and loads its position (`state_dict`, `load_state_dict`), as torchdata's does."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def loader_name(loader: Any) -> str:
    """The loader's and its dataset's class names, as messages name a loader."""
    dataset = getattr(loader, "dataset", None)
    return f"{type(loader).__name__} over {type(dataset).__name__}" if dataset is not None else type(loader).__name__


def distributed_sampler(loader: Any) -> Any:
    """The loader's `DistributedSampler` (or torchdata's `StatefulDistributedSampler`, exactly: a subclass may draw
    another order) when it is map-style and batches by `batch_size` through torchdata's `BatchSampler`, the one case
    whose position is a count of indices; None otherwise."""
    from torch.utils.data import DistributedSampler, IterableDataset
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    if isinstance(getattr(loader, "dataset", None), IterableDataset) or getattr(loader, "batch_size", None) is None:
        return None
    sampler = getattr(loader, "sampler", None)
    return sampler if type(sampler) in (DistributedSampler, StatefulDistributedSampler) else None


def _main(state: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = state["_snapshot"]["_main_snapshot"] if "_snapshot" in state else state
    return found


def samples_taken(loader: Any, state: dict[str, Any]) -> tuple[int, bool]:
    """How many indices the map-style `loader` had handed to training this epoch, and whether it had finished the
    epoch. With workers the state is the last snapshot and the batches yielded since it (`snapshot_every_n_steps`),
    which a load fast-forwards; each of those is a whole batch but perhaps the epoch's last."""
    it = _main(state).get("_sampler_iter_state") or {}
    taken = it.get("samples_yielded", 0)
    since = state.get("_steps_since_snapshot", 0)
    if type(taken) is not int or type(since) is not int:
        raise ValueError(f"the loader's state counts {taken!r} samples and {since!r} steps since its snapshot")
    return min(taken + since * loader.batch_size, len(loader.sampler)), bool(state.get("_iterator_finished", False))


def state_workers(state: dict[str, Any]) -> int:
    """The number of worker processes the loader that saved `state` had."""
    workers = _main(state).get("_num_workers", 0) if "_snapshot" in state else 0
    return workers if type(workers) is int else -1


def state_at(loader: Any, samples: int) -> dict[str, Any]:
    """A state for `loader` (built, not yet iterated) that starts its epoch after `samples` indices of its sampler."""
    state: dict[str, Any] = copy.deepcopy(loader.state_dict())
    main = _main(state)
    it = dict(main.get("_sampler_iter_state") or {})
    it["samples_yielded"] = samples
    if type(loader.sampler).__name__ == _STATEFUL_SAMPLER:
        it["sampler_state"] = {"yielded": samples}
    batches = -(-samples // loader.batch_size)
    main["_sampler_iter_state"] = it
    main["_sampler_iter_yielded"] = batches
    if "_snapshot" in state:
        state["_snapshot"]["_snapshot_step"] = batches
        state["_steps_since_snapshot"] = 0
    else:
        state["_num_yielded"] = batches
    state["_iterator_finished"] = False
    return state
