"""DeepSpeed's own checkpoint writers (`"checkpoint": {"writer": ...}`) beside `"universal"`, in one process, and the
python writer at two ranks, where both write the replicated model-states file.

Each save is bound by its save id through one hook in front of whichever checkpoint engine DeepSpeed built. The
decoupled writer writes its files in another process after `save_checkpoint` returns, so the id is stamped at
commit, once they are on disk. Every saved state comes back exactly through DeepSpeed's own load (same layout) and
through a reshard (ZeRO-1 to ZeRO-2). FastPersist (`"type": "fast"`, with the async_io op) runs with two test-only
shims for its buffer pinning (tests/fastpersist_cpu.py); its data-parallel writers name their files
`<file>-<rank>.<writers>`, and each save's files take DeepSpeed's own names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import fastpersist_cpu
import inprocess
import pytest
from conftest import ROOT, torchrun
from deepspeed.ops.op_builder import AsyncIOBuilder
from fastpersist_cpu import FAST
from inprocess import build, differences, state, train

from ucp_deepspeed import compat, prune
from ucp_deepspeed.runtime.native_io import unbound

# writer -> (ZeRO stage of the saving engine, checkpoint config beside "universal")
WRITERS = {
    "python": (1, {"writer": {"type": "python", "data_parallel": "replica"}}),
    # DeepSpeed's decoupled writer itself fails on ZeRO-1/2 optimizer files, which hold slices of the fp32 partitions
    # ("Cowardly refusing to serialize non-leaf tensor which requires_grad"): its source is ZeRO-0 and ZeRO-3
    "decoupled": (0, {"writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}}),
    "decoupled-z3": (3, {"writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}}),
    "tag_validation": (1, {"tag_validation": "Fail"}),
    "fast": (1, {"writer": FAST}),
    "fast-decoupled": (0, {"writer": {**FAST, "decoupled": True}}),
    "fast-z3": (3, {"writer": FAST}),
}


@pytest.fixture(scope="module")
def one_rank() -> None:
    inprocess.one_rank()


SLOW_WRITERS = {"fast-decoupled"}  # its writer process imports DeepSpeed with the shims first: 7 s


@pytest.mark.parametrize(
    "writer", [pytest.param(w, marks=pytest.mark.slow) if w in SLOW_WRITERS else w for w in WRITERS]
)
def test_a_writers_save_resumes_exactly(one_rank, tmp_path, monkeypatch, writer):
    for key, value in {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "1"}.items():  # what the launcher sets
        monkeypatch.setenv(key, value)
    stage, checkpoint = WRITERS[writer]
    if writer.startswith("fast"):
        fastpersist(monkeypatch)
    source = build(stage, **checkpoint)
    try:
        train(source, 2)
        saved = state(source)
        source.save_checkpoint(str(tmp_path / "ckpt"))
        source.wait_for_checkpoint()  # a decoupled save is committed, and `latest` moved, here or at the next step
    finally:
        source.destroy()  # ends a decoupled writer's process, which the interpreter would wait for at exit
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    # every file under DeepSpeed's own name: no FastPersist part (`-0.1`) or temporary file is left
    assert not [p.name for p in (tmp_path / "ckpt" / "global_step2").iterdir() if not p.name.endswith((".pt", ".json"))]
    native = build(stage, seed=1)
    native.load_checkpoint(str(tmp_path / "ckpt"))
    assert native.ucp_last_load.mode == "native"
    assert differences(saved, state(native)) == []
    resharded = build(2 if stage != 2 else 1, seed=1)
    resharded.load_checkpoint(str(tmp_path / "ckpt"))
    assert resharded.ucp_last_load.mode == "resharded"
    assert differences(saved["module"], state(resharded)["module"]) == []
    assert differences(saved["counters"], state(resharded)["counters"]) == []


def test_a_fastpersist_save_written_without_us_resumes_exactly(one_rank, tmp_path, monkeypatch):
    """Plain DeepSpeed's FastPersist save at ZeRO-1 leaves only `<file>-0.1` parts, which DeepSpeed's own load does not
    find (it asks for `<file>`); every read here finds each file under its part name, so the tag resumes at its own
    layout (through our reader, not DeepSpeed's load) and at ZeRO-2, every state exact, the folder untouched."""
    for key, value in {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    fastpersist(monkeypatch)
    source = build(1, universal={"enabled": False}, writer=FAST)
    train(source, 2)
    saved = state(source)
    source.save_checkpoint(str(tmp_path / "ckpt"))
    tag = tmp_path / "ckpt" / "global_step2"
    written = sorted((p.name, p.stat().st_mtime_ns) for p in tag.iterdir())
    assert [name for name, _ in written] == [
        "mp_rank_00_model_states.pt-0.1",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt-0.1",
    ]
    same = build(1, seed=1)
    same.load_checkpoint(str(tmp_path / "ckpt"))
    assert same.ucp_last_load.mode == "resharded"
    assert differences(saved, state(same)) == []
    other = build(2, seed=1)
    other.load_checkpoint(str(tmp_path / "ckpt"))
    assert other.ucp_last_load.mode == "resharded"
    assert differences(saved["module"], state(other)["module"]) == []
    assert differences(saved["counters"], state(other)["counters"]) == []
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tag.iterdir()) == written


@pytest.mark.parametrize(
    "asynchronous", [pytest.param(False, marks=pytest.mark.slow), True], ids=["sync", "async"]
)  # the async one commits from the step's hook; the sync one is one call after DeepSpeed's save (slow: 4 s)
def test_latest_is_made_durable_after_its_commit(one_rank, tmp_path, monkeypatch, asynchronous):
    """DeepSpeed writes `latest` with a plain `open` after the commit: a crash could take the commit back. It is
    fsynced, and so is its folder, after a synchronous save and at the step that commits an asynchronous one."""
    import ucp_deepspeed.io.atomic

    synced: list[str] = []
    real = ucp_deepspeed.io.atomic._fsync
    monkeypatch.setattr(ucp_deepspeed.io.atomic, "_fsync", lambda path: (synced.append(str(path)), real(path)))
    engine = build(1, universal={"async_save": asynchronous})
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    if asynchronous:
        assert str(tmp_path / "ckpt" / "latest") not in synced  # not committed yet
        unbound(engine).wait()  # its files are written
        train(engine, 1, 1)  # the step's boundary commits it
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step1"
    assert synced[-2:] == [str(tmp_path / "ckpt" / "latest"), str(tmp_path / "ckpt")]
    engine.destroy()


def fastpersist(monkeypatch: pytest.MonkeyPatch) -> None:
    """FastPersist's CPU shims in this process, and in the process a decoupled writer spawns (its sitecustomize)."""
    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("FastPersist needs DeepSpeed's async_io op, which needs libaio (libaio-dev)")
    for target, name, value in fastpersist_cpu.shims():
        monkeypatch.setattr(target, name, value)
    monkeypatch.setenv("UCP_TEST_FASTPERSIST", "1")
    path = os.pathsep.join([str(ROOT / "tests" / "site"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_keep_last_retains_the_newest_complete_tags(one_rank, tmp_path, asynchronous):
    """`"keep_last": 2`: after each save only the two newest complete tags are left; an async save counts once it
    is committed (at the next save or `wait_for_checkpoint`)."""
    source = build(1, universal={"keep_last": 2, "async_save": asynchronous})
    ckpt = tmp_path / "ckpt"
    for step in range(4):
        train(source, 1, step)
        source.save_checkpoint(str(ckpt))
    source.wait_for_checkpoint()
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["global_step3", "global_step4"]
    assert (ckpt / "latest").read_text() == "global_step4"
    (ckpt / "latest").write_text("global_step3")  # a job pointed back at an older tag: it is never deleted
    assert prune(str(ckpt), 1) == []
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["global_step3", "global_step4"]


PYTHON_WRITER = ROOT / "tests" / "workers" / "python_writer.py"
SAVES = 30


@pytest.fixture(scope="module")
def python_writer_saves(tmp_path_factory) -> Path:
    """30 saves in a row at 2 ranks through DeepSpeed's python writer with `"data_parallel": "replica"`, under which
    both ranks write the 2 MB model-states file, then 2 through FastPersist into fast/ (and one by plain DeepSpeed into
    fast-plain/); each tag verified by rank 0.
    The two ranks run side by side on the two cores (a CPU burner beside them serializes them, and hides the
    race)."""
    out = tmp_path_factory.mktemp("python_writer")
    fast = "2" if AsyncIOBuilder().is_compatible(verbose=False) else "0"
    torchrun(2, "save", "--out", str(out), "--saves", str(SAVES), "--fast", fast, worker=PYTHON_WRITER, timeout=600)
    return out


def test_a_python_writer_save_never_stamps_a_file_another_rank_is_writing(python_writer_saves):
    """Both ranks wrote the replicated model-states file at the same path and each stamped it at commit: one rank
    read it while the other was still writing it ("not a torch.save archive (no data.pkl); cannot record the save
    id", 2 of 11 saves in the issue; 5 of 5 launches of 30 here). Each rank now writes its own temporary file, stamps
    it and renames it into place: all the saves pass, and every tag verifies."""
    assert sorted(p.name for p in python_writer_saves.glob("s*")) == sorted(f"s{i}" for i in range(SAVES))
    assert not list(python_writer_saves.glob("s*/*.tmp.*"))  # no rank's temporary file is left behind


def test_writer_cpus_one_rank_lacks_fail_the_engine_on_every_rank(python_writer_saves):
    """`"async_writer_cpus"` only rank 1's machine lacks: both ranks raise rank 1's reason, naming the option; before,
    rank 1 raised alone and rank 0 waited for it in the next collective."""
    raised = json.loads((python_writer_saves / "writer-cpus.json").read_text())
    assert len(raised) == 2 and all(r and "async_writer_cpus" in r and "[4096]" in r for r in raised), raised


def test_fastpersist_parts_take_deepspeed_names_at_two_ranks(python_writer_saves):
    """FastPersist's data-parallel writers wrote `mp_rank_00_model_states.pt-0.2` and `-1.2` (each the whole
    archive) and each rank's optimizer file with its part suffix; the commit then stamped `mp_rank_00_model_states.pt`,
    which no rank had written, and failed. Each rank's part is now stamped and renamed to DeepSpeed's name: the saves
    verify (the launch checks) and hold DeepSpeed's names only."""
    if not (python_writer_saves / "fast").is_dir():
        pytest.skip("FastPersist needs DeepSpeed's async_io op, which needs libaio (libaio-dev)")
    for tag in ("s0", "s1"):
        names = sorted(p.name for p in (python_writer_saves / "fast" / tag).iterdir())
        assert [n for n in names if n.endswith(".pt")] == [
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ]
        assert all(n.endswith((".pt", ".json")) for n in names), names
    # the same by plain DeepSpeed: its parts stay as written, and the resume at 1 rank (slow) reads them
    assert sorted(p.name for p in (python_writer_saves / "fast-plain" / "s0").iterdir()) == [
        "mp_rank_00_model_states.pt-0.2",
        "mp_rank_00_model_states.pt-1.2",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt-0.2",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt-1.2",
    ]


@pytest.mark.slow
def test_a_python_writer_save_resumes_exactly_at_another_size(python_writer_saves):
    torchrun(1, "load", "--out", str(python_writer_saves), worker=PYTHON_WRITER)


def test_written_suffix(one_rank, monkeypatch):
    """The compat canary of `written_suffix` (here, beside the other in-process writer engines: built after
    tests/test_compat.py's engines, these left the next module's engines without a data-parallel group): FastPersist's
    data-parallel writers (ZeRO-0/1/2, decoupled or not) add `-<writer rank>.<writers>` to each name they are given;
    at ZeRO-3, and for every other writer, the name is DeepSpeed's."""
    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("FastPersist needs DeepSpeed's async_io op, which needs libaio (libaio-dev)")
    for key, value in {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    for target, name, value in fastpersist_cpu.shims():
        monkeypatch.setattr(target, name, value)
    for stage, writer, expected in (
        (1, FAST, "-0.1"),
        (3, FAST, ""),
        (1, {"type": "python", "data_parallel": "replica"}, ""),
    ):
        engine = build(stage, writer=writer)
        try:
            assert compat.written_suffix(engine) == expected, (stage, writer)
        finally:
            engine.destroy()
