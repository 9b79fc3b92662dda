"""Where the data stands: a job fed by DeepSpeed's own data sampler (`deepspeed_io`, curriculum learning), saved at 2
ranks mid-epoch and resumed at 1, 2 and 4, trains next on exactly the global batches the uninterrupted run trained
on, in the same order, with the same losses; the epoch covers every sample once.

One launch per world size: the 2-rank launch saves, runs on uninterrupted, and resumes at its own size; the 1- and
4-rank launches reshard, the 1-rank one also from `ucp convert`'s universal folder of the same checkpoint and into a
job whose cluster folder lacks the saved clusters (refused).
"""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, torchrun

from ucp_deepspeed.tools.cli import main as cli_main

WORKER = ROOT / "tests" / "workers" / "data_sampler.py"
SAMPLES = 48
LOSS_RTOL = 1e-5  # the same batches; only the reduction over ranks differs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("data_sampler")
    torchrun(2, "save", "--out", str(out), worker=WORKER)
    universal = out / "universal"
    assert cli_main(["convert", str(out / "ckpt"), "--output", str(universal), "--no-progress"]) == 0
    converted = f"load --out {out} --source {universal} --name converted"
    (out / "empty").mkdir()
    refused = f"load --out {out} --clusters {out / 'empty'} --name refused"
    torchrun(1, "load", "--out", str(out), "--each", converted, "--each", refused, worker=WORKER)
    torchrun(4, "load", "--out", str(out), worker=WORKER)
    saved = json.loads((out / "saved.json").read_text())
    resumed = {
        label: json.loads((out / f"{name}{world}.json").read_text())["resumed"]
        for label, name, world in (("1", "resumed", 1), ("4", "resumed", 4), ("1, converted", "converted", 1))
    }
    found = {"2": saved, **{label: {**saved, "resumed": r} for label, r in resumed.items()}}
    found["refused"] = json.loads((out / "refused1.json").read_text())
    return found


@pytest.mark.parametrize("world", ["1", "2", "4", "1, converted"])
def test_resumed_run_trains_on_the_batches_the_uninterrupted_run_did(runs, world):
    run = runs[world]
    after, resumed = run["after"], run["resumed"]
    assert [s["ids"] for s in resumed] == [s["ids"] for s in after], f"at {world} ranks"
    for mine, theirs in zip(resumed, after):
        assert abs(mine["loss"] - theirs["loss"]) <= LOSS_RTOL * abs(theirs["loss"]), (world, mine, theirs)
    seen = [i for step in run["before"] + resumed for i in step["ids"]]
    assert sorted(seen) == list(range(SAMPLES)), f"the epoch at {world} ranks repeats or skips samples"


def test_missing_clusters_are_refused_before_anything_changes(runs):
    """The saved position names cluster files the resumed job's `data_cluster_path` lacks: one line naming the file,
    raised while reading, so the engine keeps its weights and step count."""
    found = runs["refused"]
    assert found["error"] and "cluster_seqlen" in found["error"] and "missing" in found["error"], found
    assert found["kept"], found
