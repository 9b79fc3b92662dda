"""Per-rank random state across a reshard: kept where a rank keeps its role, re-seeded where it does not.

DeepSpeed saves one client state per model-parallel rank, and Megatron-DeepSpeed keeps each rank's random streams
in it (`get_rng_state()`: `random_rng_state`, `np_rng_state`, `torch_rng_state`, `cuda_rng_state` and the
tracker's `rng_tracker_states`). At the same tensor- and pipeline-parallel sizes every rank gets its own rank's
client state back. At other sizes no saved rank's streams belong to a live rank, and handing model-parallel rank
0's to every rank would make every tensor-parallel rank draw the same dropout masks inside its shard of a layer.
So every random state under one of those names is replaced by a new one, derived from the saved state and the
live rank's role, with megatron-core's pattern of which ranks share a stream (`model_parallel_cuda_manual_seed`):

- python, numpy, torch, the device's default generator and the tracker's `data-parallel-rng`: one stream per
  pipeline stage, shared by the tensor-parallel ranks of a stage (they must drop the same activations outside
  their shards);
- the tracker's `model-parallel-rng`: one per (stage, tensor-parallel rank);
- `expert-parallel-rng` and any other tracker name: one per (stage, tensor-parallel rank, expert-parallel rank).

The same checkpoint resumed at the same layout gives the same streams: nothing depends on time or on the order
ranks arrive.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from ucp_deepspeed.errors import CheckpointError

PYTHON, NUMPY, TORCH, DEVICE, TRACKER = (
    "random_rng_state",
    "np_rng_state",
    "torch_rng_state",
    "cuda_rng_state",
    "rng_tracker_states",
)
RNG_KEYS = (PYTHON, NUMPY, TORCH, DEVICE, TRACKER)
_STAGE_STREAMS = ("data-parallel-rng",)
_TENSOR_STREAMS = ("model-parallel-rng",)


@dataclass(frozen=True)
class Role:
    """A live rank's place in the model: what its random streams are derived from."""

    pp_rank: int = 0
    tp_rank: int = 0
    ep_rank: int = 0


def reseeded(state: Any, role: Role, where: str) -> Any:
    """`state` (a client state) with every random state it holds under a known name replaced by one for `role`."""
    if isinstance(state, dict):
        return {k: _fresh(k, v, role, where) if k in RNG_KEYS else reseeded(v, role, where) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(reseeded(v, role, where) for v in state)
    return state


def holds_rng(state: Any) -> bool:
    """Whether a client state holds a random state under a known name."""
    if isinstance(state, dict):
        return any(k in RNG_KEYS or holds_rng(v) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return any(holds_rng(v) for v in state)
    return False


def reseed_process(process_index: int) -> None:
    """Give this process's generators (python, numpy, torch, the accelerator's) new streams of its own, derived from
    the state just restored and its index: for a process that restored another process's saved RNG file."""
    digest = hashlib.sha256(f"process/{process_index}".encode())
    _feed(digest, torch.get_rng_state())
    seed = int.from_bytes(digest.digest()[:8], "little") & (2**63 - 1)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)


def _fresh(key: str, saved: Any, role: Role, where: str) -> Any:
    if key == TRACKER:
        if not isinstance(saved, dict):
            raise CheckpointError(where, f"client_state {TRACKER} is a {type(saved).__name__}, not a dict of states")
        return {
            name: _generator_state(value, _seed(saved, key, name, _parts(name, role)), where)
            for name, value in saved.items()
        }
    seed = _seed(saved, key, "", (role.pp_rank,))
    if key == PYTHON:
        return random.Random(seed).getstate()
    if key == NUMPY:
        fresh = np.random.RandomState(seed % 2**32)
        return fresh.get_state(legacy=False) if isinstance(saved, dict) else fresh.get_state()
    return _generator_state(saved, seed, where)


def _parts(name: str, role: Role) -> tuple[int, ...]:
    if name in _STAGE_STREAMS:
        return (role.pp_rank,)
    if name in _TENSOR_STREAMS:
        return role.pp_rank, role.tp_rank
    return role.pp_rank, role.tp_rank, role.ep_rank


def _generator_state(saved: Any, seed: int, where: str) -> torch.Tensor:
    """A torch generator's state seeded with `seed`, for the device the saved one was taken on (by its size)."""
    if not torch.is_tensor(saved):
        raise CheckpointError(where, f"client_state random state is a {type(saved).__name__}, not a generator state")
    cpu = torch.Generator().manual_seed(seed).get_state()
    if saved.numel() == cpu.numel():
        return cpu
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" and accelerator.is_available():
        device = torch.Generator(device=accelerator.device_name()).manual_seed(seed).get_state()
        if saved.numel() == device.numel():
            return device
    raise CheckpointError(
        where,
        f"client_state holds a {saved.numel()}-byte generator state of a device this process has no generator "
        "for: a new stream for this rank cannot be made",
    )


def _seed(saved: Any, key: str, name: str, parts: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{key}/{name}/{parts}".encode())
    _feed(digest, saved)
    return int.from_bytes(digest.digest()[:8], "little") & (2**63 - 1)


def _feed(digest: Any, value: Any) -> None:
    """Hash a saved state by its content (tensors and arrays by their bytes)."""
    if torch.is_tensor(value):
        digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            digest.update(str(k).encode())
            _feed(digest, value[k])
    elif isinstance(value, (list, tuple)):
        for v in value:
            _feed(digest, v)
    else:
        digest.update(repr(value).encode())
