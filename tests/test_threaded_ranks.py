"""Every rank of a shared conversion at worlds of 8, 64 and 256, as threads of one process: `convert_across_ranks`.

Each rank is a thread with its own rank in torch's multi-threaded process group (the one PyTorch's DCP tests use
to check multi-rank logic without launching processes), so `broadcast_object_list` and `all_gather_object`
really move objects between ranks: rank 0 alone checks the source and owns the output folder, every rank
converts its share of the files (`shard_jobs`), rank 0 checks what all of them read and writes the manifest.
Run on real DP=2 checkpoints (ZeRO-1 and ZeRO-3), the folder every rank returns must equal, with `torch.equal`,
a single-process `convert` of the same tag, and the files must have been written by several ranks, each file by
exactly one. A failure on one rank (not rank 0) must be raised on every rank, with no manifest written; a second
call reuses the finished folder without converting anything. That failure is a RuntimeError, a MemoryError or a
damaged file: every exception reaches every rank (`collective.guarded`); before, only a bad file did, and the
other ranks waited in a collective until its timeout.

Measured on the 2-core CI machine: world 8, 0.3 s a case; world 64, 2-8 s a case; world 256, one conversion about
12 s (the `scale` run, with the 16-process launch). Threads share one GIL and every rank decodes every rank's
object at each gather, so the cost grows with the square of the world: 512 ranks took about 130 s and 1024 did
not finish in 29 minutes. Worlds of 1024 are simulated per rank instead (`tests/test_simulated_ranks.py`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

import ucp_deepspeed.runtime.shared_convert as shared_convert
from ucp_deepspeed import UniversalCheckpoint, convert
from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.paths import INTENT
from ucp_deepspeed.format.universal import MANIFEST, is_complete, read_manifest
from ucp_deepspeed.runtime.shared_convert import convert_across_ranks
from ucp_deepspeed.sources import NativeCheckpoint

TAG = "global_step3"
FAILING_RANK = 3  # not rank 0, which alone owns the output folder and writes the manifest
TIMEOUT = {8: 120.0, 64: 300.0, 256: 600.0}  # seconds a healthy world may take, on a slow and busy machine
GRACE = {8: 15.0, 64: 30.0, 256: 120.0}  # seconds the other ranks may take to end once one rank has ended
SLOW, SCALE = pytest.mark.slow, pytest.mark.scale


def run_ranks(world: int, work: Callable[[int], Any], timeout: float, grace: float) -> list[Any]:
    """Run `work(rank)` on `world` threads, each one rank of a real threaded process group; per rank, what it
    returned or the exception it raised.

    Why a helper of our own: `spawn_threads_and_init_comms` and `MultiThreadedTestCase` live in
    `common_distributed`, which imports `expecttest` (not installed here), and they turn any rank's exception into
    a test failure, while these tests expect ranks to raise and check what each one raised. It does what they do
    (install `ThreadLocalWorld`, one `init_process_group("threaded")` per thread over one `HashStore`) and always
    undoes it, even on failure: the group, the thread-isolation mode, and `sys.excepthook`, which every
    `init_process_group` wraps once more. A rank that raises or returns alone leaves the others waiting in their
    next collective for ever, as a real job would: once some rank has ended, the rest must end within `grace`
    seconds, and all within `timeout`, or the waiting ranks are woken (`ProcessLocalGroup.exception_handle`, they
    exit with `SystemExit`) and the call fails, naming them. The GIL switch interval is raised to 0.5 s meanwhile:
    every torch op drops the GIL, and with hundreds of runnable threads the default 5 ms turns each drop into a
    handoff (three `all_gather_object` over 256 threads: 39 s at 5 ms, 13 s at 0.5 s).
    """
    outcomes: list[Any] = [None] * world
    ended = threading.Event()
    hook, interval = sys.excepthook, sys.getswitchinterval()
    threaded_world = _install_threaded_pg()
    try:
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        sys.setswitchinterval(0.5)
        store = dist.HashStore()

        def rank_main(rank: int) -> None:
            try:
                dist.init_process_group(backend="threaded", rank=rank, world_size=world, store=store)
                outcomes[rank] = work(rank)
            except BaseException as exc:  # the caller checks what each rank raised
                outcomes[rank] = exc
            finally:
                ended.set()
                if dist.distributed_c10d._world is threaded_world and dist.is_initialized():
                    dist.destroy_process_group()

        threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            if ended.is_set():
                deadline = min(deadline, time.monotonic() + grace)
            next(t for t in threads if t.is_alive()).join(0.5)
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            errors = {r: f"{type(o).__name__}: {o}" for r, o in enumerate(outcomes) if isinstance(o, BaseException)}
            ProcessLocalGroup.exception_handle(None)  # wake the waiting ranks: they exit with SystemExit
            for t in threads:
                t.join(10)
            pytest.fail(
                f"{len(stuck)} of {world} ranks never returned (first: {stuck[:5]}); "
                f"ranks that raised: {dict(list(errors.items())[:5])}"
            )
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        sys.excepthook = hook
        sys.setswitchinterval(interval)
    return outcomes


@pytest.fixture(scope="module")
def reference(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A single-process `convert` of each source: what every world must produce."""
    out = tmp_path_factory.mktemp("reference")
    return {name: convert(str(sources[name]), TAG, output=str(out / name), progress=False) for name in ("z1", "z3")}


