"""A load is all or nothing: a refused load leaves every state of the engine as it was (one process, real engines).

Each case trains a target engine past its initial state, snapshots everything it holds (module weights and
buffers, the optimizer's whole state dict with fp32 masters and moments, counters, the scheduler), then loads a
checkpoint with one byte flipped in the middle of a tensor and compares every state with the snapshot.
Multi-rank cases (the damage found by another rank's reads) are in tests/faults/test_integrity.py and
tests/test_load_paths.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ucp_deepspeed import CheckpointError, convert

TAG2, TAG3 = "global_step2", "global_step3"


class _Net(torch.nn.Module):
    """An embedding table, a layer norm, a frozen projection and a buffer: every kind of state a restore writes."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(64, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 3)
        self.frozen = torch.nn.Linear(3, 1)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.head(self.norm(self.table(ids))) * self.scale).pow(2).mean()


@pytest.fixture(scope="module")
def one_rank() -> None:
    """A one-rank gloo process group in this process, as `deepspeed.initialize` needs one."""
    import os

    import torch.distributed as dist

    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)


def _engine(stage: int, seed: int = 0, adagrad: bool = False, **checkpoint: Any) -> Any:
    import ucp_deepspeed

    torch.manual_seed(seed)
    model = _Net()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "checkpoint": {"universal": {"enabled": True, "progress": False}, **checkpoint},
    }
    groups = [
        {"params": [model.table.weight, model.head.weight], "weight_decay": 0.0 if adagrad else 0.1},
        {"params": [model.norm.weight, model.norm.bias, model.head.bias], "weight_decay": 0.0},
    ]
    # Check-N-Run needs an optimizer that leaves rows without gradient as they were; torch's Adagrad makes its state
    # when built, which ZeRO-1/2's partitioning of a second group trips over
    # the table last, so that a restore has read every other parameter when it reaches a damaged table
    trainable = [model.norm.weight, model.norm.bias, model.head.weight, model.head.bias, model.table.weight]
    optimizer = torch.optim.Adagrad(trainable, lr=0.01) if adagrad else torch.optim.AdamW(groups, lr=0.01)
    return ucp_deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def _train(engine: Any, steps: int, offset: int = 0) -> None:
    for step in range(offset, offset + steps):
        ids = torch.tensor([[step % 64, (7 * step + 3) % 64], [(5 * step + 1) % 64, (11 * step) % 64]])
        engine.backward(engine(ids))
        engine.step()


def _copy(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _state(engine: Any) -> dict[str, Any]:
    """Everything a load may write, copied."""
    return _copy(
        {
            "module": dict(engine.module.state_dict()),
            "optimizer": engine.optimizer.state_dict(),
            "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps),
            "scheduler": engine.lr_scheduler.state_dict(),
        }
    )


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}" for k in set(a) ^ set(b)]
        return out + [d for k in set(a) & set(b) for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if type(a).__module__.startswith("deepspeed"):  # a loss scaler or other DeepSpeed object: compare its fields
        return _differences(vars(a), vars(b), where) if type(a) is type(b) else [where]
    return [] if a == b else [where]


def _flip_mid_tensor(path: Path) -> None:
    """Flip one byte in the middle of the file, which in a torch archive or safetensors file is tensor data."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved(one_rank, tmp_path_factory) -> Path:
    """A ZeRO-1 run saved at steps 2 and 3."""
    out = tmp_path_factory.mktemp("saved")
    engine = _engine(1)
    _train(engine, 2)
    engine.save_checkpoint(str(out / "z1"))
    _train(engine, 1, 2)
    engine.save_checkpoint(str(out / "z1"))
    return out / "z1"


def _damaged(saved: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    _flip_mid_tensor(ckpt / TAG3 / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return ckpt


def _refused_and_untouched(engine: Any, path: str, tag: str | None, match: str) -> None:
    before = _state(engine)
    with pytest.raises(CheckpointError, match=match):
        engine.load_checkpoint(path, tag=tag)
    assert _differences(before, _state(engine)) == []
    _train(engine, 1, 40)  # the engine is whole: it still trains and saves
    engine.save_checkpoint(path + ".after", tag="after")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "converted"])
def test_a_damaged_reshard_leaves_the_engine_as_it_was(saved, tmp_path, direct):
    """ZeRO-1 tag into a ZeRO-2 engine: read in place, or converted first (which refuses the damage)."""
    ckpt = _damaged(saved, tmp_path)
    engine = _engine(2, seed=1, direct=direct)
    _train(engine, 3)
    _refused_and_untouched(engine, str(ckpt), TAG3, "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def test_a_damaged_universal_folder_leaves_the_engine_as_it_was(saved, tmp_path):
    """The restore reads the converted copy's blocks one parameter after another: the bad one is found before any
    parameter is written, though the parameters of the first group were read before it."""
    folder = Path(convert(str(saved), TAG3, output=str(tmp_path / "folder"), progress=False))
    last = folder / "params" / "head.bias.safetensors"  # in the second param group
    _flip_mid_tensor(last)
    engine = _engine(2, seed=1)
    _train(engine, 3)
    _refused_and_untouched(engine, str(folder), None, last.name)


def test_a_damaged_chain_leaves_the_engine_as_it_was(one_rank, tmp_path):
    """A Check-N-Run chain with its middle delta's table damaged, read in place by a ZeRO-2 engine."""
    differential = {"differential": {"policy": "incremental"}}
    source = _engine(1, adagrad=True, **differential)
    for step in range(3):
        _train(source, 1, step)
        source.save_checkpoint(str(tmp_path / "chain"))
    middle = next((tmp_path / "chain" / TAG2 / "tables").iterdir())
    _flip_mid_tensor(middle)
    engine = _engine(2, seed=1, adagrad=True, **differential)
    _train(engine, 3)
    _refused_and_untouched(engine, str(tmp_path / "chain"), TAG3, "fails its crc32 check")


def test_an_unnamed_damaged_tag_falls_back_to_the_older_one(saved, tmp_path):
    ckpt = _damaged(saved, tmp_path)
    engine = _engine(2, seed=1)
    _train(engine, 3)
    engine.load_checkpoint(str(ckpt))
    report = engine.ucp_last_load
    assert report.refused == (TAG3,) and report.mode == "resharded" and engine.global_steps == 2, report


def test_a_native_load_that_fails_part_way_closes_the_engine_until_a_load_succeeds(saved, tmp_path):
    """DeepSpeed's own load (same layout) writes as it reads, so it cannot be staged: after it fails the engine
    refuses to step or save, and a successful load opens it again."""
    ckpt = _damaged(saved, tmp_path)
    engine = _engine(1, seed=1)
    _train(engine, 3)
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        engine.load_checkpoint(str(ckpt), tag=TAG3)
    with pytest.raises(CheckpointError, match="refusing to step"):
        _train(engine, 1)
    with pytest.raises(CheckpointError, match="refusing to save"):
        engine.save_checkpoint(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    engine.load_checkpoint(str(ckpt), tag=TAG2)
    assert engine.ucp_last_load.mode == "native" and engine.global_steps == 2
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "out"))
