"""The data-loader records a save keeps, read back and planned in one process: where a resume continues, and what it
refuses, naming the loader, before the engine is touched."""

from __future__ import annotations

import dataclasses
import types

import inprocess
import pytest
import torch
from torch.utils.data import DistributedSampler

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.data_position import DataPositionRefused, GlobalOrder, LoaderRecord
from ucp_deepspeed.runtime.checkpointer import _warn_if_steps_move
from ucp_deepspeed.runtime.data_position import capture, resume_plan
from ucp_deepspeed.tools.cli import main as cli_main

DATA = list(range(48))
ENGINE = types.SimpleNamespace(data_parallel_group=None)  # data-parallel rank 0 of 1


@pytest.fixture(scope="module", autouse=True)
def _one_rank() -> None:
    inprocess.one_rank()


def loader(seed: int = 3, batch: int = 4, epoch: int = 0, data: list[int] = DATA, workers: int = 0, **kw):
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=seed)
    sampler.set_epoch(epoch)
    return StatefulDataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers, **kw)


def permutation(epoch: int, data: list[int] = DATA, seed: int = 3) -> list[int]:
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def saved_at(
    ranks: int = 2, samples: int | tuple[int, ...] = 6, seed: int = 3, epoch: int = 1, length: int = len(DATA), **kw
) -> list[dict]:
    """The records `ranks` ranks would have saved, each `samples` (or `samples[r]`) into its share of `epoch`."""
    each = samples if isinstance(samples, tuple) else (samples,) * ranks
    order = GlobalOrder(
        sampler="DistributedSampler",
        dataset_len=length,
        seed=seed,
        shuffle=True,
        drop_last=False,
        epoch=epoch,
        num_replicas=ranks,
        rank=0,
        samples=0,
        finished=False,
    )
    return [
        LoaderRecord(
            rank=r,
            world=ranks,
            dp_rank=r,
            dp_size=ranks,
            loader="StatefulDataLoader over list",
            state={},
            order=dataclasses.replace(order, rank=r, samples=each[r], **kw),
        ).encode()
        for r in range(ranks)
    ]


def drawn(live) -> list[int]:
    return [x for b in live for x in b.tolist()]


def test_the_resumed_loader_continues_the_permutation():
    """Two ranks that each took 6 samples of epoch 1 consumed the first 12 of its permutation: one rank goes on with
    the 13th, in epoch 1."""
    live = loader()
    resume_plan(saved_at(), live, ENGINE, "ckpt/tag")()
    assert live.sampler.epoch == 1 and drawn(live) == permutation(1)[12:]


def test_an_epoch_that_was_over_starts_the_next():
    """Saved after the epoch ended, or into the sampler's padding (4 ranks take 3 each of 10 samples: 12), the resume
    starts the next epoch from its beginning, rather than replaying the one done or failing to skip past its end."""
    for records, data in ((saved_at(samples=24, finished=True), DATA), (saved_at(4, 3, length=10), list(range(10)))):
        live = loader(data=data)
        resume_plan(records, live, ENGINE, "ckpt/tag")()
        assert live.sampler.epoch == 2 and drawn(live) == permutation(2, data), data


@pytest.mark.parametrize(
    ("saved", "reason"),
    [
        (saved_at(seed=4), "seed 4 against 3"),
        (saved_at(samples=(6, 5)), "different positions"),
        (saved_at()[:1], "some are missing"),
        (saved_at(3, 5), "do not split"),  # 15 samples over 2 ranks: the live sampler's are asked for 7.5 each
    ],
)
def test_a_resume_that_cannot_continue_is_refused(saved, reason):
    live = loader()
    live.sampler.num_replicas = 2 if reason == "do not split" else 1
    with pytest.raises(DataPositionRefused, match=reason):
        resume_plan(saved, live, ENGINE, "ckpt/tag")


def test_a_record_is_checked_field_by_field():
    bad = saved_at()
    bad[1]["order"]["samples"] = -1
    with pytest.raises(DataPositionRefused, match="samples -1"):
        resume_plan(bad, loader(), ENGINE, "ckpt/tag")
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        capture(ENGINE, torch.utils.data.DataLoader(DATA))


def test_workers_that_snapshot_every_few_steps_are_counted_to_the_step():
    """With `snapshot_every_n_steps=4`, a state taken after 3 batches holds the snapshot of batch 0 and 3 steps since;
    the position counts all 3 batches (counting the snapshot alone trained 12 samples twice)."""
    saving = loader(workers=2, snapshot_every_n_steps=4)
    batches = iter(saving)
    for _ in range(3):
        next(batches)
    record = capture(ENGINE, saving)
    assert record.order is not None and record.order.samples == 12
    live = loader(workers=2, snapshot_every_n_steps=4)
    resume_plan([record.encode()], live, ENGINE, "ckpt/tag")()
    assert drawn(live) == permutation(0)[12:]