def record_shares(
    monkeypatch: pytest.MonkeyPatch, fail_rank: int | None = None, error: BaseException | None = None
) -> dict[int, list[str]]:
    """Wrap the `run_jobs` of `convert_across_ranks`: per rank that ran its share, the files it returned (filled in
    as the ranks run). Rank `fail_rank` raises `error` instead of converting its share."""
    written: dict[int, list[str]] = {}
    real = shared_convert.run_jobs

    def run_jobs(src: NativeCheckpoint, out: str, jobs: list[Any], *args: Any) -> list[Any]:
        rank = dist.get_rank()
        if rank == fail_rank:
            assert error is not None
            raise error
        records = real(src, out, jobs, *args)
        written[rank] = [r.path for r in records]
        return records

    monkeypatch.setattr(shared_convert, "run_jobs", run_jobs)
    return written


def assert_same_state(got: Any, want: Any, where: str = "state") -> None:
    """`got` equals `want`: containers item by item, tensors with `torch.equal` and the same dtype."""
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_same_state(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_state(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def assert_same_checkpoint(got: str, want: str) -> None:
    """The universal folder `got` holds exactly what `want` holds: manifest, every parameter state, buffers, state."""
    a, b = UniversalCheckpoint(got), UniversalCheckpoint(want)
    try:
        assert a.manifest.params == b.manifest.params
        assert a.manifest.param_groups == b.manifest.param_groups
        assert a.manifest.counters == b.manifest.counters
        assert a.manifest.buffers == b.manifest.buffers
        assert a.manifest.files == b.manifest.files  # the same bytes: sizes and CRCs of every file
        for name, record in b.params.items():
            for key in record.keys:
                assert torch.equal(a.read(name, key), b.read(name, key)), (name, key)
        for name in b.buffers:
            assert torch.equal(a.read_buffer(name), b.read_buffer(name)), name
        assert_same_state(a.load_state(), b.load_state())
    finally:
        a.close()
        b.close()


def convert_on_every_rank(world: int, ckpt_dir: Path, out: Path) -> list[Any]:
    """Per rank of a world, the folder `convert_across_ranks` returned or what it raised."""

    def work(rank: int) -> str:
        return convert_across_ranks(str(ckpt_dir), TAG, output=str(out))

    return run_ranks(world, work, TIMEOUT[world], GRACE[world])


@pytest.mark.parametrize(
    ("world", "source"),
    [(8, "z1"), (8, "z3"), (64, "z1"), pytest.param(64, "z3", marks=SLOW), pytest.param(256, "z1", marks=SCALE)],
)
def test_every_rank_converts_its_share_and_all_return_one_folder(
    sources, reference, tmp_path, monkeypatch, world, source
):
    out = tmp_path / "out"
    written = record_shares(monkeypatch)
    started = time.monotonic()
    results = convert_on_every_rank(world, sources[source], out)
    converted = time.monotonic() - started
    assert results == [str(out)] * world, [r for r in results if r != str(out)][:3]
    assert_same_checkpoint(str(out), reference[source])

    files = sorted(read_manifest(str(out)).files)
    assert sorted(written) == list(range(world))  # every rank ran its share, empty or not
    shares = [paths for _, paths in sorted(written.items())]
    assert sorted(p for paths in shares for p in paths) == files  # each file written once, by one rank
    busy = sum(1 for paths in shares if paths)
    assert busy > 1 and busy == min(world, len(files)), busy  # spread over the ranks, as far as the files go

    # A second call finds the finished folder: every rank returns it and no rank converts anything.
    manifest = out / MANIFEST
    stamp = manifest.stat().st_mtime_ns, manifest.read_bytes()
    written.clear()
    started = time.monotonic()
    again = convert_on_every_rank(world, sources[source], out)
    reused = time.monotonic() - started
    assert again == [str(out)] * world, [r for r in again if r != str(out)][:3]
    assert written == {}
    assert (manifest.stat().st_mtime_ns, manifest.read_bytes()) == stamp
    print(f"world {world} {source}: converted in {converted:.1f} s, reused in {reused:.1f} s")


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(RuntimeError("injected: out of memory"), id="RuntimeError"),
        pytest.param(MemoryError("injected"), id="MemoryError"),
        pytest.param(CheckpointError("/injected/params/w.safetensors", "injected: short read"), id="CheckpointError"),
    ],
)
@pytest.mark.parametrize("world", [8, pytest.param(64, marks=SLOW)])
def test_a_failure_on_one_rank_is_raised_on_every_rank(sources, reference, tmp_path, monkeypatch, world, error):
    out = tmp_path / "out"
    written = record_shares(monkeypatch, fail_rank=FAILING_RANK, error=error)
    results = convert_on_every_rank(world, sources["z1"], out)
    if isinstance(error, CheckpointError):
        expected = (error.path, error.reason)
    else:  # `failure_of`: an error that names no file names the rank
        expected = (f"rank {FAILING_RANK}", f"{type(error).__name__}: {error}")
    for rank, outcome in enumerate(results):
        if rank == FAILING_RANK and outcome is error:
            continue  # the failing rank may raise its own error, chained or not; the others get the fanned one
        assert isinstance(outcome, CheckpointError), (rank, outcome)
        assert (outcome.path, outcome.reason) == expected, rank
        assert str(outcome) == f"{expected[0]}: {expected[1]}"
    assert not is_complete(str(out))  # no manifest: the folder is not a finished conversion
    assert (out / INTENT).is_file()  # still marked as a conversion in progress
    assert FAILING_RANK not in written and len(written) == world - 1

    # A healthy rerun finishes the same folder, keeping the files the other ranks wrote (their CRCs still match).
    left = {p: (out / p).stat().st_mtime_ns for paths in written.values() for p in paths}
    assert left
    monkeypatch.undo()
    assert convert_on_every_rank(world, sources["z1"], out) == [str(out)] * world
    assert_same_checkpoint(str(out), reference["z1"])
    assert {p: (out / p).stat().st_mtime_ns for p in left} == left


