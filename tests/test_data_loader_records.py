"""The data-loader records a save keeps, read back and planned in one process: what a resume at another size refuses,
naming the loader, before the engine is touched."""

from __future__ import annotations

import dataclasses

import inprocess
import pytest
import torch
from torch.utils.data import DistributedSampler

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.data_position import GlobalOrder, LoaderRecord
from ucp_deepspeed.runtime.data_position import capture, resume_plan

DATA = list(range(48))


@pytest.fixture(scope="module", autouse=True)
def _one_rank() -> None:
    inprocess.one_rank()


def loader(seed: int = 3, batch: int = 4, epoch: int = 0):
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, seed=seed)
    sampler.set_epoch(epoch)
    return StatefulDataLoader(DATA, batch_size=batch, sampler=sampler)


def saved_at_two(samples: tuple[int, int] = (6, 6), seed: int = 3, epoch: int = 1) -> list[dict]:
    """The records two ranks would have saved, each `samples[r]` into its share of epoch `epoch`."""
    order = GlobalOrder(
        sampler="DistributedSampler",
        dataset_len=len(DATA),
        seed=seed,
        shuffle=True,
        drop_last=False,
        epoch=epoch,
        num_replicas=2,
        rank=0,
        samples=0,
        finished=False,
    )
    return [
        LoaderRecord(
            rank=r,
            world=2,
            loader="StatefulDataLoader over list",
            state={},
            order=dataclasses.replace(order, rank=r, samples=samples[r]),
        ).encode()
        for r in range(2)
    ]


def test_the_resumed_loader_continues_the_permutation():
    """Two ranks that each took 6 samples of epoch 1 consumed the first 12 of its permutation: one rank goes on with
    the 13th, in epoch 1."""
    live = loader()
    resume_plan(saved_at_two(), live, "ckpt/tag")()
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, seed=3)
    sampler.set_epoch(1)
    assert live.sampler.epoch == 1 and [x for b in live for x in b.tolist()] == list(sampler)[12:]


@pytest.mark.parametrize(
    ("saved", "live", "reason"),
    [
        (saved_at_two(seed=4), loader(), "seed 4 against 3"),
        (saved_at_two(samples=(6, 5)), loader(), "different positions"),
        (saved_at_two()[:1], loader(), "some are missing"),
        (saved_at_two(samples=(5, 5)), loader(), "do not split"),
    ],
)
def test_a_resume_that_cannot_continue_is_refused(saved, live, reason):
    if reason == "do not split":  # 10 samples over 1 rank split; over 3 they would not: a 3-replica live sampler
        live.sampler.num_replicas = 3
    with pytest.raises(CheckpointError, match=reason):
        resume_plan(saved, live, "ckpt/tag")


def test_a_record_is_checked_field_by_field():
    bad = saved_at_two()
    bad[1]["order"]["samples"] = -1
    with pytest.raises(CheckpointError, match="samples -1"):
        resume_plan(bad, loader(), "ckpt/tag")
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        capture(torch.utils.data.DataLoader(DATA))


@pytest.mark.parametrize(
    ("batch", "named"), [(32, "samples 256-383 are trained on again"), (64, "samples 384-511 are skipped")]
)
def test_a_changed_global_batch_names_the_samples_a_step_skipping_loader_misplaces(caplog, batch, named):
    """8 steps of 48 saved, resumed at another global batch without a data_loader: one warning naming the samples a
    loader that skips whole steps repeats (a smaller batch) or skips (a larger one)."""
    import types

    from ucp_deepspeed.runtime.checkpointer import _warn_if_steps_move

    engine = types.SimpleNamespace(global_steps=8, global_samples=384, train_batch_size=lambda: batch)
    with caplog.at_level("WARNING", logger="ucp_deepspeed"):
        _warn_if_steps_move(engine)
        _warn_if_steps_move(
            types.SimpleNamespace(global_steps=8, global_samples=8 * batch, train_batch_size=lambda: batch)
        )
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "a global batch of 48" in messages[0], messages
    assert named in messages[0], messages
