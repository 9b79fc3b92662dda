"""A job killed while saving resumes at another process count from the last complete checkpoint: the torn one
is never used, the state is bit-exact, and training continues where it was. Synchronous saves are killed inside
DeepSpeed's own file write, which ucp_deepspeed has write under a temporary name; asynchronous ones in the
background writer, after `save_checkpoint` returned."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import GPT_WORKER, torch_env
from launching import torchrun_command

from ucp_deepspeed.sources.tags import incomplete_reason

TRAIN = ["train", "--arch", "gpt", "--steps", "8", "--ckpt-every", "2", "--keep", "2", "--snapshots"]


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=torch_env(), capture_output=True, text=True, timeout=timeout)


def _killed_in_save(ckpt: Path, *extra: str) -> dict[int, float]:
    """Train on 2 ranks until the last rank is SIGKILLed while saving step 6; return the losses printed."""
    first = _run([*torchrun_command(2, GPT_WORKER), *TRAIN, "--ckpt-dir", str(ckpt), "--die-in-save", "6", *extra])
    assert first.returncode != 0, "the run was meant to be killed while saving step 6"
    before = {
        int(line.split()[1]): float(line.split()[3]) for line in first.stdout.splitlines() if line.startswith("step ")
    }
    assert sorted(before)[:6] == [1, 2, 3, 4, 5, 6]
    return before


def _check_resumed(ckpt: Path, results: Path, before: dict[int, float], live: str) -> None:
    report = json.loads(results.read_text())
    assert report["resumed"] == {"step": 4, "saved": "zero1 dp=2 fp32", "live": live, "mode": "resharded"}
    assert report["final_step"] == 8
    after = {e["step"]: e["loss"] for e in report["log"]}
    assert sorted(after) == [5, 6, 7, 8], "exactly the steps after the checkpoint were run again"
    for step in (5, 6):  # repeated steps continue from the pre-failure losses, not from scratch
        assert abs(after[step] - before[step]) <= 1e-5 * abs(before[step]), (step, after[step], before[step])

    saved = torch.load(ckpt / "saved_step4.pt", weights_only=False)
    resumed = torch.load(ckpt / "resumed_step4.pt", weights_only=False)
    for kind in ("fp32", "state"):
        assert sorted(saved[kind]) == sorted(resumed[kind]) and len(saved[kind]) >= 20
        for name in saved[kind]:
            assert torch.equal(saved[kind][name], resumed[kind][name]), f"{kind} {name}"
    assert saved["steps"].keys() == resumed["steps"].keys()
    assert all(torch.equal(saved["steps"][g], resumed["steps"][g]) for g in saved["steps"])
    tags = sorted(p.name for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("global_step"))
    assert tags == ["global_step6", "global_step8"], f"retention keeps the 2 newest complete tags, found {tags}"
    assert incomplete_reason(str(ckpt), "global_step6") is None, "step 6 was saved again, completely"
    assert (ckpt / "latest").read_text().strip() == "global_step8"


def test_killed_during_save_resumes_from_last_complete_checkpoint(tmp_path):
    ckpt, results = tmp_path / "ckpt", tmp_path / "second.json"
    before = _killed_in_save(ckpt)
    # the half-written file never took its name, and the commit waits for every rank before `latest` moves
    assert (ckpt / "latest").read_text().strip() == "global_step4", "latest names a tag a rank did not finish"
    assert "missing" in incomplete_reason(str(ckpt), "global_step6")
    assert not (ckpt / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()
    assert list((ckpt / "global_step6").glob("zero_pp_rank_1_mp_rank_00_optim_states.pt.tmp.*"))

    second = _run(
        [
            "deepspeed",
            "--num_gpus",
            "3",
            "--master_port",
            "29561",
            str(GPT_WORKER),
            *TRAIN,
            "--ckpt-dir",
            str(ckpt),
            "--results",
            str(results),
        ]
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    _check_resumed(ckpt, results, before, "zero1 dp=3 fp32")


@pytest.mark.slow
def test_async_save_killed_before_written_is_never_used(tmp_path):
    ckpt, results = tmp_path / "ckpt", tmp_path / "second.json"
    before = _killed_in_save(ckpt, "--async-save")
    assert (ckpt / "latest").read_text().strip() == "global_step4", "latest moves only once every rank has written"
    assert "missing" in incomplete_reason(str(ckpt), "global_step6")
    assert not (ckpt / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()

    second = _run(
        [*torchrun_command(1, GPT_WORKER), *TRAIN, "--async-save", "--ckpt-dir", str(ckpt), "--results", str(results)]
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    _check_resumed(ckpt, results, before, "zero1 dp=1 fp32")


def _fail_writing(monkeypatch, marker: str) -> None:
    """Every `torch.save` of a file whose name holds `marker` fails, as a process killed while writing it would."""
    real = torch.save

    def save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        if marker in str(f):
            raise OSError(f"killed while writing {f}")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_a_save_into_the_tag_latest_names_leaves_the_previous_one_until_committed(tmp_path, monkeypatch):
    """A tag saved again and again (PyTorch Lightning saves every checkpoint as tag "checkpoint", `last.ckpt` at each
    save): a save killed part-way into it leaves the previous save complete, aside, and the resume falls back to it,
    exact; the next save, complete, deletes it. Written in place, the killed save left no complete tag at all."""
    import inprocess

    inprocess.one_rank()
    engine = inprocess.build(2)
    inprocess.train(engine, 3)
    engine.save_checkpoint(str(tmp_path), tag="checkpoint")
    saved = inprocess.state(engine)
    inprocess.train(engine, 2, offset=3)
    with monkeypatch.context() as patch:
        _fail_writing(patch, "optim_states")
        with pytest.raises(Exception, match="killed while writing"):
            engine.save_checkpoint(str(tmp_path), tag="checkpoint")
    assert (tmp_path / "latest").read_text() == "checkpoint" and incomplete_reason(str(tmp_path), "checkpoint")

    resumed = inprocess.build(2, seed=1)
    path, _ = resumed.load_checkpoint(str(tmp_path))
    assert Path(path).parent.name == "ucp-replaced-checkpoint", path
    assert not inprocess.differences(saved, inprocess.state(resumed))
    with monkeypatch.context() as patch:  # killed again: the torn tag goes, the complete save aside stays
        _fail_writing(patch, "optim_states")
        with pytest.raises(Exception, match="killed while writing"):
            resumed.save_checkpoint(str(tmp_path), tag="checkpoint")
    again = inprocess.build(2, seed=2)
    again.load_checkpoint(str(tmp_path))
    assert not inprocess.differences(saved, inprocess.state(again))
    resumed.save_checkpoint(str(tmp_path), tag="checkpoint")  # complete: the save aside is gone
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["checkpoint"]
    assert incomplete_reason(str(tmp_path), "checkpoint") is None