def test_what_a_rank_opened_is_released_when_another_rank_fails():
    """`collective.guarded(work, release=...)`: the ranks whose `work` succeeded free its result (an extension tag's
    readers, opened on every rank) when another rank's failed; the failing rank had nothing to free."""
    from ucp_deepspeed.runtime.collective import guarded

    released: list[int] = []

    def work(rank: int) -> int:
        if rank == FAILING_RANK:
            raise CheckpointError("tag/rank3.pt", "damaged")
        return rank

    outcomes = run_ranks(8, lambda rank: guarded(lambda: work(rank), release=released.append), 120.0, 15.0)
    assert all(isinstance(o, CheckpointError) and o.path == "tag/rank3.pt" for o in outcomes), outcomes
    assert sorted(released) == [r for r in range(8) if r != FAILING_RANK]
    assert run_ranks(8, lambda rank: guarded(lambda: rank, release=released.append), 120.0, 15.0) == list(range(8))
    assert len(released) == 7  # nothing released when every rank succeeded

    def failing_release(_: object) -> None:
        raise OSError("close failed")

    outcomes = run_ranks(8, lambda rank: guarded(lambda: work(rank), release=failing_release), 120.0, 15.0)
    assert all(isinstance(o, CheckpointError) and o.path == "tag/rank3.pt" for o in outcomes), outcomes
