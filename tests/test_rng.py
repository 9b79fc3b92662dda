"""Per-rank random state across a reshard (`runtime/rng.py`), in one process: which live ranks share a stream, which
get one of their own, and that nothing else in a client state changes. The multi-rank check is the megatron-core
TP/PP reshards (`tests/test_megatron.py`, `client_state_ok` in tests/workers/gpt.py); the HF Trainer and
Accelerate ones are `tests/test_cross_framework.py`."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.runtime import rng
from ucp_deepspeed.runtime.integrations import _load_rng_state_any_world
from ucp_deepspeed.runtime.rng import Role, reseeded


def megatron_rng_state(seed: int) -> dict:
    """Megatron-DeepSpeed's per-rank client state: `get_rng_state()`'s list of one dict, and a plain entry."""
    return {
        "rng_state": [
            {
                "random_rng_state": random.Random(seed).getstate(),
                "np_rng_state": np.random.RandomState(seed).get_state(),
                "torch_rng_state": torch.Generator().manual_seed(seed).get_state(),
                "rng_tracker_states": {
                    "data-parallel-rng": torch.Generator().manual_seed(seed + 1).get_state(),
                    "model-parallel-rng": torch.Generator().manual_seed(seed + 2718).get_state(),
                    "expert-parallel-rng": torch.Generator().manual_seed(seed + 1024).get_state(),
                },
            }
        ],
        "iteration": 7,
    }


def same(a: object, b: object) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def streams(state: dict) -> dict:
    inner = state["rng_state"][0]
    return {
        "python": inner["random_rng_state"],
        "numpy": inner["np_rng_state"],
        "torch": inner["torch_rng_state"],
        **inner["rng_tracker_states"],
    }


def test_ranks_share_streams_as_megatron_seeds_them():
    """TP=2 x PP=2 x EP=2 from one saved rank's state: the default streams follow the stage, the model-parallel one
    the (stage, TP rank), the expert one every coordinate; all are new, and the same on a second call."""
    saved = megatron_rng_state(5)
    roles = [Role(pp, tp, ep) for pp in range(2) for tp in range(2) for ep in range(2)]
    fresh = {role: streams(reseeded(saved, role, "ckpt")) for role in roles}
    old = streams(saved)
    for role, got in fresh.items():
        assert reseeded(saved, role, "ckpt")["iteration"] == 7
        assert same(got, streams(reseeded(saved, role, "ckpt"))), "not deterministic"
        assert not any(same(got[k], old[k]) for k in old), "a saved stream was handed on"
        for other, theirs in fresh.items():
            for key in ("python", "numpy", "torch", "data-parallel-rng"):
                assert same(got[key], theirs[key]) == (role.pp_rank == other.pp_rank), (role, other, key)
            assert same(got["model-parallel-rng"], theirs["model-parallel-rng"]) == (
                (role.pp_rank, role.tp_rank) == (other.pp_rank, other.tp_rank)
            )
            assert same(got["expert-parallel-rng"], theirs["expert-parallel-rng"]) == (role == other)


def test_states_keep_their_form_and_unknown_devices_are_refused():
    legacy = reseeded({"np_rng_state": np.random.RandomState(1).get_state()}, Role(), "c")["np_rng_state"]
    assert isinstance(legacy, tuple) and legacy[0] == "MT19937"
    modern = reseeded({"np_rng_state": np.random.RandomState(1).get_state(legacy=False)}, Role(), "c")
    assert isinstance(modern["np_rng_state"], dict)
    random.Random().setstate(reseeded(megatron_rng_state(1), Role(), "c")["rng_state"][0]["random_rng_state"])
    with pytest.raises(CheckpointError, match="ckpt/manifest.json: client_state holds a 16-byte generator state"):
        reseeded({"cuda_rng_state": torch.zeros(16, dtype=torch.uint8)}, Role(), "ckpt/manifest.json")


def test_a_trainer_process_without_its_own_rng_file_gets_a_stream_of_its_own(tmp_path):
    """3 processes resuming 2 saved files: 0 and 1 restore their own, 2 restores 0's and re-seeds from it."""
    for i in range(2):
        torch.save({"cpu": torch.Generator().manual_seed(100 + i).get_state()}, tmp_path / f"rng_state_{i}.pth")

    def trainer_restore(self, checkpoint):  # what Trainer._load_rng_state does on the CPU
        name = f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth"
        torch.set_rng_state(torch.load(f"{checkpoint}/{name}", weights_only=False)["cpu"])

    restore = _load_rng_state_any_world(trainer_restore)
    got = []
    for index in range(3):
        restore(SimpleNamespace(args=SimpleNamespace(process_index=index, world_size=3)), str(tmp_path))
        got.append(torch.get_rng_state())
    for i in range(2):
        assert torch.equal(got[i], torch.Generator().manual_seed(100 + i).get_state())
    assert not torch.equal(got[2], got[0]) and not torch.equal(got[2], got[1])
    restore(SimpleNamespace(args=SimpleNamespace(process_index=2, world_size=3)), str(tmp_path))
    assert torch.equal(torch.get_rng_state(), got[2]), "not deterministic"
    restore(SimpleNamespace(args=SimpleNamespace(process_index=0, world_size=1)), str(tmp_path))
    assert torch.equal(torch.get_rng_state(), got[0]), "one process keeps saved process 0's stream"
    rng.reseed_process(0)  # leaves the global generators seeded, as any test may find them
