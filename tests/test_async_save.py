"""The checkpoint engines on their own, in one process: snapshots are exact and isolated from later updates, files
appear only whole (on disk, and on an S3 store), and a failed write, in the background or not, is an error, never a
moved `latest`."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from s3server import s3_server

import ucp_deepspeed.runtime.async_save
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.commit import read_commit
from ucp_deepspeed.io import remote
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.atomic import atomic_path, written_back
from ucp_deepspeed.io.spread import KEYS, SPREAD, Spread
from ucp_deepspeed.io.torch_file import load_file
from ucp_deepspeed.runtime.async_save import AsyncCheckpointEngine, snapshot
from ucp_deepspeed.runtime.native_io import BoundEngine, Guard


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield


def _state() -> dict:
    flat = torch.arange(12, dtype=torch.float32)
    return {
        "optimizer_state_dict": {
            "state": {0: {"exp_avg": torch.randn(3, 4), "step": torch.tensor(5.0)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "fp32_flat_groups": [flat],
        "views": OrderedDict(a=flat[:6], b=flat[6:].view(2, 3)),
        "ds_version": "0.19.8",
        "shape": (3, 4),
    }


def test_snapshot_is_a_copy_and_keeps_shared_storage():
    state = _state()
    snap = snapshot(state)
    expected = {
        k: v.clone()
        for k, v in (
            ("flat", state["fp32_flat_groups"][0]),
            ("exp_avg", state["optimizer_state_dict"]["state"][0]["exp_avg"]),
        )
    }
    state["fp32_flat_groups"][0].add_(1)  # training goes on after save_checkpoint returns
    state["optimizer_state_dict"]["state"][0]["exp_avg"].mul_(2)
    assert torch.equal(snap["fp32_flat_groups"][0], expected["flat"])
    assert torch.equal(snap["optimizer_state_dict"]["state"][0]["exp_avg"], expected["exp_avg"])
    assert type(snap["views"]) is OrderedDict and snap["shape"] == (3, 4)
    shared = snap["fp32_flat_groups"][0].untyped_storage().data_ptr()
    assert snap["views"]["b"].untyped_storage().data_ptr() == shared, "views still share one storage"
    assert torch.equal(snap["views"]["b"], expected["flat"][6:].view(2, 3))


def test_background_writes_then_commit(tmp_path):
    engine = AsyncCheckpointEngine()
    engine.zipfile_serialization = True  # a DeepSpeed config's default (no config: torch's legacy format)
    info = CheckpointCommitInfo(tag="global_step2", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    state = _state()
    path = str(tmp_path / "global_step2" / "mp_rank_00_model_states.pt")
    engine.save(state, path)
    expected = state["optimizer_state_dict"]["state"][0]["exp_avg"].clone()
    state["optimizer_state_dict"]["state"][0]["exp_avg"].zero_()
    engine.wait()
    assert engine.get_commit_info() is info
    assert engine.commit(info) and engine.get_commit_info() is None
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["optimizer_state_dict"]["state"][0]["exp_avg"], expected)
    with zipfile.ZipFile(path) as archive:  # the writer's torch.save skipped the CRCs: they were filled in after
        assert archive.testzip() is None and all(i.CRC for i in archive.infolist() if i.file_size)
    assert (
        loaded["views"]["b"].untyped_storage().data_ptr() == loaded["fp32_flat_groups"][0].untyped_storage().data_ptr()
    )
    assert os.listdir(tmp_path / "global_step2") == ["mp_rank_00_model_states.pt"], "no temporary file left behind"
    with pytest.raises(CheckpointError, match="still being written"):
        engine.create(info)
        engine.create(info)
    engine.cleanup()


def test_failed_write_is_an_error_and_leaves_no_file(tmp_path, monkeypatch):
    def disk_full(path: str, state: dict, zipfile_serialization: bool, save_id: str = "") -> None:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)

    monkeypatch.setattr(ucp_deepspeed.runtime.async_save, "write_file", disk_full)
    engine = AsyncCheckpointEngine(process=False)  # the thread a state that shared memory cannot hold is written by
    engine.create(CheckpointCommitInfo(tag="global_step4", save_dir=str(tmp_path), save_latest=True))
    path = str(tmp_path / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    engine.save(_state(), path)
    engine.wait()
    with pytest.raises(
        CheckpointError, match=r"global_step4: async save: 1 file\(s\) failed to write.*No space left on device"
    ):
        engine.get_commit_info()
    assert os.listdir(tmp_path / "global_step4") == []
    engine.cleanup()


def test_a_file_reaches_the_disk_while_it_is_still_being_written(tmp_path, monkeypatch):
    """`written_back` syncs the file as it grows, so the fsync after the write waits for its tail alone: here each
    sync sees more bytes than the one before, and the file is the bytes written."""
    path, seen = str(tmp_path / "f"), []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (seen.append(os.fstat(fd).st_size), real(fd))[1])
    with written_back(path, every=0.01), open(path, "wb") as f:
        for _ in range(20):
            f.write(b"x" * 4096)
            f.flush()
            time.sleep(0.02)
    assert len(seen) >= 3 and seen == sorted(seen) and 0 < seen[0] < 20 * 4096, seen
    assert Path(path).read_bytes() == b"x" * 20 * 4096


def test_a_failed_sync_while_writing_fails_the_write(tmp_path, monkeypatch):
    """An fsync that follows may not hear of an error the early sync's descriptor was told of: it is raised at
    once, and `atomic_path` leaves no file."""

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", eio)
    path = tmp_path / "f"
    with pytest.raises(OSError, match="Input/output error"):
        with atomic_path(str(path)) as tmp, written_back(tmp, every=0.01), open(tmp, "wb") as f:
            f.write(b"x")
            f.flush()
            time.sleep(0.2)
    assert os.listdir(tmp_path) == []


def test_a_write_the_writer_process_fails_fails_the_commit_naming_the_file(tmp_path):
    """The writer process's own failure (here its folder cannot be made: a file holds the name) comes back to the
    trainer as the commit's error, naming the file and the reason."""
    (tmp_path / "global_step4").write_bytes(b"")
    engine = AsyncCheckpointEngine()
    engine.create(CheckpointCommitInfo(tag="global_step4", save_dir=str(tmp_path), save_latest=True))
    engine.save(_state(), str(tmp_path / "global_step4" / "mp_rank_00_model_states.pt"))
    engine.wait()
    with pytest.raises(CheckpointError, match=r"global_step4: async save: 1 file\(s\) failed to write.*File exists"):
        engine.get_commit_info()
    engine.cleanup()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding to one CPU of one changes nothing")