def test_a_loader_without_a_global_order_continues_only_in_its_place():
    """A loader whose position is its own (here: given another number of workers than it saved with) is refused
    rather than handed a state it fails on at its first batch."""
    record = dataclasses.replace(capture(ENGINE, loader()), order=None)
    with pytest.raises(DataPositionRefused, match="1 workers"):
        resume_plan([record.encode()], loader(workers=1), ENGINE, "ckpt/tag")
    resume_plan([record.encode()], loader(), ENGINE, "ckpt/tag")()  # in its place: its own state


@pytest.mark.parametrize(
    ("batch", "named"), [(32, "samples 256-383 are trained on again"), (64, "samples 384-511 are skipped")]
)
def test_a_changed_global_batch_names_the_samples_a_step_skipping_loader_misplaces(caplog, batch, named):
    """8 steps of 48 saved, resumed at another global batch without a data_loader: one warning naming the samples a
    loader that skips whole steps repeats (a smaller batch) or skips (a larger one); none for a source that counts no
    samples (a PyTorch DCP import) or whose steps had no one size (Megatron-LM's batch ramp-up)."""
    with caplog.at_level("WARNING", logger="ucp_deepspeed"):
        _warn_if_steps_move(types.SimpleNamespace(global_steps=8, global_samples=384, train_batch_size=lambda: batch))
        for same in (8 * batch, 0, 8 * 48 - 5):  # the same batch; no samples counted; a ramp-up (no one batch)
            _warn_if_steps_move(
                types.SimpleNamespace(global_steps=8, global_samples=same, train_batch_size=lambda: batch)
            )
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "a global batch of 48" in messages[0] and named in messages[0], messages


def test_a_refused_position_is_not_taken_for_a_damaged_tag(tmp_path):
    """The newest tag's data position does not fit the loader: the load is refused, with the engine as it was, and
    does not go back to an older tag that would load (saved without a loader: it would silently restart training
    there, from the start of the epoch)."""
    engine = inprocess.build(1)
    saving = loader()
    next(iter(saving))
    engine.save_checkpoint(str(tmp_path), tag="older")
    inprocess.train(engine, 2)
    engine.save_checkpoint(str(tmp_path), tag="newer", data_loader=saving)
    fresh = inprocess.build(1, seed=1)
    before = inprocess.state(fresh)
    with pytest.raises(DataPositionRefused, match="seed 3 against 4"):
        fresh.load_checkpoint(str(tmp_path), data_loader=loader(seed=4))
    assert inprocess.differences(before, inprocess.state(fresh)) == [] and fresh.ucp_last_load is None


def test_a_tag_saved_again_reads_only_its_own_loader_file(tmp_path, caplog):
    """A tag saved with a loader, then again without one once `latest` names another (a save into the tag `latest`
    names starts from an empty folder): its metadata says there is no loader file now, so the one left behind
    (another save's) is neither read by `ucp convert` nor by a load; the load says the tag has none."""
    engine = inprocess.build(1)
    engine.save_checkpoint(str(tmp_path), tag="t", data_loader=loader())
    engine.save_checkpoint(str(tmp_path), tag="other")
    engine.save_checkpoint(str(tmp_path), tag="t", save_latest=False)
    assert (tmp_path / "t" / "data_loader.pt").is_file()
    out = str(tmp_path / "converted")
    assert cli_main(["convert", str(tmp_path), "--tag", "t", "--output", out, "--no-progress"]) == 0
    with caplog.at_level("WARNING", logger="ucp_deepspeed"):
        inprocess.build(1).load_checkpoint(str(tmp_path), tag="t", data_loader=loader())
    assert any("holds no data-loader state" in r.getMessage() for r in caplog.records)


def test_a_damaged_loader_file_is_found_by_verify(tmp_path, capsys):
    engine = inprocess.build(1)
    engine.save_checkpoint(str(tmp_path), tag="t", data_loader=loader())
    path = tmp_path / "t" / "data_loader.pt"
    data = bytearray(path.read_bytes())
    at = data.index(b"samples_yielded")
    data[at] ^= 1
    path.write_bytes(bytes(data))
    assert cli_main(["verify", str(tmp_path / "t")]) != 0
    assert "data_loader.pt" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="data_loader.pt"):
        inprocess.build(1).load_checkpoint(str(tmp_path), tag="t", data_loader=loader())
