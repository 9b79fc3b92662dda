"""Every rank of a large job, one after another in this process: torch's fake process group, with object collectives
replayed between the ranks.

Why not threads (`tests/test_threaded_ranks.py`): a DeepSpeed engine per rank needs DeepSpeed's communication state,
which is one per process, and threads sharing one GIL never finished a world of 1024. Here each rank runs alone:
`FakeWorld.rank(r)` makes this process rank `r` of the world (torch's `fake` backend, the one PyTorch's own
one-process tests of multi-rank logic use: tensor collectives return at once and move no data) and patches the two
object collectives the load path decides with:

- `broadcast_object_list` from rank `src` hands every later rank what `src` sent at the same call, so rank 0 (run
  first) picks the tag and the plan for all;
- `all_gather_object` gives each rank what the ranks run before it contributed at that call, and its own object
  for the ranks not run yet: the ranks of a data-parallel job that all succeed contribute alike (no problems, the
  same parameter names), which is what a real gather would have shown them; `gather_object` does the same for its
  destination rank.

What this cannot show: data moved by tensor collectives (ZeRO-3's gather of persistent parameters, gradient
reduction); those stay covered by the torchrun tests.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from deepspeed.comm import comm
from torch.testing._internal.distributed.fake_pg import FakeStore


class FakeWorld:
    """A world of `size` ranks, entered one rank at a time (`with world.rank(r): ...`), rank 0 first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._broadcasts: dict[int, bytes] = {}
        self._gathers: dict[int, dict[int, Any]] = {}
        self._rank, self._calls = 0, 0

    def _broadcast(self, object_list: list[Any], src: int = 0, group: Any = None, device: Any = None) -> None:
        call, self._calls = self._calls, self._calls + 1
        if self._rank == src:
            self._broadcasts[call] = pickle.dumps(object_list)
        elif call in self._broadcasts:
            object_list[:] = pickle.loads(self._broadcasts[call])
        else:
            raise AssertionError(f"rank {self._rank} reached broadcast {call}, which rank {src} never made")

    def _all_gather(self, object_list: list[Any], obj: Any, group: Any = None) -> None:
        call, self._calls = self._calls, self._calls + 1
        sent = self._gathers.setdefault(call, {})
        # what a rank receives is a copy of what was sent, made once per sender: the load path only reads it
        sent[self._rank] = pickle.loads(pickle.dumps(obj))
        object_list[:] = [sent.get(r, sent[self._rank]) for r in range(len(object_list))]

    def _gather(self, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None) -> None:
        gathered: list[Any] = [None] * self.size
        self._all_gather(gathered, obj)
        if self._rank == dst and object_gather_list is not None:
            object_gather_list[:] = gathered

    @contextmanager
    def rank(self, rank: int) -> Iterator[None]:
        """This process as rank `rank` of the world, until the block ends; any process group before it is replaced
        (and not restored: `inprocess.one_rank` makes a new one)."""
        if dist.is_initialized():
            _destroy()
        env = {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(self.size), "LOCAL_WORLD_SIZE": "1"}
        saved_env = {k: os.environ.get(k) for k in env}
        saved = dist.broadcast_object_list, dist.all_gather_object, dist.gather_object
        os.environ.update(env)
        dist.broadcast_object_list, dist.all_gather_object, dist.gather_object = (  # type: ignore[assignment]
            self._broadcast,
            self._all_gather,
            self._gather,
        )
        self._rank, self._calls = rank, 0
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=self.size)
        try:
            yield
        finally:
            _destroy()
            dist.broadcast_object_list, dist.all_gather_object, dist.gather_object = saved
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _destroy() -> None:
    """End the process group; through DeepSpeed once it has taken it up, which also drops the groups it cached."""
    if comm.cdb is not None:
        comm.destroy_process_group()
    else:
        dist.destroy_process_group()