def test_the_writer_process_runs_on_the_cpus_it_is_given_and_still_writes(tmp_path):
    """`async_writer_cpus`: every thread of the writer process runs on the CPUs named (the trainer keeps its own),
    and what it writes is what was saved."""
    cpu = min(os.sched_getaffinity(0))
    engine = AsyncCheckpointEngine(writer_cpus=[cpu])
    engine.zipfile_serialization = True
    engine.create(CheckpointCommitInfo(tag="global_step4", save_dir=str(tmp_path), save_latest=True))
    state, path = _state(), tmp_path / "global_step4" / "mp_rank_00_model_states.pt"
    engine.save(state, str(path))
    engine.wait()
    writer = engine._process._process.pid
    threads = {int(t): frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{writer}/task")}
    assert set(threads.values()) == {frozenset({cpu})}, threads
    assert len(os.sched_getaffinity(0)) > 1, "the trainer was bound too"
    assert engine.get_commit_info() is not None
    assert torch.equal(load_file(str(path))["fp32_flat_groups"][0], state["fp32_flat_groups"][0])
    engine.commit(engine.get_commit_info())
    engine.cleanup()


@pytest.mark.parametrize("cpus,reason", [([4096], "Invalid argument"), ([2**70], "too large")])
def test_cpus_the_machine_lacks_fail_at_once_by_name(cpus, reason):
    with pytest.raises(ValueError, match=rf'"async_writer_cpus" \[{cpus[0]}\]: .*{reason}'):
        AsyncCheckpointEngine(writer_cpus=cpus)


def test_staging_is_made_once_and_reused_by_every_later_save(tmp_path, monkeypatch, caplog):
    """A second save of the same shapes copies into the first one's shared memory (nothing allocated); a changed
    shape gets new buffers; a state shared memory cannot hold is written from a fresh copy by a thread, with one
    warning. Every file holds the state as it was at its save."""
    engine = AsyncCheckpointEngine()
    saved = []
    for step, scale in ((1, 1.0), (2, 2.0)):
        info = CheckpointCommitInfo(tag=f"global_step{step}", save_dir=str(tmp_path), save_latest=True)
        engine.create(info)
        state = _state()
        state["fp32_flat_groups"][0].mul_(scale)
        engine.save(state, str(tmp_path / info.tag / "mp_rank_00_model_states.pt"))
        saved.append(state["fp32_flat_groups"][0].clone())
        state["fp32_flat_groups"][0].zero_()  # training goes on
        if step == 1:
            first = [s.data_ptr() for s in engine.staging._slots["mp_rank_00_model_states.pt"]]
        engine.wait()
        assert engine.get_commit_info() is info and engine.commit(info)
    assert [s.data_ptr() for s in engine.staging._slots["mp_rank_00_model_states.pt"]] == first
    held = engine.staging.nbytes
    for step, expected in zip((1, 2), saved):
        loaded = torch.load(tmp_path / f"global_step{step}" / "mp_rank_00_model_states.pt", weights_only=False)
        assert torch.equal(loaded["fp32_flat_groups"][0], expected)
    monkeypatch.setattr(ucp_deepspeed.runtime.async_save, "_shared_memory_free", lambda: 0)
    info = CheckpointCommitInfo(tag="global_step3", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    state = _state()
    state["fp32_flat_groups"] = [torch.arange(24, dtype=torch.float32)]  # a new shape: new buffers, which do not fit
    with caplog.at_level(logging.WARNING, logger="ucp_deepspeed"):
        engine.save(state, str(tmp_path / info.tag / "mp_rank_00_model_states.pt"))
    assert "does not fit in shared memory" in caplog.text
    engine.wait()
    assert engine.get_commit_info() is info and engine.commit(info)
    loaded = torch.load(tmp_path / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
    assert torch.equal(loaded["fp32_flat_groups"][0], torch.arange(24, dtype=torch.float32))
    assert engine.staging.nbytes < held  # the old buffers of that file were let go
    engine.cleanup()


def test_buffers_are_copied_at_the_save_and_the_rest_before_the_step(tmp_path):
    """The copies into staging run behind the next forward and backward (nothing else changes before the optimizer
    step, which waits for them), except the module's buffers, which a forward changes: those are copied at the
    save. The file holds every tensor as it was at the save."""
    module = torch.nn.BatchNorm1d(4)
    engine = AsyncCheckpointEngine(module=module)
    info = CheckpointCommitInfo(tag="global_step1", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    weight = torch.ones(1 << 20)
    path = str(tmp_path / "global_step1" / "mp_rank_00_model_states.pt")
    forward_done = threading.Event()
    engine._copier.submit(forward_done.wait)  # the background copies start only after the forward below
    engine.save({"running_mean": module.running_mean, "weight": weight}, path)
    module(torch.randn(8, 4))  # the next forward moves the running statistics
    forward_done.set()
    engine.wait_staged()  # what the optimizer step waits for
    weight.add_(1)  # the step
    engine.wait()
    assert engine.get_commit_info() is info and engine.commit(info)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["running_mean"], torch.zeros(4)) and torch.equal(loaded["weight"], torch.ones(1 << 20))
    engine.cleanup()


def test_an_upload_to_the_store_runs_behind_training_and_commits_only_when_acknowledged(monkeypatch, caplog):
    """`save` returns with the state in host memory; the commit object and `latest` follow every acknowledged
    upload, and a failed upload is an error at the next commit, leaves `latest` alone and is reported at exit."""
    with s3_server() as s3:
        run = f"s3://{s3.bucket()}/run"
        guard = Guard(verify=True)
        engine = AsyncCheckpointEngine()
        engine.zipfile_serialization = True  # as DeepSpeed's default config has it
        bound = BoundEngine(engine, guard)
        release = threading.Event()
        real = ucp_deepspeed.runtime.async_save.write_file

        def slow_upload(*args, **kwargs):
            release.wait(30)
            return real(*args, **kwargs)

        monkeypatch.setattr(ucp_deepspeed.runtime.async_save, "write_file", slow_upload)
        for step, fail in ((2, False), (4, True)):
            tag_dir = f"{run}/global_step{step}"
            info = CheckpointCommitInfo(tag=f"global_step{step}", save_dir=run, save_latest=False)
            guard.pending[tag_dir] = (f"save-{step}", True)
            guard.save_id = f"save-{step}"
            bound.create(info)
            if not fail:  # spread over key prefixes, as the checkpointer asks with `key_prefixes`
                st.place(tag_dir, Spread(2))
                st.write(f"{tag_dir}/{KEYS}", Spread(2).to_json())
                guard.uploaded(f"{tag_dir}/{KEYS}", len(Spread(2).to_json()))
            path = f"{tag_dir}/mp_rank_00_model_states.pt" if not fail else f"s3://no-such-bucket-ucp/x/{step}.pt"
            state = _state()
            started = time.perf_counter()
            bound.save(state, path)
            assert time.perf_counter() - started < 5 and engine.get_commit_info() is None  # still uploading
            state["fp32_flat_groups"][0].zero_()  # training goes on
            release.set()
            engine.wait()
            if fail:
                with pytest.raises(CheckpointError, match=r"1 file\(s\) failed to write.*no-such-bucket-ucp"):
                    engine.get_commit_info()
                break
            bound.commit(engine.get_commit_info())
            release.clear()
        assert st.read_text(f"{run}/latest") == "global_step2"
        record = read_commit(f"{run}/global_step2")
        assert record is not None and record.save_id == "save-2"
        size = dict(record.objects)["mp_rank_00_model_states.pt"]
        assert size == st.stat(f"{run}/global_step2/mp_rank_00_model_states.pt")[0]
        # the upload, sent from another thread, went where the placement puts it; the commit ended the placement
        where = (
            f"{run}/{SPREAD}/{Spread(2).prefix('mp_rank_00_model_states.pt')}/global_step2/mp_rank_00_model_states.pt"
        )
        assert st.isfile(where) and not st.storage_of(run)._saving  # type: ignore[attr-defined]
        loaded = load_file(f"{run}/global_step2/mp_rank_00_model_states.pt")
        assert torch.equal(loaded["fp32_flat_groups"][0], torch.arange(12, dtype=torch.float32))  # the snapshot
        with caplog.at_level(logging.ERROR, logger="ucp_deepspeed"):
            engine._report_at_exit()
        assert "global_step4 was not committed before exit" in caplog.text
        engine.cleanup()


def test_a_failed_upload_fails_the_save_at_its_commit_and_commits_nothing(monkeypatch):
    """A save to a store whose upload fails goes on (the other ranks would wait for this one), then fails at the
    commit, naming the object; no commit object is written and `latest` keeps naming the previous save."""
    with s3_server() as s3:
        run = f"s3://{s3.bucket()}/run"
        st.write(f"{run}/latest", "global_step1")
        guard = Guard(verify=True)
        bound = BoundEngine(TorchCheckpointEngine(None), guard)
        tag_dir = f"{run}/global_step2"
        guard.pending[tag_dir], guard.save_id = ("save-2", True), "save-2"
        bound.makedirs(tag_dir, exist_ok=True)
        bound.save(_state(), f"{tag_dir}/mp_rank_00_model_states.pt")
        s3.bucket()  # the store still answers; this object's bucket does not exist
        bound.save(_state(), f"{tag_dir}/zero_pp_rank_0_mp_rank_00_optim_states.pt".replace(run, "s3://gone-ucp/run"))
        info = CheckpointCommitInfo(tag="global_step2", save_dir=run, save_latest=False)
        with pytest.raises(CheckpointError, match=r"s3://gone-ucp/run/global_step2/zero_pp.*upload failed"):
            bound.commit(info)
        assert read_commit(tag_dir) is None and st.read_text(f"{run}/latest") == "global_step1"
        assert not Path("s3:").exists()
    monkeypatch.setattr(remote, "RETRIES", 1)
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    with s3_server() as down:  # the store itself goes down mid-save
        run = f"s3://{down.bucket()}/run"
        tag_dir = f"{run}/global_step2"
        guard.pending[tag_dir], guard.save_id = ("save-2", True), "save-2"
        bound.save(_state(), f"{tag_dir}/mp_rank_00_model_states.pt")
        down.stop()
        bound.save(_state(), f"{tag_dir}/zero_pp_rank_0_mp_rank_00_optim_states.pt")
        with pytest.raises(CheckpointError, match=r"global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt: upload"):
            bound.commit(CheckpointCommitInfo(tag="global_step2", save_dir=run, save_latest=False))
