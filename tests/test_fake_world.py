"""Every rank of a resuming job of 8, 64 and 1024 ranks restores its share, each a real DeepSpeed engine, in one
process.

A ZeRO-1 checkpoint saved by one rank (`inprocess.Net`, two param groups of 536 and 19 elements, AdamW, 3 steps) is
loaded by every rank of a larger world at ZeRO-1, 2 or 3, one rank after another over torch's fake process group
(`tests/fakeworld.py`): each rank builds its engine, whose partitioning DeepSpeed computes for that rank of that
world, and runs the real `load_checkpoint` (a direct reshard: rank 0 picks the tag, every rank plans and reads its
ranges straight from the saved rank file, checks and commits). Then what the rank holds, read back through
DeepSpeed's own accessors (`safe_get_local_fp32_param`, `safe_get_local_optimizer_state`), is put in place; all
ranks' pieces together must cover every element of every fp32 master and Adam moment exactly once and equal, with
`torch.equal`, an offline conversion of the same tag. The frozen weight, the buffer and the counters, which every
rank holds whole (ZeRO-1/2), must equal it on every rank. At 64 ranks most ranks own nothing of the small group
(ZeRO-1/2 pads its 19 elements to 128, in partitions of 2): a rank restoring anything it does not own would cover an
element twice.

Worlds of 8 and 64 take a few seconds and run by default; 1024 ranks take 30-100 s a stage here and run with
`-m scale`.

The same check runs on the real DP=2 checkpoints the session's launch saved of the torchrun matrix's tiny LM (tied
embedding, frozen parameter, integer buffer, two param groups with their own hyperparameters): ZeRO-0/1/2/3, bf16,
ZeRO-Offload's CPU Adam and SGD sources, each restored by every rank of worlds of 3 to 16 at another stage. This is
the state half of `test_reshard.py`'s cells without a launch; the torchrun cells add the next losses.

What the fake group cannot show, data moved by tensor collectives, is covered by the torchrun tests
(`test_reshard.py`, `test_large_dp.py`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import inprocess
import pytest
import torch
from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state
from fakeworld import FakeWorld

from ucp_deepspeed import UniversalCheckpoint, compat, convert
from ucp_deepspeed.format.metadata import FP32, VALUE
from ucp_deepspeed.tools.cli import main as ucp

TAG = "global_step3"


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> Path:
    """A ZeRO-1 checkpoint of `inprocess.Net` saved by one rank."""
    inprocess.one_rank()
    out = tmp_path_factory.mktemp("fake_world") / "net"
    engine = inprocess.build(1)
    inprocess.train(engine, 3)
    engine.save_checkpoint(str(out))
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Callable[[Path], UniversalCheckpoint]:
    """The offline conversion of a checkpoint, made once: what every world is compared with."""
    out = tmp_path_factory.mktemp("references")
    done: dict[Path, UniversalCheckpoint] = {}

    def reference(ckpt: Path) -> UniversalCheckpoint:
        if ckpt not in done:
            folder = convert(str(ckpt), TAG, output=str(out / f"{len(done)}"), progress=False)
            done[ckpt] = UniversalCheckpoint(folder)
        return done[ckpt]

    return reference


def _held(engine: Any, stage: int, keys: dict[str, tuple[str, ...]]) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
    """(parameter, first element, {state: values}) of every piece of a parameter this rank holds: the fp32 master and
    optimizer states (`keys`) of trainable ones, the value of frozen ones (whole on every rank, except at ZeRO-3)."""
    out = []
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            if stage == 3:
                part = compat.zero3_partition(p)
                out.append((name, part.start, {VALUE: part.tensor.flatten()[: part.numel].clone()}))
            else:
                out.append((name, 0, {VALUE: p.detach().flatten().clone()}))
            continue
        if stage == 3:
            piece = compat.zero3_fragment(engine.optimizer, p)
            start, numel = piece.start, piece.numel
            values = {FP32: safe_get_local_fp32_param(p)}
            values.update({k: safe_get_local_optimizer_state(p, k) for k in keys[name]})
        elif p._hp_mapping is not None:
            start, numel = p._hp_mapping.lp_fragment_address.start, p._hp_mapping.lp_fragment_address.numel
            values = {FP32: p._hp_mapping.get_hp_fragment()}
            values.update({k: p._hp_mapping.get_hp_fragment(k) for k in keys[name]})
        else:
            continue
        if numel == 0:
            continue
        out.append((name, start, {k: v.flatten()[:numel].clone() for k, v in values.items()}))
    return out


def restore_every_rank(
    ckpt: Path, reference: UniversalCheckpoint, world: int, stage: int, build: Callable[[int], Any]
) -> float:
    """Load `ckpt` into `build(rank)` on every rank of the world; check each rank's whole state and all ranks'
    pieces together against `reference`. Returns the seconds taken."""
    keys = {n: tuple(k for k in r.keys if k != FP32) for n, r in reference.params.items() if r.trainable}
    expected = {(n, k): reference.read(n, k).flatten() for n in keys for k in (FP32, *keys[n])}
    frozen = [n for n, r in reference.params.items() if not r.trainable]
    expected.update({(n, VALUE): reference.read(n, VALUE).flatten() for n in frozen})
    got = {key: torch.full_like(value, float("nan")) for key, value in expected.items()}
    covered = {key: torch.zeros(value.numel(), dtype=torch.int32) for key, value in expected.items()}
    fake = FakeWorld(world)
    start = time.perf_counter()
    for rank in range(world):
        with fake.rank(rank):
            engine = build(rank)
            try:
                engine.load_checkpoint(str(ckpt))
                held = _held(engine, stage, keys)
                report = engine.ucp_last_load
                buffers = dict(engine.module.named_buffers())
            finally:
                engine.destroy()  # ZeRO-3's gradient hooks keep an engine (and 2 GB of buckets) alive otherwise
            assert (report.mode, report.in_place, engine.global_steps) == ("resharded", True, 3), (rank, report)
            for name, buffer in buffers.items():
                assert torch.equal(buffer, reference.read_buffer(name)), (rank, name)
            for name, first, values in held:
                for key, value in values.items():
                    if (name, key) not in expected:  # a frozen parameter the save left out keeps its live value
                        continue
                    if name in frozen and stage != 3 and rank > 0:
                        assert torch.equal(value, expected[(name, key)]), (rank, name)
                        continue
                    got[(name, key)][first : first + value.numel()] = value
                    covered[(name, key)][first : first + value.numel()] += 1
    elapsed = time.perf_counter() - start
    assert len(expected) >= 10
    for key, value in expected.items():
        assert bool((covered[key] == 1).all()), (world, stage, key, covered[key].tolist())
        assert torch.equal(got[key], value), (world, stage, key)
    return elapsed


@pytest.fixture(autouse=True)
def no_gc_in_zero3_init(monkeypatch) -> None:
    """ZeRO-3's constructor collects garbage: 0.45 s of its 0.5 s per rank in pytest's heap, and it frees memory
    only."""
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)


@pytest.mark.parametrize(
    "world,stage",
    [(8, 1), (8, 2), (8, 3), (64, 1), (64, 2), (64, 3)]
    + [pytest.param(1024, stage, marks=pytest.mark.scale) for stage in (1, 2, 3)],
)
def test_every_rank_of_a_world_restores_its_share(net, references, world, stage):
    elapsed = restore_every_rank(net, references(net), world, stage, lambda rank: inprocess.build(stage, seed=rank + 1))
    print(f"world {world} ZeRO-{stage}: {elapsed:.1f} s, {1000 * elapsed / world:.0f} ms a rank")


# (source variant saved at DP=2 by the session's launch, target variant, world sizes): the tiny LM of the torchrun
# matrix, with its tied embedding, frozen scale, integer buffer and two param groups with their own hyperparameters
SOURCES = [
    ("z1", "z3", (3, 16)),
    ("z2", "z1", (3, 8)),
    ("z3", "z2", (4, 16)),
    ("z0", "z2", (3,)),
    ("bf16z2", "z1", (3,)),
    ("z2nofrozen", "z1", (3,)),
    ("offz2", "z3", (6,)),
    ("sgdz2", "sgdz1", (8,)),
]


@pytest.mark.parametrize("source,target,worlds", SOURCES, ids=[f"{s}-to-{t}" for s, t, _ in SOURCES])
def test_every_rank_restores_a_real_dp2_checkpoint(sources, references, source, target, worlds):
    import train_tiny  # tests/workers/: the model and configs of the torchrun matrix

    stage = train_tiny.VARIANTS[target]["stage"]
    for world in worlds:
        restore_every_rank(
            sources[source], references(sources[source]), world, stage, lambda _: train_tiny.build(target)
        )


def save_every_rank(out: Path, world: int, stage: int, build: Callable[[], Any] | None = None) -> Path:
    """Train 3 steps and save on every rank of the world, one after another (`build()`, by default `inprocess.Net`
    at `stage`): DeepSpeed's real save, each rank writing its own partition's file (gradients are not reduced over the
    fake group, so the ranks' partitions come from runs that differ; every file is still what DeepSpeed writes at
    that rank and world).

    The fake backend moves no data, so two ZeRO-3 safeguards that compare ranks through it are switched off: the
    check that every rank traced the same module order (a broadcast that leaves other ranks at -1), and the
    non-finite gradient norm, which would skip the step (the gradients are reduced into uninitialised memory) and
    leave a rank with no optimizer state to save."""
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.runtime.zero.stage3 as stage3

    fake = FakeWorld(world)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(coordinator, "assert_ints_same_as_other_ranks", lambda ints: None)
        patch.setattr(stage3, "is_invalid_grad_norm", lambda norm: False)
        for rank in range(world):
            with fake.rank(rank):
                engine = build() if build is not None else inprocess.build(stage)
                try:
                    inprocess.train(engine, 3)
                    engine.save_checkpoint(str(out))
                finally:
                    engine.destroy()
    return out


@pytest.mark.parametrize("world,stage", [(8, 1), (8, 2), (16, 1), (16, 2), (64, 1)])
def test_a_save_at_a_large_dp_with_empty_partitions_reshards(references, tmp_path, capsys, world, stage):
    """The second param group (19 elements) is padded to 2 x DP: at DP=8 ranks 5-7 save nothing of it, at DP=16
    ranks 5-15, at 64 ranks 10-63. Healthy checkpoints that were once refused as contradicting their metadata: each
    verifies, converts, and every rank of a DP=3 job at each stage restores exactly the converted tensors."""
    ckpt = save_every_rank(tmp_path / "ckpt", world, stage)
    assert ucp(["verify", str(ckpt)]) == 0, capsys.readouterr()
    reference = references(ckpt)
    for target in (1, 2, 3):
        restore_every_rank(ckpt, reference, 3, target, lambda rank, stage=target: inprocess.build(stage, seed=rank + 1))
