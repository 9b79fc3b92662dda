"""DeepSpeed's own checkpoint writers (`"checkpoint": {"writer": ...}`) beside `"universal"`, in one process, and the
python writer at two ranks, where both write the replicated model-states file.

Each save is bound by its save id through one hook in front of whichever checkpoint engine DeepSpeed built. The
decoupled writer writes its files in another process after `save_checkpoint` returns, so the id is stamped at
commit, once they are on disk. Every saved state comes back exactly through DeepSpeed's own load (same layout) and
through a reshard (ZeRO-1 to ZeRO-2). FastPersist (`"type": "fast"`) needs an accelerator in DeepSpeed 0.19.8 and
is not tested here (docs/reference/failures.md).
"""

from __future__ import annotations

from pathlib import Path

import inprocess
import pytest
from conftest import ROOT, torchrun
from inprocess import build, differences, state, train

from ucp_deepspeed import prune

# writer -> (ZeRO stage of the saving engine, checkpoint config beside "universal")
WRITERS = {
    "python": (1, {"writer": {"type": "python", "data_parallel": "replica"}}),
    # DeepSpeed's decoupled writer itself fails on ZeRO-1/2 optimizer files, which hold slices of the fp32 partitions
    # ("Cowardly refusing to serialize non-leaf tensor which requires_grad"): its source is ZeRO-0 and ZeRO-3
    "decoupled": (0, {"writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}}),
    "decoupled-z3": (3, {"writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}}),
    "tag_validation": (1, {"tag_validation": "Fail"}),
}


@pytest.fixture(scope="module")
def one_rank() -> None:
    inprocess.one_rank()


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_writers_save_resumes_exactly(one_rank, tmp_path, monkeypatch, writer):
    for key, value in {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "1"}.items():  # what the launcher sets
        monkeypatch.setenv(key, value)
    stage, checkpoint = WRITERS[writer]
    source = build(stage, **checkpoint)
    try:
        train(source, 2)
        saved = state(source)
        source.save_checkpoint(str(tmp_path / "ckpt"))
        source.wait_for_checkpoint()  # a decoupled save is committed, and `latest` moved, here or at the next step
    finally:
        source.destroy()  # ends a decoupled writer's process, which the interpreter would wait for at exit
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    native = build(stage, seed=1)
    native.load_checkpoint(str(tmp_path / "ckpt"))
    assert native.ucp_last_load.mode == "native"
    assert differences(saved, state(native)) == []
    resharded = build(2 if stage != 2 else 1, seed=1)
    resharded.load_checkpoint(str(tmp_path / "ckpt"))
    assert resharded.ucp_last_load.mode == "resharded"
    assert differences(saved["module"], state(resharded)["module"]) == []
    assert differences(saved["counters"], state(resharded)["counters"]) == []


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
    both ranks write the 2 MB model-states file; each tag verified by rank 0. The two ranks run side by side on the
    two cores (a CPU burner beside them serializes them, and hides the race)."""
    out = tmp_path_factory.mktemp("python_writer")
    torchrun(2, "save", "--out", str(out), "--saves", str(SAVES), worker=PYTHON_WRITER, timeout=600)
    return out


def test_a_python_writer_save_never_stamps_a_file_another_rank_is_writing(python_writer_saves):
    """Both ranks wrote the replicated model-states file at the same path and each stamped it at commit: one rank
    read it while the other was still writing it ("not a torch.save archive (no data.pkl); cannot record the save
    id", 2 of 11 saves in the issue; 5 of 5 launches of 30 here). Each rank now writes its own temporary file, stamps
    it and renames it into place: all the saves pass, and every tag verifies."""
    assert sorted(p.name for p in python_writer_saves.glob("s*")) == sorted(f"s{i}" for i in range(SAVES))
    assert not list(python_writer_saves.glob("s*/*.tmp.*"))  # no rank's temporary file is left behind


@pytest.mark.slow
def test_a_python_writer_save_resumes_exactly_at_another_size(python_writer_saves):
    torchrun(1, "load", "--out", str(python_writer_saves), worker=PYTHON_WRITER)
